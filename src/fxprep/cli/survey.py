"""The zoo survey: every model of a zoo prepared in its own subprocess, as one report.

Each model runs in a fresh process (``python -m fxprep.cli.survey`` for one row, or a fork-server
child) under a timeout, so a crash, a hang or an out-of-memory kill costs one row of the report,
not the survey. The report is markdown plus JSON, with the environment it was measured in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import api
from ..errors import EquivalenceError, FxprepError, ModelError
from ..version import __version__
from .specs import resolve

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

# --- one model -----------------------------------------------------------------------------------
STATUSES = ("passed", "opaque", "verify_failed", "failed", "model_error", "timeout", "crashed")


@dataclass
class SurveyResult:
    """One row of a survey: what happened to one model, and how long it took."""

    spec: str
    status: str
    seconds: float = 0.0
    build_seconds: float = 0.0
    tracer: str | None = None
    parameters: int = 0
    added: int = 0
    unrolled: int = 0
    left_functional: int = 0
    leaves: dict[str, str] = field(default_factory=dict)
    verification: str = ""
    max_abs_diff: float | None = None
    error_type: str | None = None
    error: str | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["max_abs_diff"] is not None and not math.isfinite(d["max_abs_diff"]):
            d["max_abs_diff"] = str(d["max_abs_diff"])
        return d


def _first_lines(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n])[:600]


def run_one(spec: str, inputs: Iterable[str] = (), **options: Any) -> SurveyResult:
    """Build and prepare one model in this process; every outcome becomes a :class:`SurveyResult`."""

    t0 = time.perf_counter()
    try:
        built = resolve(spec, inputs)
    except Exception as err:  # noqa: BLE001 - a survey row, not a crash
        return SurveyResult(spec, "model_error", build_seconds=time.perf_counter() - t0,
                            error_type=type(err).__name__, error=_first_lines(str(err)))
    build = time.perf_counter() - t0
    params = sum(p.numel() for p in built.model.parameters())
    t1 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            gm = api.prepare_model(built.model, example_inputs=built.example_inputs, **options)
    except ModelError as err:
        return SurveyResult(spec, "model_error", time.perf_counter() - t1, build, parameters=params,
                            error_type=type(err).__name__, error=_first_lines(str(err)))
    except EquivalenceError as err:
        return SurveyResult(spec, "verify_failed", time.perf_counter() - t1, build, parameters=params,
                            max_abs_diff=err.max_abs_diff, error_type=type(err).__name__, error=_first_lines(str(err)))
    except Exception as err:  # noqa: BLE001 - a survey row records any failure of one model and goes on
        return SurveyResult(spec, "failed", time.perf_counter() - t1, build, parameters=params,
                            error_type=type(err).__name__, error=_first_lines(str(err), 4))
    seconds = time.perf_counter() - t1
    report = gm.fxprep_report
    v = report.verification
    status = "verify_failed" if v.status == "failed" else ("opaque" if report.leaves else "passed")
    return SurveyResult(
        spec, status, seconds, build, tracer=report.tracer, parameters=params, added=len(report.added),
        unrolled=len(report.unrolled), left_functional=len(report.left), leaves=dict(report.leaves),
        verification=v.status, max_abs_diff=v.max_abs_diff, note=built.note,
    )


# --- the survey ----------------------------------------------------------------------------------
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def _child(spec: str, inputs: list[str], conn: Any) -> None:
    """Body of one survey process: run one model, send its row back."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(_CHILD_ENV)
    torch.set_num_threads(1)
    try:
        result = run_one(spec, inputs)
    except BaseException as err:  # noqa: BLE001 - the row must come back whatever happens
        result = SurveyResult(spec, "crashed", error_type=type(err).__name__, error=_first_lines(str(err)))
    conn.send(result.to_dict())
    conn.close()


_CONTEXTS: dict[tuple[str, ...], Any] = {}


