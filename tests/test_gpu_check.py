"""benchmarks/gpu_check.py runs on the CPU with --tiny and prints the issue-27 tables (zoo: minutes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.zoo
def test_gpu_check_tiny_runs() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--tiny-meta"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "|---" not in line]
    equivalence = [r for r in rows if "| cpu |" in r]
    assert len(equivalence) == 12
    for row in equivalence:  # verification passed and the attention calls equal eager's, every model and dtype
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4] == "passed" and cells[5] == "yes", row
    saves = [r for r in rows if r.startswith("| Llama 8 x")]
    assert len(saves) == 1 and saves[0].strip("| ").endswith("| 0"), saves  # the loaded module computes the same
