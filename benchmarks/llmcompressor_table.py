"""The llm-compressor table (docs/handoff/llm-compressor-table.md): for every transformers causal-LM
type that builds tiny, the MoE types and the VLMs, whether llm-compressor's own tracer and fxprep's
stages make subgraphs, whether those reproduce the model (every sequential target's inputs and
outputs against eager, :func:`fxprep.compat.llmcompressor.reproduce.compare_subgraphs`), whether GPTQ
``oneshot`` runs through ``pipeline="fxprep"``, and whether its model is bit-identical to
``pipeline="sequential"``'s.

Run in llm-compressor's environment (``make test-llmcompressor`` builds it)::

    .venv-llmcompressor/bin/python benchmarks/llmcompressor_table.py            # all, ~40 min on 2 cores
    .venv-llmcompressor/bin/python benchmarks/llmcompressor_table.py llama mistral vlm:qwen2_vl

Each model runs in a child of a fork server that has imported torch, transformers and llm-compressor
once (a crash or a hang costs one row, ``--timeout`` seconds at most). GPTQ quantizes weights to
int8 with a scale per output channel (the tiny models are 32 wide, too narrow for the presets' groups
of 128), ``lm_head`` and vision towers ignored, on six calibration samples.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "granitemoe"]
VLMS = ["vlm:qwen2_vl", "vlm:qwen2_5_vl", "vlm:llava_pixtral", "vlm:idefics3", "vlm:mllama", "vlm:gemma3"]
# int8 weights, one scale per output channel (W8A16's preset groups by 128, wider than the tiny models)
W8_CHANNEL = {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}
PRELOAD = ["torch", "transformers", "llmcompressor", "fxprep.compat.llmcompressor", "tests.llmcompressor.lc_models"]


def causal_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _build(name: str) -> tuple[Any, dict[str, Any], str]:
    """The model (saved with a tokenizer and loaded back, as oneshot wants it), a calibration batch
    and the checkpoint folder."""
    import tempfile

    import torch
    from tests.llmcompressor.lc_models import tokenizer
    from transformers import AutoModelForCausalLM

    from fxprep.cli.tiny import tiny_configs

    if name.startswith("vlm:"):
        from tests import vlm_models, vlm_models_more

        make = getattr(vlm_models, name[4:], None) or getattr(vlm_models_more, name[4:])
        torch.manual_seed(0)
        model, batch = make()
    else:
        failure: Exception | None = None
        model = None
        for config, _ in tiny_configs(name):
            try:
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config)
                break
            except Exception as err:  # noqa: BLE001 - the next, larger config
                failure = err
        if model is None:
            raise RuntimeError(f"does not build tiny: {failure}")
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, min(vocab, 99), (1, 12), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    folder = tempfile.mkdtemp(prefix="fxprep-table-")
    model.save_pretrained(folder)
    tokenizer(model.config.get_text_config().vocab_size).save_pretrained(folder)
    return type(model).from_pretrained(folder).eval(), batch, folder


def _reproduces(model: Any, make_subgraphs: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Subgraphs made (time) and compared with eager at the targets llm-compressor infers."""
    from compressed_tensors.utils.match import match_named_modules
    from llmcompressor.args import DatasetArguments
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    from fxprep.compat.llmcompressor.reproduce import compare_subgraphs
    from fxprep.compat.llmcompressor.subgraphs import ALL, calibration_context, repeated_blocks

    targets = infer_sequential_targets(model, None)
    named = repeated_blocks(model) if targets in (ALL, [ALL]) else list(match_named_modules(model, targets))
    start = time.perf_counter()
    try:
        subgraphs = make_subgraphs(model, batch, targets, DatasetArguments().tracing_ignore, 1)
    except Exception as err:  # noqa: BLE001 - a table row
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    seconds = time.perf_counter() - start
    try:
        with calibration_context(model):
            found = compare_subgraphs(model, subgraphs, batch, named)
    except Exception as err:  # noqa: BLE001 - a table row
        return {"ok": True, "seconds": seconds, "subgraphs": len(subgraphs), "reproduces": False,
                "error": f"running them: {type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    return {"ok": True, "seconds": seconds, "subgraphs": len(subgraphs), "reproduces": found.equal,
            "targets": found.calls, "first": found.first, "notes": found.notes[:1],
            "output_diff": found.output_max_abs_diff}


