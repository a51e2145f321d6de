"""Prepare time and peak-memory growth of ``fxprep.prepare_model`` against raw ``torch.fx.symbolic_trace``.

Why this exists: fxprep promises to be a drop-in for AIMET's ``prepare_model`` that costs about as
much as the ``torch.fx`` trace it starts from (target: fx-path prepare time <= 2x
``symbolic_trace``) and never copies weights (target: peak RSS growth < 5% of the parameter bytes).
Both claims are cheap to break by accident - a deepcopy in a pass, a second trace, an extra forward
pass - so they are measured, not assumed.

Every measurement runs in a fresh subprocess: the model is built, ``VmHWM`` is reset through
``/proc/self/clear_refs`` so the peak of building the model does not hide the peak of preparing it,
then one call of the method under test is timed, and the growth is ``VmHWM`` after the call minus
``VmRSS`` before it. The first call in a process is what a user pays (imports are done before the
clock starts, but first-use caches are not); a second call on the same model is timed as well, to
show the steady-state cost. Each (model, method) pair is measured ``--runs`` times and the median
is reported.

Run ``.venv/bin/python benchmarks/prepare_bench.py`` (``--help`` for options). Keep the machine
otherwise idle: the numbers are wall-clock times with ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

MODELS = ("resnet50", "vit_b_16", "swin_t", "bert_base")
METHODS = ("symbolic_trace", "fxprep_fx", "fxprep_fx_verify", "aimet")
METHOD_LABELS = {
    "symbolic_trace": "torch.fx.symbolic_trace",
    "fxprep_fx": "fxprep (no verification)",
    "fxprep_fx_verify": "fxprep + verification",
    "aimet": "AIMET prepare_model",
}
TIME_TARGET = 2.0  # fx-path prepare time / symbolic_trace time
RSS_TARGET = 5.0  # peak RSS growth, % of parameter bytes


# --- worker side -----------------------------------------------------------------------------------
def _memory_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB, from /proc (no psutil dependency)."""
    with open("/proc/self/status") as f:
        fields = dict(re.findall(r"(Vm\w+):\s+(\d+)", f.read()))
    return int(fields["VmRSS"]), int(fields["VmHWM"])


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build(name: str) -> tuple[Any, Any]:
    """(model in eval mode, example inputs) with random weights: no network, same as a user's model."""
    import torch

    torch.manual_seed(0)
    if name == "bert_base":
        from transformers import BertConfig, BertModel

        config = BertConfig()  # BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072
        model = BertModel(config).eval()
        ids = torch.randint(0, config.vocab_size, (1, 128))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    import torchvision

    model = torchvision.models.get_model(name, weights=None).eval()
    return model, (torch.randn(1, 3, 224, 224),)


def _run_method(method: str, model: Any, example: Any, tracer: str) -> dict[str, Any]:
    import torch.fx as fx

    import fxprep

    if method == "symbolic_trace":
        fx.symbolic_trace(model)
        return {}
    if method == "aimet":
        from aimet_torch.model_preparer import prepare_model as aimet_prepare  # type: ignore[import-not-found]

        aimet_prepare(model)
        return {}
    verify = method == "fxprep_fx_verify"
    if tracer == "fx" and not verify:
        gm = fxprep.prepare_model(model, tracer="fx")
    else:  # Dynamo needs example inputs; with verify=False they only drive the capture
        gm = fxprep.prepare_model(model, tracer=tracer, example_inputs=example, verify=verify)
    report = fxprep.get_report(gm)
    return {"tracer": report.tracer, "verification": report.verification.status}


