"""LLM-size models prepared on ``meta``: fxprep (block reuse on / off) against bare Dynamo and export.

    python benchmarks/scale_bench.py [--runs 3] [--models llama7b,llama70b,mixtral,qwen2moe]
    python benchmarks/scale_bench.py --forward-only          # the forward-overhead table alone

Capture: each model is a transformers config built on the ``meta`` device (no weights in memory),
called with ``input_ids`` of shape 1x16 (also on ``meta``). Four ways of capturing it, each in a
fresh one-thread process, and the runs interleaved (run 1 of every model and method, then run 2,
...), so a slow minute on a shared machine hits every method alike; the table shows the median of
``--runs`` and the ratios of those medians:

* ``fxprep``: ``prepare_model(model, example_inputs=..., tracer="dynamo", verify=False)``, block reuse
  on (the default): capture, re-lifting, functional → module, unrolling, state-dict parity, report;
  shape-general by default, so batch and sequence are dynamic (``fxprep.capture.shape_general``);
* ``fxprep_static``: the same with ``dynamic=False`` (static shapes, block reuse on);
* ``fxprep_noreuse``: static shapes with ``reuse_blocks=False`` (every layer traced by Dynamo); its run
  also clocks the time spent inside ``torch._dynamo.export``'s call, so fxprep's own work over bare
  Dynamo is also shown as a ratio inside each run (immune to the run-to-run spread of Dynamo);
* ``dynamo_export``: fxprep's own ``torch._dynamo.export`` call alone
  (``fxprep.capture.dynamo.export.dynamo_export``, same settings): the floor of any capture that
  starts with a whole-model Dynamo trace;
* ``export_nonstrict``: ``torch.export.export(model, (), kwargs, strict=False)``;
* ``export_nonstrict_dynamic``: the same with ``input_ids`` dimensions 0 and 1 ``Dim``s (batch, seq), on
  a 2x16 input (export specialises a size of 1), which is the input fxprep captures its dynamic
  graph on. The dynamic rows are compared with this one ("x non-strict" of the same kind).

Time is wall-clock around the one call; "RSS growth" is the peak resident set during the call
minus the resident set just before it (``VmHWM`` after a reset through ``/proc/self/clear_refs``).
Imports, building the model and one eager forward on ``meta`` happen before the clock starts.

Forward overhead (``--forward``, on by default): prepared / eager forward time, on real weights,
one thread, for resnet50 and mobilenet_v3_small (1x3x224x224) and a 4-layer Llama (hidden 256,
input 1x16): 3 rounds, each of N calls of the eager model and N of the prepared module alternating
call by call (N >= 20, enough for ~2 s of eager time: 20 calls of a 7 ms forward move by 10-20%
from round to round), the ratio of the median calls per round, the median of the 3 rounds. Time is
the thread's CPU time (``time.thread_time``), which a busy shared machine disturbs far less than
the wall clock; the wall-clock ratio is shown beside it. On a machine without a CUDA driver,
transformers' per-call probe ``torch.cuda.is_current_stream_capturing()`` (~100 us there, raising
and caught) is answered False for the Llama, as a GPU machine answers it at no cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from dynamo_bench import PeakRss  # the same peak-RSS measurement as the Dynamo benchmark

METHODS = ("fxprep", "fxprep_static", "fxprep_noreuse", "dynamo_export", "export_nonstrict", "export_nonstrict_dynamic")
DYNAMIC_METHODS = ("fxprep", "export_nonstrict_dynamic")  # batch and sequence dynamic
MODELS = ("llama7b", "llama70b", "mixtral", "qwen2moe")
FORWARD_MODELS = ("resnet50", "mobilenet_v3_small", "llama4")


# --------------------------------------------------------------------------------------------------
# child: one capture
# --------------------------------------------------------------------------------------------------
def config(name: str) -> Any:
    """The transformers config of a benchmark model (published shapes; vocabulary 32000)."""
    import transformers

    if name in ("llama7b", "llama70b"):
        big = name == "llama70b"
        return transformers.LlamaConfig(
            vocab_size=32000, hidden_size=8192 if big else 4096, intermediate_size=28672 if big else 11008,
            num_hidden_layers=80 if big else 32, num_attention_heads=64 if big else 32,
            num_key_value_heads=8 if big else 32, max_position_embeddings=4096)
    if name == "mixtral":  # Mixtral-8x7B
        return transformers.MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    if name == "qwen2moe":  # Qwen1.5-MoE-A2.7B
        return transformers.Qwen2MoeConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
            num_experts=60, num_experts_per_tok=4, max_position_embeddings=4096)
    raise SystemExit(f"unknown model {name}")


def build(name: str) -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers

    cfg = config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return model, {"input_ids": torch.zeros(1, 16, dtype=torch.long, device="meta")}


def capture(method: str, model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch

    if method in ("fxprep", "fxprep_static", "fxprep_noreuse"):
        import fxprep

        with dynamo_clock() as inside:
            gm = fxprep.prepare_model(model, example_inputs=kwargs, verify=False, tracer="dynamo",
                                      reuse_blocks=method != "fxprep_noreuse",
                                      **({} if method == "fxprep" else {"dynamic": False}))
        report = fxprep.get_report(gm)
        stamped = sum(len(v) for v in report.reuse.get("captured", {}).values())
        return {"modules": sum(1 for n in gm.graph.nodes if n.op == "call_module"), "stamped": stamped,
                "blocks_captured": len(report.reuse.get("captured", {})), "timings": report.timings,
                "inside_dynamo": inside[0]}
    kwargs = {**kwargs, "use_cache": False}  # what fxprep does itself for transformers models
    if method == "dynamo_export":
        from fxprep.capture.dynamo.export import default_route, dynamo_export
        from fxprep.core.inputs import ExampleInputs

        result = dynamo_export(model, ExampleInputs((), kwargs), default_route(), None)
        return {"nodes": len(result.graph_module.graph.nodes)}
    shapes = None
    if method == "export_nonstrict_dynamic":
        from torch.export import Dim

        kwargs = {**kwargs, "input_ids": torch.cat([kwargs["input_ids"]] * 2)}
        shapes = {"input_ids": {0: Dim("batch"), 1: Dim("seq")}, "use_cache": None}
    ep = torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=shapes)
    return {"nodes": len(ep.graph.nodes)}


@contextlib.contextmanager
def dynamo_clock() -> Any:
    """Seconds spent inside ``torch._dynamo.export``'s traced call during the block (a one-item list).

    fxprep's own work over bare Dynamo is then measured inside one run (total / time in Dynamo),
    beside the ratio of two medians from separate processes, which moves by 30% from run to run."""
    import torch._dynamo as dynamo

    spent = [0.0]
    real = dynamo.export

    def export(*args: Any, **kwargs: Any) -> Any:
        traced = real(*args, **kwargs)

        def call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return traced(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    dynamo.export = export
    try:
        yield spent
    finally:
        dynamo.export = real


def child(model_name: str, method: str) -> dict[str, Any]:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, kwargs = build(model_name)
    try:
        with torch.no_grad():
            model(**kwargs, use_cache=False)  # lazy initialisation is not the capture's cost
    except RuntimeError:
        pass  # MoE routing reads values (.item()), which meta tensors do not have
    if method.startswith(("fxprep", "dynamo")):
        import fxprep  # noqa: F401  # importing the package is not the capture's cost
    params = sum(p.numel() for p in model.parameters())
    with PeakRss() as rss:
        start = time.perf_counter()
        extra = capture(method, model, kwargs)
        seconds = time.perf_counter() - start
    return {"model": model_name, "method": method, "seconds": seconds, "rss_growth_mb": rss.growth_mb,
            "params_b": params / 1e9, "kernel_peak": rss.kernel, **extra}


def measure(model_name: str, method: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model_name, method]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:g}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return {"error": tail[0][:200]}


# --------------------------------------------------------------------------------------------------
# forward overhead
# --------------------------------------------------------------------------------------------------
def forward_overhead(name: str, rounds: int = 3, per_round: int = 20) -> dict[str, Any]:
    import torch

    import fxprep

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "llama4":
        import transformers
        from _timing import answer_cuda_capture_probe  # imports torch: lazily, as every torch import here

        answer_cuda_capture_probe()

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4)).eval()
        example: Any = {"input_ids": torch.randint(0, 1000, (1, 16))}
        gm = fxprep.prepare_model(model, example_inputs=example)

        def eager() -> Any:
            return model(**example, use_cache=False)

        def prepared() -> Any:
            return gm(**example)
    else:
        import torchvision

        model = torchvision.models.get_model(name, weights=None).eval()
        x = torch.randn(1, 3, 224, 224)
        gm = fxprep.prepare_model(model, example_inputs=x)

        def eager() -> Any:
            return model(x)

        def prepared() -> Any:
            return gm(x)

    def timed(fn: Any) -> tuple[float, float]:
        cpu, wall = time.thread_time(), time.perf_counter()
        fn()
        return time.thread_time() - cpu, time.perf_counter() - wall

    with torch.no_grad():
        for _ in range(5):
            eager()
            prepared()
        # enough calls that a round lasts ~2 s of eager time (20 at least): a 7 ms forward timed 20
        # times moves by 10-20% from round to round on a shared machine
        per_call = min(timed(eager)[0] for _ in range(3))
        calls = max(per_round, int(2.0 / max(per_call, 1e-4)))
        cpu_ratios, wall_ratios, cpu_eager = [], [], []
        for i in range(rounds):
            # alternate call by call (which goes first alternates too), so a slow second on a shared
            # machine hits both alike; the median call of each kind per round
            times: dict[str, list[tuple[float, float]]] = {"eager": [], "prepared": []}
            for k in range(calls):
                order = (("eager", eager), ("prepared", prepared)) if (i + k) % 2 == 0 else (("prepared", prepared), ("eager", eager))
                for kind, fn in order:
                    times[kind].append(timed(fn))
            e = [statistics.median(t[j] for t in times["eager"]) for j in (0, 1)]
            p = [statistics.median(t[j] for t in times["prepared"]) for j in (0, 1)]
            cpu_ratios.append(p[0] / e[0])
            wall_ratios.append(p[1] / e[1])
            cpu_eager.append(e[0])
    return {"model": name, "eager_ms": 1e3 * statistics.median(cpu_eager),
            "ratio_cpu": statistics.median(cpu_ratios), "ratio_wall": statistics.median(wall_ratios),
            "rounds_cpu": cpu_ratios}


# --------------------------------------------------------------------------------------------------
# load_weights memory
# --------------------------------------------------------------------------------------------------
def load_memory(directory: str, shard_mb: int = 200) -> dict[str, Any]:
    """Peak RSS growth of ``fxprep.load_weights`` on a sharded checkpoint of a ~0.5B Llama (fp32),
    against the size of the result and of the largest shard. Runs in a child process."""
    import glob
    import shutil

    import torch
    import transformers

    import fxprep

    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        shutil.rmtree(directory, ignore_errors=True)
        transformers.LlamaForCausalLM(cfg).save_pretrained(directory, max_shard_size=f"{shard_mb}MB")
        return {"written": directory}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.zeros(1, 16, dtype=torch.long)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids.to("meta")}, verify=False)
    shards = glob.glob(os.path.join(directory, "*.safetensors"))
    with PeakRss() as rss:
        start = time.perf_counter()
        fxprep.load_weights(gm, directory)
        seconds = time.perf_counter() - start
    result_mb = sum(t.numel() * t.element_size() for t in gm.state_dict().values()) / 2**20
    return {"seconds": seconds, "rss_growth_mb": rss.growth_mb, "result_mb": result_mb,
            "largest_shard_mb": max(os.path.getsize(f) for f in shards) / 2**20, "shards": len(shards)}


# --------------------------------------------------------------------------------------------------
# parent: the tables
# --------------------------------------------------------------------------------------------------
def _capture_table(models: list[str], methods: list[str], runs: int, timeout: float,
                   raw: list[dict[str, Any]]) -> None:
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(m, k): [] for m in models for k in methods}
    for i in range(runs):  # interleaved: every model and method once per run
        for model_name in models:
            for method in methods:
                result = measure(model_name, method, timeout)
                raw.append({"run": i, "model": model_name, "method": method, **result})
                print(f"  run {i + 1} {model_name:9s} {method:17s} "
                      + (f"{result['seconds']:.2f}s, +{result['rss_growth_mb']:.0f} MB" if "seconds" in result
                         else result["error"]), file=sys.stderr, flush=True)
                if "seconds" in result:
                    results[(model_name, method)].append(result)
    med: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rs in results.items():
        if rs:
            med[key] = {"seconds": statistics.median(r["seconds"] for r in rs),
                        "rss": statistics.median(r["rss_growth_mb"] for r in rs), "first": rs[0], "n": len(rs)}
    print("| model | params | method | time (s) | x non-strict (same shapes kind) | x bare Dynamo | peak RSS growth (MB) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for model_name in models:
        floor = med.get((model_name, "dynamo_export"), {}).get("seconds")
        for method in methods:
            base = med.get((model_name, "export_nonstrict_dynamic" if method in DYNAMIC_METHODS else "export_nonstrict"),
                           {}).get("seconds")
            row = med.get((model_name, method))
            if row is None:
                print(f"| {model_name} | | {method} | failed | | | |")
                continue
            params = f"{row['first']['params_b']:.1f}B"
            x_base = f"{row['seconds'] / base:.2f}x" if base else ""
            x_floor = f"{row['seconds'] / floor:.2f}x" if floor else ""
            n = "" if row["n"] == runs else f" ({row['n']} of {runs} runs)"
            print(f"| {model_name} | {params} | {method}{n} | {row['seconds']:.2f} | {x_base} | {x_floor} "
                  f"| {row['rss']:.0f} |")
    own = [(m, [r["seconds"] / r["inside_dynamo"] for r in results[(m, "fxprep_noreuse")] if r.get("inside_dynamo")])
           for m in models if (m, "fxprep_noreuse") in results]
    if any(v for _, v in own):
        print("\nfxprep's own work over bare Dynamo, inside each fxprep_noreuse run (prepare time / time in "
              "torch._dynamo.export's call): " + "; ".join(
                  f"{m} {statistics.median(v):.3f}x (runs {', '.join(f'{x:.3f}' for x in v)})" for m, v in own if v))
    if "llama7b" in models and "llama70b" in models:
        print("\nDepth (80-layer 70B-shaped / 32-layer 7B-shaped, same method):", ", ".join(
            f"{m} {med[('llama70b', m)]['seconds'] / med[('llama7b', m)]['seconds']:.2f}x"
            for m in methods if ("llama70b", m) in med and ("llama7b", m) in med))
    reused = [f"{m}: {med[(m, 'fxprep')]['first']['blocks_captured']} block(s) captured, "
              f"{med[(m, 'fxprep')]['first']['stamped']} stamped" for m in models if (m, "fxprep") in med]
    if reused:
        print("Block reuse:", "; ".join(reused))


def _forward_table(models: list[str], raw: list[dict[str, Any]]) -> None:
    print("\n| model | eager forward (ms, CPU time) | prepared / eager (CPU time) | per round | wall clock |")
    print("|---|---:|---:|---|---:|")
    for name in models:
        r = forward_overhead(name)
        raw.append({"forward": True, **r})
        rounds = ", ".join(f"{x:.3f}" for x in r["rounds_cpu"])
        print(f"| {name} | {r['eager_ms']:.2f} | {r['ratio_cpu']:.3f}x | {rounds} | {r['ratio_wall']:.3f}x |")


def _load_table(directory: str, raw: list[dict[str, Any]]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    results = []
    for _ in range(2):  # the first run writes the checkpoint; then a fresh process loads it
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--load-child", directory],
                              capture_output=True, text=True, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
    r = results[-1]
    raw.append({"load": True, **r})
    if "error" in r:
        print(f"\nload_weights: {r['error']}")
        return
    print(f"\nload_weights of a sharded fp32 checkpoint ({r['shards']} shards, largest {r['largest_shard_mb']:.0f} MB) "
          f"into a graph prepared on meta: {r['seconds']:.1f} s, peak RSS growth {r['rss_growth_mb']:.0f} MB for a "
          f"{r['result_mb']:.0f} MB result (+{r['rss_growth_mb'] - r['result_mb']:.0f} MB over the result).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--forward-models", default=",".join(FORWARD_MODELS))
    parser.add_argument("--no-forward", action="store_true", help="skip the forward-overhead table")
    parser.add_argument("--forward-only", action="store_true", help="only the forward-overhead table")
    parser.add_argument("--load-memory", metavar="DIR", help="also measure load_weights' peak RSS (checkpoint "
                        "written to DIR first, ~2 GB)")
    parser.add_argument("--load-child", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="also write every raw measurement to this file")
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(child(*ns.child), default=str))
        return 0
    if ns.load_child:
        print(json.dumps(load_memory(ns.load_child), default=str))
        return 0
    import platform

    import torch

    raw: list[dict[str, Any]] = []
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} cores visible, load average {os.getloadavg()[0]:.1f} at start\n")
    if not ns.forward_only:
        print(f"Capture on meta, input 1x16, median of {ns.runs} interleaved runs, each in a fresh 1-thread process:\n")
        _capture_table([m for m in ns.models.split(",") if m], [m for m in ns.methods.split(",") if m],
                       ns.runs, ns.timeout, raw)
    if not ns.no_forward:
        _forward_table([m for m in ns.forward_models.split(",") if m], raw)
    if ns.load_memory:
        _load_table(ns.load_memory, raw)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(raw, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
