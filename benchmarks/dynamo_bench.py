"""Dynamo-path ``prepare_model`` against raw ``torch.export`` (non-strict and strict): time and RAM.

    python benchmarks/dynamo_bench.py [--runs 3] [--models resnet50,vit_b_16,llama8]

Each measurement runs in a fresh subprocess (one thread) so peak-RSS numbers are not polluted by an
earlier run: the child builds the model and its inputs, runs one eager forward, resets the peak-RSS
counter (``/proc/self/clear_refs``; a 2 ms sampler where that is not allowed), then times the one
call being measured. "RSS growth" is the peak resident set during that call minus the resident set
just before it. The table shows the median of ``--runs`` runs and each method's ratio to
non-strict export's.

fxprep is measured end to end with ``verify=False`` and ``tracer="dynamo"`` (capture, re-lifting,
functional → module, unrolling, state-dict parity); the export columns are the bare
``torch.export.export`` call. ``dynamo_export`` is the ``torch._dynamo.export`` call fxprep's
capture makes (``fxprep.capture.dynamo.export.dynamo_export``: same settings, same route) and nothing else: the
floor for any capture that starts with Dynamo, so what fxprep adds on top of Dynamo can be told
from what Dynamo costs against non-strict export. Each configuration runs twice: *cold* (the first
capture in the process, paying imports and one-time set-up) and *warm* (after capturing a tiny MLP
the same way), so the per-model cost can be told from the fixed one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

METHODS = ("fxprep", "dynamo_export", "export_nonstrict", "export_strict")
MODELS = ("resnet50", "vit_b_16", "llama8")


# --------------------------------------------------------------------------------------------------
# child: one measurement
# --------------------------------------------------------------------------------------------------
def _rss_kb(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak RSS during a block: the kernel's high-water mark after a reset, else a sampler."""

    def __enter__(self) -> PeakRss:
        self.before = _rss_kb()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.kernel = True
        except OSError:
            self.kernel = False
        self.peak = self.before
        self._stop = threading.Event()
        if not self.kernel:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_kb())
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.kernel:
            self.peak = max(self.peak, _rss_kb("VmHWM"))
        else:
            self._thread.join()
            self.peak = max(self.peak, _rss_kb())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / 1024


def build(name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch

    torch.manual_seed(0)
    if name in ("resnet50", "vit_b_16"):
        import torchvision

        model = torchvision.models.get_model(name, weights=None).eval()
        return model, (torch.randn(1, 3, 224, 224),), {}
    if name == "llama8":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
        )
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
        return model, (), {"input_ids": ids, "attention_mask": torch.ones(1, 16, dtype=torch.long)}
    raise SystemExit(f"unknown model {name}")


