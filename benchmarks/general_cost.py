"""What shape-general capture by default costs, model by model (issue 60): default ``prepare_model``
against the same call with ``dynamic=False``, in one process, alternating, best of ``--runs``.

    PYTHONPATH=src python benchmarks/general_cost.py llama falcon_h1 vlm:qwen2_vl   # some models
    PYTHONPATH=src python benchmarks/general_cost.py --zoo --json zoo.jsonl          # every causal-LM type
    PYTHONPATH=src python benchmarks/general_cost.py --vlms                          # the tests' VLMs
    PYTHONPATH=src python benchmarks/general_cost.py --profile dots3_note            # where the time goes

A name is a transformers model type (``AutoModelForCausalLM`` from the first of
:func:`fxprep.cli.tiny.tiny_configs` that builds: 2 layers, width 32; ``input_ids`` 1x8, as ``fxprep
prepare transformers:TYPE`` gives), or ``vlm:NAME`` (a builder of ``tests/vlm_models.py`` or
``tests/vlm_models_more.py``, with its multimodal example). ``--zoo``: every type of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``--vlms``: every VLM builder.

Each model runs in a child of a fork server that imported torch, transformers and fxprep once (a
crash, an out-of-memory kill or a hang costs one row; ``--timeout`` seconds at most). In the child:
one thread, the model built and run once eagerly, then default and static prepares in turn
(default first on even rounds, static first on odd ones), best of ``--runs`` each; a shared machine's
drift then falls on both alike. Each prepare's Dynamo traces and verification runs are counted
(``benchmarks/_spans.py``). ``kept``: yes where the default report declares the found dimensions
(``batch``: only the batch, after the batch probe), no where it says they were tried and not kept,
``-`` where nothing was proposed. ``--json`` appends one JSON line per model (a long run can be
read while it goes, and re-run with ``--skip-done``). The markdown table and the worst ratio go
to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
MAX_PARAMETERS = 50_000_000  # a "tiny" config past this kept a real size somewhere: not built
PRELOAD = ["torch", "transformers", "fxprep", "fxprep.api", "_spans"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def causal_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def vlm_names() -> list[str]:
    from tests import vlm_models, vlm_models_more

    return [f"vlm:{n}" for n in (*vlm_models.BUILDERS, *vlm_models_more.BUILDERS)]


def build(name: str) -> tuple[Any, dict[str, Any]]:
    """The model (eval, random weights, seeded) and its example inputs."""
    import torch

    if name.startswith("vlm:"):
        from tests import vlm_models, vlm_models_more

        make = vlm_models.BUILDERS.get(name[4:]) or vlm_models_more.BUILDERS[name[4:]]
        torch.manual_seed(0)
        return make()
    from transformers import AutoModelForCausalLM

    from fxprep.cli.tiny import tiny_configs
    from fxprep.families.transformers.model import example_inputs_for

    failure: Exception | None = None
    model = None
    for config, _ in tiny_configs(name):
        try:
            with torch.device("meta"):  # a config not tiny at every level may be the real size: not built
                count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            if count > MAX_PARAMETERS:
                raise RuntimeError(f"{count:,} parameters")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            break
        except Exception as err:  # noqa: BLE001 - the next, larger config
            failure = err
    if model is None:
        model = _from_text_config(name)
    if model is None:
        raise RuntimeError(f"does not build tiny: {failure}")
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    inputs = example_inputs_for(model, batch=1, seq_len=8, device="cpu") or {}
    inputs.pop("attention_mask", None)  # as `fxprep prepare transformers:TYPE` gives them
    return model, inputs


def _from_text_config(name: str) -> Any:
    """A causal LM whose class takes its composite config's text part (Dots3NoteForCausalLM), built
    from that part shrunk (:func:`fxprep.cli.tiny` shrinks the composite, which transformers may
    refuse: Dots3 Note's sliding layers' head sizes); the per-layer lists dropped where refused."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fxprep.cli import tiny

    defaults = transformers.AutoConfig.for_model(name)
    text = getattr(defaults, "text_config", None)
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(name, ""), None)
    if text is None or cls is None:
        return None
    values = tiny._shrunk(text, False)
    for drop in ((), ("per_layer_config", "layer_types")):
        try:
            config = type(text)(**{k: v for k, v in values.items() if k not in drop})
            torch.manual_seed(0)
            return cls(config).eval()
        except Exception:  # noqa: BLE001 - the next way, else none
            continue
    return None