def _gptq(folder: str, name: str, batch: dict[str, Any], pipeline: str) -> dict[str, Any]:
    """GPTQ W8A16 through ``pipeline``; the quantized state and the logits on ``batch``."""
    import torch
    from llmcompressor.modifiers.quantization import GPTQModifier
    from tests.llmcompressor.lc_models import batches_loader, oneshot_state, token_data, tokenizer

    model = _load(folder)
    vocab = model.config.get_text_config().vocab_size
    data = (batches_loader([batch, batch]) if name.startswith("vlm:")
            else token_data(samples=6, length=12, vocab=min(vocab, 99)))
    recipe = GPTQModifier(config_groups=W8_CHANNEL, ignore=["lm_head", "re:.*visual.*", "re:.*vision.*"])
    # in order: shuffling draws from torch's global generator, which the runs before left elsewhere, and
    # GPTQ's sums of another order can round one weight otherwise
    # the tokenizer as processor: a multimodal type's folder has no image processor, and oneshot asks for one
    state = oneshot_state(model, recipe, data, pipeline, shuffle_calibration_samples=False, processor=tokenizer(vocab))
    with torch.no_grad():
        out = model(**batch)
    return {"state": state, "logits": getattr(out, "logits", None)}


def _load(folder: str) -> Any:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    for arch in config.architectures or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls.from_pretrained(folder).eval()
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def row(name: str) -> dict[str, Any]:
    """One row of the table (see the module docstring)."""
    from llmcompressor.pipelines.sequential.helpers import trace_subgraphs
    from tests.llmcompressor.lc_models import states_equal

    import fxprep.compat.llmcompressor as fxlc

    out: dict[str, Any] = {"model": name}
    try:
        model, batch, folder = _build(name)
        with __import__("torch").no_grad():
            model(**batch)
    except Exception as err:  # noqa: BLE001 - a table row
        out["build"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else type(err).__name__
        return out
    out["llmcompressor"] = _reproduces(model, trace_subgraphs, batch)
    out["fxprep"] = _reproduces(model, fxlc.fxprep_subgraphs, batch)
    if not out["fxprep"].get("ok"):
        return out
    try:
        ours = _gptq(folder, name, batch, "fxprep")
        out["gptq"] = {"ok": True}
    except Exception as err:  # noqa: BLE001 - a table row
        lines = str(err).splitlines() or [""]
        said = lines[1].strip() if len(lines) > 1 and lines[1].startswith("  - ") else lines[0]  # a mismatch's detail
        out["gptq"] = {"ok": False, "error": f"{type(err).__name__}: {said[:160]}"}
        return out
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    from fxprep.compat.llmcompressor.subgraphs import ALL

    if infer_sequential_targets(model, None) in (ALL, [ALL]):
        out["gptq"]["cut"] = "llm-compressor runs the model as one subgraph (no _no_split_modules)"
    elif out["llmcompressor"].get("ok"):
        try:
            theirs = _gptq(folder, name, batch, "sequential")
        except Exception as err:  # noqa: BLE001 - a table row
            out["gptq"]["sequential"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            return out
        differ = states_equal(ours["state"], theirs["state"])
        logits = None
        if ours["logits"] is not None and theirs["logits"] is not None and not ours["logits"].is_meta:
            logits = float((ours["logits"].double() - theirs["logits"].double()).abs().max())
        out["gptq"].update(identical=not differ, differ=len(differ), tensors=len(ours["state"]), logits_diff=logits)
    return out


def _child(name: str, queue: Any) -> None:
    try:
        queue.put(row(name))
    except BaseException as err:  # noqa: BLE001 - reported as the row
        queue.put({"model": name, "crash": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-400:]})


def run(names: list[str], timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    rows = []
    for name in names:
        queue = ctx.Queue()
        start = time.perf_counter()
        proc = ctx.Process(target=_child, args=(name, queue))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            result = {"model": name, "crash": f"timed out after {timeout:.0f}s"}
        else:
            result = queue.get() if not queue.empty() else {"model": name, "crash": f"exit code {proc.exitcode}"}
        result["wall"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result), flush=True)
        rows.append(result)
    return rows


def _cell(part: dict[str, Any] | None) -> tuple[str, str]:
    """(made subgraphs, reproduces the model) cells."""
    if not part:
        return "-", "-"
    if not part.get("ok"):
        return f"no: {part.get('error', '')}", "-"
    made = f"yes ({part['seconds']:.2f}s)"
    if part.get("reproduces"):
        note = f" ({part['notes'][0].split(': ', 1)[1]})" if part.get("notes") else ""
        return made, f"yes{note}"
    if part.get("first"):
        return made, f"no: output off by {part.get('output_diff', float('nan')):.3g}; {part['first']}"
    return made, f"no: {part.get('error', '')}"


def _whose(row: dict[str, Any]) -> str:
    if "build" in row:
        return "transformers: the tiny config does not build or run"
    if "crash" in row:
        return f"crash: {row['crash'][:100]}"
    fx, lc, gptq = row.get("fxprep", {}), row.get("llmcompressor", {}), row.get("gptq", {})
    if not fx.get("ok"):
        return "fxprep's capture"
    notes = []
    if not lc.get("ok") or not lc.get("reproduces"):
        notes.append("llm-compressor's tracer")
    if not fx.get("reproduces"):
        notes.append("fxprep's stages")
    if gptq and not gptq.get("ok"):
        notes.append("GPTQ through pipeline=fxprep")
    return ", ".join(notes)


def markdown(rows: list[dict[str, Any]], environment: dict[str, str], seconds: float) -> str:
    head = ["model", "llm-compressor's tracer", "its subgraphs reproduce", "fxprep's stages", "they reproduce",
            "GPTQ via pipeline=\"fxprep\"", "bit-identical to pipeline=\"sequential\"", "whose limit"]
    lines = [
        "# llm-compressor: its tracer and fxprep's stages, model by model",
        "",
        f"Made by `.venv-llmcompressor/bin/python benchmarks/llmcompressor_table.py` on {environment['machine']} "
        f"({environment['versions']}), {seconds / 60:.0f} min. See [the hand-off page](llm-compressor.md) for what "
        "each column checks.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    counts = {"rows": 0, "lc_ok": 0, "lc_rep": 0, "fx_ok": 0, "fx_rep": 0, "gptq": 0, "identical": 0, "both": 0}
    for r in rows:
        lc_made, lc_rep = _cell(r.get("llmcompressor"))
        fx_made, fx_rep = _cell(r.get("fxprep"))
        gptq = r.get("gptq") or {}
        g = "-" if not gptq else ("yes" if gptq.get("ok") else f"no: {gptq.get('error', '')}")
        both = r.get("llmcompressor", {}).get("reproduces") and r.get("fxprep", {}).get("reproduces")
        if "cut" in gptq:
            same = f"n/a: {gptq['cut']}"
        elif "identical" in gptq:
            same = "yes" if gptq["identical"] else (f"no: {gptq['differ']} of {gptq['tensors']} tensors, logits "
                                                   f"{gptq['logits_diff']:.3g} apart" if gptq.get("logits_diff") is not None
                                                   else f"no: {gptq['differ']} of {gptq['tensors']} tensors")
        else:
            same = "-"
        build = r.get("build") or r.get("crash")
        if build:
            lines.append(f"| {r['model']} | {build[:120]} | | | | | | {_whose(r)} |")
            continue
        counts["rows"] += 1
        counts["lc_ok"] += bool(r.get("llmcompressor", {}).get("ok"))
        counts["lc_rep"] += bool(r.get("llmcompressor", {}).get("reproduces"))
        counts["fx_ok"] += bool(r.get("fxprep", {}).get("ok"))
        counts["fx_rep"] += bool(r.get("fxprep", {}).get("reproduces"))
        counts["gptq"] += bool(gptq.get("ok"))
        counts["both"] += bool(both)
        counts["identical"] += bool(both and gptq.get("identical"))
        cells = [r["model"], lc_made, lc_rep, fx_made, fx_rep, g, same, _whose(r)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines[4:4] = [
        f"Of {counts['rows']} models that build: llm-compressor's tracer makes subgraphs for {counts['lc_ok']}, "
        f"{counts['lc_rep']} of which reproduce the model; fxprep's stages are made for {counts['fx_ok']}, "
        f"{counts['fx_rep']} reproduce; GPTQ runs through pipeline=\"fxprep\" on {counts['gptq']}; where both "
        f"reproduce ({counts['both']}), the quantized model is bit-identical on {counts['identical']}.",
        "",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="model types (vlm:NAME for a VLM); default: all")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=str(ROOT / "docs" / "handoff" / "llm-compressor-table.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--merge", default=None, help="a JSON of an earlier run: the models named are measured again, "
                                                      "the others kept, and the whole table written")
    args = parser.parse_args()
    everything = sorted(set(causal_types()) | set(MOE)) + VLMS
    names = args.models or everything
    import llmcompressor
    import torch
    import transformers

    environment = {"machine": f"{platform.machine()} CPU, {mp.cpu_count()} cores",
                   "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                               f"llmcompressor {llmcompressor.__version__}"}
    start = time.perf_counter()
    rows = run(names, args.timeout)
    seconds = time.perf_counter() - start
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        again = {r["model"]: r for r in rows}
        rows = [again.get(r["model"], r) for r in earlier["rows"]]
        rows += [r for r in again.values() if r["model"] not in {e["model"] for e in earlier["rows"]}]
        seconds += earlier.get("seconds", 0.0)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment, "rows": rows, "seconds": seconds}, indent=1))
    if not args.models or args.merge:
        Path(args.out).write_text(markdown(rows, environment, seconds))
        print(f"wrote {args.out}")
    else:
        print(markdown(rows, environment, seconds))


if __name__ == "__main__":
    main()