def _context(preload: tuple[str, ...]) -> Any:
    """A multiprocessing context whose processes start from a server that has already imported
    torch and the zoo (a fork server): a fresh, isolated process per model without paying the
    imports every time. ``spawn`` where fork is unavailable."""
    import multiprocessing as mp

    if preload not in _CONTEXTS:
        ctx: BaseContext
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
        else:
            ctx = mp.get_context("spawn")
        _CONTEXTS[preload] = ctx
    return _CONTEXTS[preload]


def run_in_subprocess(spec: str, timeout: float, inputs: Iterable[str] = (),
                      preload: tuple[str, ...] = ("torch", "fxprep.cli.survey")) -> SurveyResult:
    """:func:`run_one` in its own process (one thread), killed after ``timeout`` seconds. A crash,
    a hang or an out-of-memory kill becomes a ``crashed``/``timeout`` row."""
    ctx = _context(preload)
    start = time.perf_counter()
    receive, send = ctx.Pipe(duplex=False)
    os.environ.update({k: v for k, v in _CHILD_ENV.items() if k not in os.environ})
    proc = ctx.Process(target=_child, args=(spec, list(inputs), send), daemon=True)
    proc.start()
    send.close()
    data = None
    try:
        if receive.poll(timeout):
            data = receive.recv()
    except (EOFError, OSError):
        data = None
    finally:
        if data is None and proc.is_alive():
            proc.kill()
        proc.join(10)
        receive.close()
    elapsed = time.perf_counter() - start
    if data is not None:
        if isinstance(data.get("max_abs_diff"), str):
            data["max_abs_diff"] = float(data["max_abs_diff"])
        return SurveyResult(**data)
    if elapsed >= timeout:
        return SurveyResult(spec, "timeout", elapsed, error=f"no result within {timeout:g}s")
    return SurveyResult(spec, "crashed", elapsed, error_type=f"exit {proc.exitcode}",
                        error="the process died without a result (segfault or out of memory?)")


