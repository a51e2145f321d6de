"""Issue 27 at real size on one GPU: one script, under 5 minutes on an H100.

    python benchmarks/gpu_check.py            # CUDA: Llama-2-7B shape and Qwen2-VL-2B shape, bf16
    python benchmarks/gpu_check.py --tiny     # the same checks on tiny configs, on the CPU (fp32 and bf16)

Prints, with random weights built from configs (no hub):

1. model x dtype x device -> max |diff| prepared vs eager (default kernels, measured by hand),
   fxprep's verification status, whether the attention calls (mask, is_causal, dropout,
   scale, GQA; tests/attention_calls.py) of the prepared run equal eager's, prepare's seconds and,
   on CUDA, its peak device memory against the weights' (bf16 and float32 at real size);
2. the 7B shape on ``meta``: fxprep static, fxprep dynamic (batch + sequence), and non-strict
   ``torch.export`` with the same dynamic dimensions, timed in the same run;
3. forward ratios prepared / eager: the launch-bound 8-layer Llama (hidden 1024, bs 1, 64 tokens)
   and long-sequence attention (4 layers of 7B width at 8192 tokens; 256 with --tiny), with each
   one's host time (until the call returns, before synchronising: where it is the wall time, the
   forward waits on Python; ``benchmarks/launch_profile.py`` then says where);
4. ``fxprep.save`` of the launch-bound Llama prepared on the device (its self-check runs there,
   within the forward budget of ``fxprep.io.peak``) and ``fxprep.load``: seconds, the device's peak
   during save against the weights, and max |diff| of the loaded module (moved to the device) vs
   the prepared one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/attention_calls.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import alternating, answer_cuda_capture_probe  # noqa: E402
from tests.attention_calls import differences, record  # noqa: E402

import fxprep  # noqa: E402


def llama_config(tiny: bool, layers: int | None = None, hidden: int | None = None) -> tf.LlamaConfig:
    if tiny:
        return tf.LlamaConfig(vocab_size=256, hidden_size=hidden or 64, intermediate_size=2 * (hidden or 64),
                              num_hidden_layers=layers or 4, num_attention_heads=4, num_key_value_heads=4)
    return tf.LlamaConfig(vocab_size=32000, hidden_size=hidden or 4096, intermediate_size=11008 if not hidden else 4 * hidden,
                          num_hidden_layers=layers or 32, num_attention_heads=32 if not hidden else hidden // 128,
                          num_key_value_heads=32 if not hidden else hidden // 128, max_position_embeddings=8192)


def qwen2_vl(tiny: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Qwen2-VL-2B's shape (vision 32 x 1280, text 28 x 1536) and one 224 px image; tiny: 2 x 32 / 2 x 64."""
    img = 100
    if tiny:
        vision = tf.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                        spatial_merge_size=2, temporal_patch_size=2)
        text = tf.Qwen2VLTextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
        grid = torch.tensor([[1, 4, 4]])
    else:
        vision = tf.Qwen2VLVisionConfig(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, patch_size=14,
                                        spatial_merge_size=2, temporal_patch_size=2)
        text = tf.Qwen2VLTextConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                    num_attention_heads=12, num_key_value_heads=2,
                                    rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                                     "rope_theta": 1e6})
        grid = torch.tensor([[1, 16, 16]])  # 224 px / 14 = 16 patches a side
    cfg = tf.Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=img,
                           video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    with torch.device(device):
        model = tf.Qwen2VLForConditionalGeneration(cfg).to(dtype).eval()
    tokens = int(grid.prod()) // 4
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 6, 102] + [img] * tokens + [103] + torch.randint(3, 90, (8,), generator=g).tolist()])
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g).to(dtype)
    inputs = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": (ids == img).int()}
    return model, {k: v.to(device) for k, v in inputs.items()}


def llama(tiny: bool, device: str, dtype: torch.dtype, **kw: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    cfg = llama_config(tiny, **kw)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 128 if not tiny else 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids.to(device)}