def kept(report: Any) -> str:
    notes = report.notes
    if any(n.startswith("Shape-general: the dimensions") for n in notes):
        return "yes"
    if any("baked the example's batch into the graph" in n for n in notes):
        return "batch"
    if any("tried and not kept" in n for n in notes):
        return "no"
    return "-"


def one_prepare(model: Any, inputs: Any, static: bool) -> dict[str, Any]:
    from _spans import spans

    import fxprep

    options = {"dynamic": False} if static else {}
    with spans() as rec:
        start = time.perf_counter()
        gm = fxprep.prepare_model(model, example_inputs=inputs, **options)
        seconds = time.perf_counter() - start
    totals = rec.totals()
    report = fxprep.get_report(gm)
    return {"seconds": seconds, "traces": totals.get("dynamo trace", (0, 0.0))[0],
            "trace_s": totals.get("dynamo trace", (0, 0.0))[1], "verifies": totals.get("verify", (0, 0.0))[0],
            "tracer": report.tracer, "kept": kept(report), "verification": report.verification.status}


def measure(name: str, runs: int) -> dict[str, Any]:
    """Default and static prepares of ``name``, alternating, best of ``runs``."""
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, inputs = build(name)
    with torch.no_grad():
        model(**inputs)
    row: dict[str, Any] = {"name": name, "build": time.perf_counter() - t0}
    best: dict[str, dict[str, Any]] = {}
    for k in range(runs):
        for static in ((False, True) if k % 2 == 0 else (True, False)):
            key = "static" if static else "default"
            try:
                got = one_prepare(model, inputs, static)
            except Exception as err:  # noqa: BLE001 - a row that says so
                row[f"{key}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                continue
            if key not in best or got["seconds"] < best[key]["seconds"]:
                best[key] = got
    for key, got in best.items():
        row.update({f"{key}_{k}": v for k, v in got.items()})
    return row


def profile(name: str) -> str:
    """One default prepare of ``name`` after a static one (warm), with its span tree."""
    import torch
    from _spans import spans

    import fxprep

    torch.set_num_threads(1)
    model, inputs = build(name)
    with torch.no_grad():
        model(**inputs)
    fxprep.prepare_model(model, example_inputs=inputs, dynamic=False)  # first-use costs paid
    handler = logging.StreamHandler(sys.stderr)  # the default prepare's steps: which guard sent it back
    handler.setFormatter(logging.Formatter("  [%(relativeCreated)7.0f ms] %(message)s"))
    progress_log = logging.getLogger("fxprep")
    progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    with spans() as rec:
        start = time.perf_counter()
        gm = fxprep.prepare_model(model, example_inputs=inputs)
        seconds = time.perf_counter() - start
    report = fxprep.get_report(gm)
    lines = [f"{name}: default prepare {seconds:.2f} s, tracer {report.tracer}, kept {kept(report)}",
             rec.tree(), "totals (outermost calls):"]
    lines += [f"  {label:<40} {n:4d} calls {s:8.2f} s" for label, (n, s) in
              sorted(rec.totals().items(), key=lambda kv: -kv[1][1])]
    lines += [f"  note: {n[:300]}" for n in report.notes if "Shape-general" in n or "not kept" in n]
    return "\n".join(lines)


def _child(name: str, runs: int, prof: bool, conn: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(ENV)
    try:
        out: Any = profile(name) if prof else measure(name, runs)
    except BaseException as err:  # noqa: BLE001 - the row comes back whatever happens
        out = {"name": name, "error": f"{type(err).__name__}: {str(err)[:200]}",
               "trace": traceback.format_exc()[-800:]} if not prof else traceback.format_exc()
    conn.send(out)
    conn.close()


def run_child(ctx: Any, name: str, runs: int, timeout: float, prof: bool = False) -> Any:
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, runs, prof, child))
    proc.start()
    child.close()
    start = time.perf_counter()
    out: Any = None
    if parent.poll(timeout):
        try:
            out = parent.recv()
        except EOFError:
            out = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"name": name, "error": f"timeout after {timeout:.0f} s"}
    if out is None:
        return {"name": name, "error": f"crashed (exit code {proc.exitcode}) after {time.perf_counter() - start:.0f} s"}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | default (s) | static (s) | ratio | kept | tracer | traces default/static | "
             "verify runs default/static |", "|---|---:|---:|---:|---|---|---|---|"]
    worst: tuple[float, str] | None = None
    for r in rows:
        if "default_seconds" not in r or "static_seconds" not in r:
            why = r.get("error") or r.get("default_error") or r.get("static_error") or "?"
            lines.append(f"| {r['name']} | | | | | | | {why[:90]} |")
            continue
        ratio = r["default_seconds"] / r["static_seconds"]
        worst = max(worst or (ratio, r["name"]), (ratio, r["name"]))
        lines.append(f"| {r['name']} | {r['default_seconds']:.2f} | {r['static_seconds']:.2f} | {ratio:.2f}x | "
                     f"{r['default_kept']} | {r['default_tracer']} | {r['default_traces']}/{r['static_traces']} | "
                     f"{r['default_verifies']}/{r['static_verifies']} |")
    if worst is not None:
        ratios = sorted(r["default_seconds"] / r["static_seconds"] for r in rows
                        if "default_seconds" in r and "static_seconds" in r)
        total_d = sum(r["default_seconds"] for r in rows if "default_seconds" in r and "static_seconds" in r)
        total_s = sum(r["static_seconds"] for r in rows if "default_seconds" in r and "static_seconds" in r)
        lines.append(f"\nworst ratio: {worst[0]:.2f}x ({worst[1]}); median {ratios[len(ratios) // 2]:.2f}x; "
                     f"sum default {total_d:.1f} s / static {total_s:.1f} s = {total_d / total_s:.2f}x "
                     f"over {len(ratios)} models; over 1.5x: {sum(x > 1.5 for x in ratios)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--zoo", action="store_true", help="every causal-LM type of transformers")
    parser.add_argument("--vlms", action="store_true", help="every VLM builder of the tests")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="append one JSON line per model to this file")
    parser.add_argument("--skip-done", action="store_true", help="skip the models already in --json")
    parser.add_argument("--profile", action="store_true", help="the span tree of one default prepare per model")
    ns = parser.parse_args(argv)
    names = list(ns.names) + (causal_types() if ns.zoo else []) + (vlm_names() if ns.vlms else [])
    done: dict[str, dict[str, Any]] = {}
    if ns.json and ns.skip_done and os.path.exists(ns.json):
        with open(ns.json) as f:
            done = {r["name"]: r for r in map(json.loads, f) if "name" in r}
    os.environ.update(ENV)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    import torch

    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the start", file=sys.stderr)
    rows = [done[n] for n in names if n in done]
    for name in [n for n in names if n not in done]:
        start = time.perf_counter()
        out = run_child(ctx, name, ns.runs, ns.timeout, ns.profile)
        if ns.profile:
            print(out if isinstance(out, str) else json.dumps(out), flush=True)
            continue
        out["load"] = os.getloadavg()[0]
        rows.append(out)
        if ns.json:
            with open(ns.json, "a") as f:
                f.write(json.dumps(out) + "\n")
        ratio = (f"{out['default_seconds'] / out['static_seconds']:.2f}x"
                 if "default_seconds" in out and "static_seconds" in out else out.get("error", "?"))
        print(f"{name}: {ratio} ({time.perf_counter() - start:.0f} s, load {out['load']:.1f})", file=sys.stderr, flush=True)
    if not ns.profile:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