def worker(name: str, method: str, tracer: str) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns a JSON-able dict."""
    import gc

    import torch
    import torch.fx  # noqa: F401 - imports are not what is measured

    import fxprep  # noqa: F401

    torch.set_num_threads(1)
    if method == "aimet":
        try:
            import aimet_torch.model_preparer  # noqa: F401  # type: ignore[import-not-found]
        except ImportError as err:
            return {"ok": False, "error": f"not installed ({err.name})"}
    model, example = build(name)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    reset = _reset_peak()
    rss_before, _ = _memory_kib()
    start = time.perf_counter()
    try:
        extra = _run_method(method, model, example, tracer)
    except Exception as err:  # noqa: BLE001 - a failure is a result the table shows
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    seconds = time.perf_counter() - start
    _, hwm_after = _memory_kib()
    gc.collect()
    start = time.perf_counter()
    _run_method(method, model, example, tracer)  # steady state: caches and lazy imports are warm
    warm = time.perf_counter() - start
    return {
        "ok": True,
        "seconds": seconds,
        "warm_seconds": warm,
        "growth_bytes": (hwm_after - rss_before) * 1024 if reset else None,
        "param_bytes": param_bytes,
        **extra,
    }


# --- driver side -----------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    method: str
    tracer: str
    seconds: float | None = None
    warm_seconds: float | None = None
    growth_bytes: float | None = None
    param_bytes: int | None = None
    error: str | None = None
    runs: int = 0
    detail: str = ""


def measure(name: str, method: str, tracer: str, runs: int) -> Row:
    row = Row(name, method, tracer)
    times, warm, growths = [], [], []
    for _ in range(runs):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", name, method, tracer],
            capture_output=True, text=True, env=env, check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            row.error = f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            return row
        result = json.loads(lines[-1])
        if not result["ok"]:
            row.error = result["error"]
            return row
        times.append(result["seconds"])
        warm.append(result["warm_seconds"])
        if result["growth_bytes"] is not None:
            growths.append(result["growth_bytes"])
        row.param_bytes = result["param_bytes"]
        row.tracer = result.get("tracer", tracer)
        if result.get("verification"):
            row.detail = f"verification {result['verification']}"
        row.runs += 1
    row.seconds = statistics.median(times)
    row.warm_seconds = statistics.median(warm)
    row.growth_bytes = statistics.median(growths) if growths else None
    return row


def fxprep_tracer_for(name: str, runs: int) -> tuple[str, str]:
    """The tracer fxprep's rows use: "fx" when fxprep's fx path captures the model, else "auto"
    (Dynamo; transformers 5 models are not fx-traceable). Decided by one probe, said in the table."""
    probe = measure(name, "fxprep_fx", "fx", 1)
    if probe.error is None:
        return "fx", ""
    return "auto", f"fx path failed ({probe.error[:90]}); fxprep rows use tracer='auto' (Dynamo)"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def render(rows: list[Row], notes: list[str]) -> str:
    out = [
        "| model | method | tracer | first call s | x trace | second call s | x trace | peak RSS growth MiB "
        "| % of param bytes | targets |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r.model: r.seconds for r in rows if r.method == "symbolic_trace" and r.seconds}
    warm_base = {r.model: r.warm_seconds for r in rows if r.method == "symbolic_trace" and r.warm_seconds}
    for r in rows:
        if r.error:
            out.append(f"| {r.model} | {METHOD_LABELS[r.method]} | {r.tracer} | - | - | - | - | - | - | {r.error} |")
            continue
        assert r.seconds is not None and r.param_bytes
        ratio = r.seconds / base[r.model] if r.model in base else None
        warm_ratio = r.warm_seconds / warm_base[r.model] if r.model in warm_base and r.warm_seconds else None
        pct = None if r.growth_bytes is None else 100.0 * r.growth_bytes / r.param_bytes
        verdict = ""
        if r.method == "fxprep_fx":
            checks: list[str] = []
            for label, value in (("first call", ratio), ("second call", warm_ratio)):
                if value is not None:
                    checks.append(f"{label} {'OK' if value <= TIME_TARGET else 'MISS'}")
            if pct is not None:
                checks.append(f"RSS {'OK' if pct < RSS_TARGET else 'MISS'}")
            verdict = ", ".join(checks)
        elif r.detail:
            verdict = r.detail
        out.append(
            f"| {r.model} | {METHOD_LABELS[r.method]} | {r.tracer} | {r.seconds:.3f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {r.warm_seconds:.3f} | "
            f"{'-' if warm_ratio is None else f'{warm_ratio:.2f}'} | {_mib(r.growth_bytes)} | "
            f"{'-' if pct is None else f'{pct:.2f}'} | {verdict} |"
        )
    params = {r.model: r.param_bytes for r in rows if r.param_bytes}
    out.append("")
    out.append("Parameter bytes: " + ", ".join(f"{m} {_mib(b)} MiB" for m, b in params.items()))
    out.append(f"Targets (no-verification row): time <= {TIME_TARGET:g}x symbolic_trace, peak RSS growth "
               f"< {RSS_TARGET:g}% of parameter bytes (measured on the first call).")
    out += [f"Note: {n}" for n in notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "METHOD", "TRACER"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per (model, method); median reported")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0

    rows: list[Row] = []
    notes: list[str] = []
    for name in args.models:
        tracer, note = fxprep_tracer_for(name, args.runs)
        if note:
            notes.append(f"{name}: {note}")
        for method in args.methods:
            row = measure(name, method, tracer if method.startswith("fxprep") else "fx", args.runs)
            rows.append(row)
            print(f"# {name:10s} {method:18s} "
                  + (row.error or f"{row.seconds:.3f}s growth {_mib(row.growth_bytes)} MiB"), file=sys.stderr, flush=True)
    print(render(rows, notes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