def tiny_text(cls_name: str) -> Any:
    """Tiny Qwen2 / Mistral / Gemma2 decoders (--tiny only: the table's other models)."""

    def build(tiny: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
        small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)
        extra = {"MistralConfig": dict(sliding_window=64), "Gemma2Config": dict(head_dim=16, sliding_window=16)}
        cfg = getattr(tf, cls_name.replace("ForCausalLM", "Config"))
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(tf, cls_name)(cfg(**small, **extra.get(cfg.__name__, {}))).to(dtype).eval()
        ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        return model, {"input_ids": ids.to(device)}

    return build


def tiny_llava(tiny: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    from tests import vlm_models

    model, inputs = vlm_models.llava_pixtral()
    inputs.pop("attention_mask")
    model = model.to(device=device, dtype=dtype)
    return model, {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in inputs.items()}


def first_tensor(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def equivalence_row(name: str, build: Any, tiny: bool, device: str, dtype: torch.dtype) -> list[str]:
    model, inputs = build(tiny, device, dtype)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    cuda = device.startswith("cuda")
    if cuda:  # the device's peak during the default prepare_model, against the weights (issue 27: <= ~1.5x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    try:
        gm = fxprep.prepare_model(model, example_inputs=inputs)
        status = fxprep.get_report(gm).verification.status
    except fxprep.EquivalenceError as err:
        gm = fxprep.prepare_model(model, example_inputs=inputs, verify=False)
        status = f"FAILED ({str(err)[:80]})"
    took = time.perf_counter() - start
    peak = f"{(weights + torch.cuda.max_memory_allocated() - before) / weights:.2f}x" if cuda else "-"
    with torch.no_grad():
        eager = first_tensor(model(**inputs, use_cache=False)).float()
        mine = first_tensor(gm(**inputs)).float()
    diff = float((eager - mine).abs().max())
    same = not differences(record(model, {**inputs, "use_cache": False}), record(gm, inputs))
    del gm, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return [name, str(dtype).removeprefix("torch."), device, f"{diff:.3g}", status, "yes" if same else "NO",
            f"{took:.1f}", f"{weights / 2**30:.2f}", peak]


def meta_rows(tiny: bool) -> list[list[str]]:
    """The 7B shape on meta: fxprep static / dynamic (batch + seq) and non-strict export, one run
    (the real shape with --tiny too unless --tiny-meta: on meta it needs no memory)."""
    cfg = llama_config(tiny)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    rows = []
    for label, dynamic in (("fxprep static", None), ("fxprep dynamic batch+seq", {"input_ids": {0: "batch", 1: "seq"}})):
        start = time.perf_counter()
        fxprep.prepare_model(model, example_inputs={"input_ids": ids}, verify=False, dynamic=dynamic)
        rows.append([label, f"{time.perf_counter() - start:.2f}"])
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=4096)
    start = time.perf_counter()
    try:
        torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False,
                            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "use_cache": None})
        rows.append(["torch.export non-strict, dynamic batch+seq", f"{time.perf_counter() - start:.2f}"])
    except Exception as err:  # noqa: BLE001 - reported in the table
        rows.append(["torch.export non-strict, dynamic batch+seq", f"failed: {type(err).__name__}"])
    return rows


def forward_rows(tiny: bool, device: str) -> list[list[str]]:
    cases = [("launch-bound Llama 8 x 1024, bs 1, 64 tokens", dict(layers=8, hidden=1024 if not tiny else 64), 64),
             (f"attention, 4 layers of 7B width, {256 if tiny else 8192} tokens", dict(layers=4), 256 if tiny else 8192)]
    answer_cuda_capture_probe()
    rows = []
    for label, shape, seq in cases:
        torch.manual_seed(0)
        cfg = llama_config(tiny, **shape)
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        ids = torch.randint(3, cfg.vocab_size, (1, seq), device=device)
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
        for _ in range(3):  # warm up both
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
                gm(input_ids=ids)
        repeat = 100 if tiny or seq <= 64 else 30  # the launch-bound row's 10 ms forwards: 100 pairs cost 2 s
        (eager, eager_host), (mine, mine_host) = alternating(lambda m=model, i=ids: m(input_ids=i, use_cache=False),
                                                             lambda g=gm, i=ids: g(input_ids=i), device.startswith("cuda"), repeat)
        rows.append([label, f"{eager * 1e3:.2f}", f"{mine * 1e3:.2f}", f"{mine / eager:.3f}",
                     f"{eager_host * 1e3:.2f}", f"{mine_host * 1e3:.2f}"])
        del gm, model
    return rows


