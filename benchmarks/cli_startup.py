"""How long ``fxprep --help`` and ``fxprep --version`` take, each in a fresh process (issue 61).

They import neither torch nor the model zoos (``fxprep/__init__.py`` imports its public names on
first use, the typer application imports no torch), so they answer in a fraction of a second where
they took 4.6 s (``--help``) on the 2-core machine, and ``--version`` did not exist. The target is
under 1 s; this prints the median and the spread of ``--runs`` runs, with a bare ``python -c pass``
and ``python -c "import torch"`` beside them for scale, and exits 1 if a median is over ``--limit``.

    python benchmarks/cli_startup.py                       # this checkout's fxprep, 7 runs each
    python benchmarks/cli_startup.py --fxprep .venv/bin/fxprep --runs 11
    make cli-startup
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        out.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{command} exited {proc.returncode}: {proc.stderr[-500:]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fxprep", help="the fxprep executable (default: this Python with this checkout's src)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--limit", type=float, default=1.0, help="seconds a median may take (exit 1 above)")
    opts = parser.parse_args()
    fxprep = [opts.fxprep] if opts.fxprep else [sys.executable, "-c", "from fxprep.cli import console_main; console_main()"]
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"], False),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"], False),
        ("fxprep --help", [*fxprep, "--help"], True),
        ("fxprep --version", [*fxprep, "--version"], True),
        ("fxprep prepare --help", [*fxprep, "prepare", "--help"], True),
    ]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {opts.runs} runs each, alternating")
    results: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(opts.runs):  # alternated, so that the machine's load falls on every row alike
        for name, command, _ in rows:
            results[name] += timed(command, 1)
    print("| command | median s | min s | max s |\n|---|---|---|---|")
    slow = []
    for name, _, checked in rows:
        values = results[name]
        median = statistics.median(values)
        print(f"| `{name}` | {median:.2f} | {min(values):.2f} | {max(values):.2f} |")
        if checked and median > opts.limit:
            slow.append(name)
    if slow:
        print(f"over {opts.limit:g} s: {', '.join(slow)}")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