@dataclass
class Survey:
    """All rows of a survey plus the environment they were measured in."""

    zoo: str
    results: list[SurveyResult]
    environment: dict[str, Any]
    wall_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        counts = {s: sum(r.status == s for r in self.results) for s in STATUSES}
        times = [r.seconds for r in self.results if r.status in ("passed", "opaque")]
        return {
            "models": len(self.results),
            "passed": counts["passed"],
            "opaque": counts["opaque"],
            "failed": len(self.results) - counts["passed"] - counts["opaque"],
            "by_status": counts,
            "median_prepare_seconds": round(statistics.median(times), 3) if times else None,
            "wall_seconds": round(self.wall_seconds, 1),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"zoo": self.zoo, "environment": self.environment, "summary": self.summary(),
                "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Survey:
        """Read back a survey JSON (to re-render its markdown)."""
        results = []
        for r in data["results"]:
            r = dict(r)
            if isinstance(r.get("max_abs_diff"), str):
                r["max_abs_diff"] = float(r["max_abs_diff"])
            results.append(SurveyResult(**r))
        return cls(data["zoo"], results, data.get("environment", {}), data.get("summary", {}).get("wall_seconds", 0.0))

    def to_markdown(self) -> str:
        s = self.summary()
        env = self.environment
        median = "-" if s["median_prepare_seconds"] is None else f"{s['median_prepare_seconds']:.2f}s"
        md = [
            f"# fxprep survey: {self.zoo}",
            "",
            f"Measured {env.get('date', '')} with fxprep {env.get('fxprep')}"
            + (f" (commit {env['fxprep_commit']})" if env.get("fxprep_commit") else "")
            + f", torch {env.get('torch')}"
            + (f", {self.zoo} {env.get('zoo_version')}" if env.get("zoo_version") else "")
            + f", on {env.get('machine', 'this machine')}; each model in its own process "
            f"(timeout {env.get('timeout')}s, random weights, `prepare_model(model, example_inputs=...)` with defaults). "
            "Weight matrices that random init leaves at exactly zero (the ViT heads) are re-drawn, so no output "
            "is identically 0 and verification compares real values.",
            "",
            "| models | passed | opaque | failed | median prepare time |",
            "|---:|---:|---:|---:|---:|",
            f"| {s['models']} | {s['passed']} | {s['opaque']} | {s['failed']} | {median} |",
            "",
            "Statuses: **passed** = captured, every compute op a module, verified; **opaque** = verified, but "
            "some submodules stayed opaque leaves (listed); **verify_failed** = prepared module differs; "
            "**failed** = could not be captured; **model_error** = the model (or the harness input) failed "
            "on its own; **timeout** / **crashed** = the subprocess did not report.",
            "",
            "By status: " + ", ".join(f"{k} {v}" for k, v in s["by_status"].items() if v),
            "",
            "| model | status | tracer | params | prepare s | added | unrolled | left | max abs diff | opaque parts / error |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.results:
            detail = ", ".join(f"`{k}` ({_short(v)})" for k, v in r.leaves.items()) if r.leaves else ""
            if r.error:
                detail = _short(f"{r.error_type}: {r.error}")[:300]
            detail = detail.replace("|", "/")
            diff = "" if r.max_abs_diff is None else f"{r.max_abs_diff:.2g}"
            md.append(
                f"| {r.spec} | {r.status} | {r.tracer or ''} | {r.parameters / 1e6:.1f}M | {r.seconds:.2f} | "
                f"{r.added} | {r.unrolled} | {r.left_functional} | {diff} | {detail} |"
            )
        return "\n".join(md) + "\n"


def _git_commit() -> str | None:

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _short(text: str) -> str:
    """One line, without the site-packages prefix of file paths and the 'opaque: ' tag."""
    text = re.sub(r"\S*/site-packages/", "", text.replace("\n", " "))
    return re.sub(r"\s+", " ", text.removeprefix("opaque: ")).strip()


def environment(zoo: str, timeout: float, jobs: int) -> dict[str, Any]:
    import platform

    version = None
    with contextlib.suppress(ImportError):
        version = importlib.import_module(zoo).__version__ if zoo in ("torchvision", "timm", "transformers") else None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "fxprep": __version__,
        "fxprep_commit": os.environ.get("FXPREP_COMMIT") or _git_commit(),
        "torch": torch.__version__,
        "zoo_version": version,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} core(s) visible, 1 thread per model",
        "timeout": timeout,
        "jobs": jobs,
    }


def survey(
    zoo: str,
    specs: list[str],
    *,
    jobs: int = 1,
    timeout: float = 600.0,
    on_result: Callable[[SurveyResult], None] | None = None,
) -> Survey:
    """Run :func:`run_in_subprocess` over ``specs`` with ``jobs`` workers, in spec order."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    results: dict[str, SurveyResult] = {}
    preload = ("torch", "fxprep.cli.survey", *([zoo] if zoo in ("torchvision", "timm", "transformers") else []))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_in_subprocess, spec, timeout, (), preload): spec for spec in specs}
        from concurrent.futures import as_completed

        for fut in as_completed(futures):
            result = fut.result()
            results[futures[fut]] = result
            if on_result is not None:
                on_result(result)
    ordered = [results[s] for s in specs]
    return Survey(zoo, ordered, environment(zoo, timeout, jobs), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """``python -m fxprep.cli.survey SPEC [--input=...]``: one survey row as a JSON line on stdout."""
    import warnings

    warnings.filterwarnings("ignore")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m fxprep.cli.survey SPEC [--input=DIMS ...]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    spec, inputs = argv[0], [a.removeprefix("--input=") for a in argv[1:]]
    try:
        result = run_one(spec, inputs)
    except FxprepError as err:
        result = SurveyResult(spec, "failed", error_type=type(err).__name__, error=_first_lines(str(err)))
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