def save_rows(tiny: bool, device: str) -> list[list[str]]:
    torch.manual_seed(0)
    cfg = llama_config(tiny, layers=8, hidden=1024 if not tiny else 64)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 64), device=device)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    cuda = device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fxprep.save(gm, Path(tmp) / "llama")
        saved = time.perf_counter() - start
        peak = f"{(weights + torch.cuda.max_memory_allocated() - before) / weights:.2f}x" if cuda else "-"
        start = time.perf_counter()
        loaded = fxprep.load(Path(tmp) / "llama")
        took = time.perf_counter() - start
    loaded.to(device)
    with torch.no_grad():
        diff = float((first_tensor(loaded(input_ids=ids)).float() - first_tensor(gm(input_ids=ids)).float()).abs().max())
    return [[f"Llama 8 x {cfg.hidden_size}, bf16, ids 1x64, on {device}", f"{saved:.2f}", peak, f"{took:.2f}", f"{diff:.3g}"]]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def failed_row(label: list[str], err: BaseException, width: int) -> list[str]:
    """A row for a case that raised (out of memory, a capture failure): the run goes on, so one
    case cannot cost the others' numbers on a machine lent for minutes."""
    cells = [*label, f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cells + ["-"] * (width - len(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (fp32 and bf16)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--tiny-meta", action="store_true", help="with --tiny: the meta timings on the tiny shape too")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.tiny else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny for the CPU version")
    started = time.perf_counter()
    # real size in float32 too: the 19.6 s / 51 s prepare and 34.7 GB peak for 8.8 GB of weights
    dtypes = [torch.float32, torch.bfloat16] if args.tiny else [torch.bfloat16, torch.float32]
    models = [("Llama-2-7B shape", llama), ("Qwen2-VL-2B shape", qwen2_vl)]
    if args.tiny:  # the other models, tiny only (at real size they would not fit in 5 minutes)
        models += [("Qwen2", tiny_text("Qwen2ForCausalLM")), ("Mistral", tiny_text("MistralForCausalLM")),
                   ("Gemma2 (eager attention)", tiny_text("Gemma2ForCausalLM")), ("Llava (Pixtral)", tiny_llava)]
    print(f"torch {torch.__version__}, transformers {tf.__version__}, fxprep {fxprep.__version__}, device {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device.startswith('cuda') else ''}{', tiny configs' if args.tiny else ''}\n")
    header = ["model", "dtype", "device", "max |diff| prepared vs eager", "verification", "attention calls equal",
              "prepare s", "weights GiB", "peak / weights (device)"]
    print(table(header, []), flush=True)
    for name, build in models:  # each row printed as it is measured: a run cut short keeps what it measured
        for dtype in dtypes:
            try:
                row = equivalence_row(name, build, args.tiny, device, dtype)
            except Exception as err:  # noqa: BLE001 - reported in the table
                row = failed_row([name, str(dtype).removeprefix("torch."), device], err, len(header))
            print(table(header, [row]).splitlines()[-1], flush=True)
    print()
    label = f"{'tiny' if args.tiny_meta else '7B'} shape on meta, bf16, ids 2x64"
    try:
        meta = meta_rows(args.tiny and args.tiny_meta)
    except Exception as err:  # noqa: BLE001 - reported in the table
        meta = [failed_row(["fxprep"], err, 2)]
    print(table([label, "seconds"], meta), flush=True)
    print()
    try:
        forward = forward_rows(args.tiny, device)
    except Exception as err:  # noqa: BLE001 - reported in the table
        forward = [failed_row(["forward"], err, 6)]
    print(table(["forward, bf16", "eager ms", "prepared ms", "prepared / eager", "eager host ms", "prepared host ms"],
                forward))
    print()
    try:
        saves = save_rows(args.tiny, device)
    except Exception as err:  # noqa: BLE001 - reported in the table
        saves = [failed_row(["save"], err, 5)]
    print(table(["save and load", "save s", "peak / weights during save (device)", "load s",
                 "max |diff| loaded vs prepared"], saves))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