def _tiny() -> tuple[Any, tuple[Any, ...]]:
    """A two-layer MLP: capturing it first pays the one-time costs (imports, Dynamo/export set-up)."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), (torch.randn(2, 8),)


def _capture(method: str, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch

    if method == "fxprep":
        import fxprep

        gm = fxprep.prepare_model(model, example_inputs=kwargs if kwargs else args, verify=False, tracer="dynamo")
        return {"route": gm.meta.get("fxprep_dynamo_route"), "modules": sum(1 for n in gm.graph.nodes if n.op == "call_module")}
    if method == "dynamo_export":
        from fxprep.capture.dynamo.export import default_route, dynamo_export
        from fxprep.core.inputs import ExampleInputs

        result = dynamo_export(model, ExampleInputs(args, kwargs), default_route(), None)
        return {"nodes": len(result.graph_module.graph.nodes)}
    ep = torch.export.export(model, args, kwargs, strict=method == "export_strict")
    return {"nodes": len(ep.graph.nodes)}


def child(model_name: str, method: str, warm: bool = False) -> dict[str, Any]:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, args, kwargs = build(model_name)
    with torch.no_grad():
        model(*args, **kwargs)  # warm-up: lazy inits and allocator pools are not the capture's cost
    params = sum(p.numel() for p in model.parameters())
    if method in ("fxprep", "dynamo_export"):
        import fxprep  # noqa: F401  # importing the package (rich, safetensors, ...) is not the capture's cost
    if warm:
        _capture(method, *_tiny(), {})
    if method != "fxprep" and "use_cache" in inspect.signature(model.forward).parameters:
        kwargs = {**kwargs, "use_cache": False}  # fxprep does this itself for transformers models
    with PeakRss() as rss:
        start = time.perf_counter()
        extra = _capture(method, model, args, kwargs)
        seconds = time.perf_counter() - start
    param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"model": model_name, "method": method, "warm": warm, "seconds": seconds, "rss_growth_mb": rss.growth_mb,
            "params_m": params / 1e6, "param_mb": param_mb, "kernel_peak": rss.kernel, **extra}


# --------------------------------------------------------------------------------------------------
# parent: the table
# --------------------------------------------------------------------------------------------------
def measure(model_name: str, method: str, timeout: float, warm: bool) -> dict[str, Any] | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model_name, method] + (["--warm"] if warm else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:g}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return {"error": tail[0][:200]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="also write every raw measurement to this file")
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(child(*ns.child, warm=ns.warm)))
        return 0

    import platform

    import torch

    models = [m for m in ns.models.split(",") if m]
    methods = [m for m in ns.methods.split(",") if m]
    raw: list[dict[str, Any]] = []
    rows: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for model_name in models:
        for method in methods:
            for warm in (False, True):
                runs = []
                for i in range(ns.runs):
                    result = measure(model_name, method, ns.timeout, warm) or {"error": "no result"}
                    raw.append({"run": i, "model": model_name, "method": method, "warm": warm, **result})
                    print(f"  {model_name:9s} {method:17s} {'warm' if warm else 'cold'} run {i + 1}: "
                          + (f"{result['seconds']:.2f}s, +{result['rss_growth_mb']:.0f} MB" if "seconds" in result
                             else result["error"]),
                          file=sys.stderr, flush=True)
                    if "seconds" in result:
                        runs.append(result)
                rows[(model_name, method, warm)] = {
                    "seconds": statistics.median(r["seconds"] for r in runs),
                    "rss": statistics.median(r["rss_growth_mb"] for r in runs),
                    "params": runs[0]["params_m"], "param_mb": runs[0]["param_mb"],
                } if runs else {"error": raw[-1].get("error", "failed")}
    print(f"\nDynamo-path prepare_model vs torch.export (median of {ns.runs} runs, each in a fresh process, 1 thread)")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores visible")
    print("cold: the first capture in the process (pays imports and one-time set-up); warm: after capturing a tiny MLP")
    print("with the same method. 'x non-strict': time / torch.export(strict=False) time in the same mode.\n")
    print("| model | params | method | cold (s) | x non-strict | warm (s) | x non-strict | RSS growth cold (MB) "
          "| warm (MB) | warm, % of param bytes |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for model_name in models:
        for method in methods:
            cells = []
            for warm in (False, True):
                row = rows[(model_name, method, warm)]
                base = rows.get((model_name, "export_nonstrict", warm), {})
                if "error" in row:
                    cells.append(("failed", "", "", ""))
                    continue
                ratio = f"{row['seconds'] / base['seconds']:.2f}x" if base.get("seconds") else ""
                cells.append((f"{row['seconds']:.2f}", ratio, f"{row['rss']:.0f}",
                              f"{100 * row['rss'] / row['param_mb']:.1f}%"))
            first = rows[(model_name, method, False)]
            params = f"{first['params']:.1f}M" if "params" in first else ""
            (c_t, c_r, c_m, _), (w_t, w_r, w_m, w_p) = cells
            print(f"| {model_name} | {params} | {method} | {c_t} | {c_r} | {w_t} | {w_r} | {c_m} | {w_m} | {w_p} |")
    if "fxprep" in methods and "dynamo_export" in methods:
        print("\nWhat fxprep adds to the bare Dynamo capture (fxprep / dynamo_export; RSS: fxprep minus dynamo_export):\n")
        print("| model | cold time | warm time | warm RSS growth (MB) |")
        print("|---|---:|---:|---:|")
        for model_name in models:
            ours = [rows[(model_name, "fxprep", w)] for w in (False, True)]
            floor = [rows[(model_name, "dynamo_export", w)] for w in (False, True)]
            if any("error" in r for r in ours + floor):
                continue
            cold, warm = (o["seconds"] / f["seconds"] for o, f in zip(ours, floor))
            print(f"| {model_name} | {cold:.2f}x | {warm:.2f}x | {ours[1]['rss'] - floor[1]['rss']:+.1f} |")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(raw, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
