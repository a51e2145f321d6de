"""Peak memory of ``prepare_model`` against the model's weights (issue 27: "preparing never needs
more than ~1.5x the weights' memory on the device").

Builds a Llama-shaped transformers model directly in the chosen dtype, measures the process's
resident memory once the model exists (weights included), then samples it every 5 ms on a thread
while ``prepare_model`` runs (capture, passes, verification: the default call). Prints the weights'
bytes, the extra memory preparation took at its peak, and ``(weights + extra) / weights``, the
figure the issue bounds. On CPU the device is the process's memory; the same script on CUDA reads
``torch.cuda.max_memory_allocated`` instead (``--device cuda``).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/prepare_memory.py [--layers 8 --hidden 2048 --dtype bfloat16]
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/prepare_memory.py --model qwen2_vl --layers 4 --vision-layers 4
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time

import torch


def rss_bytes() -> int:
    """The process's resident memory now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The largest resident memory seen while the ``with`` block runs (sampled every 5 ms)."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model", default="llama", choices=["llama", "qwen2_vl"],
                        help="qwen2_vl: a Qwen2-VL shape (vision tower width 1280 / --vision-layers, the text "
                             "model as for llama) with one 224px image: the VLM the issue measured at 3.9x")
    parser.add_argument("--vision-layers", type=int, default=4)
    args = parser.parse_args()

    import fxprep

    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)  # initialise directly in the dtype: no float32 copy first
    with torch.device(args.device):
        model, inputs = (_qwen2_vl if args.model == "qwen2_vl" else _llama)(args)
    torch.set_default_dtype(torch.float32)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    gc.collect()

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
    started = time.perf_counter()
    with PeakSampler() as sampler:
        gm = fxprep.prepare_model(model, example_inputs=inputs, progress=False)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else sampler.peak
    extra = peak - before
    report = gm.fxprep_report
    print(f"torch {torch.__version__}, {args.device}, {args.model} {args.layers} layers, hidden {args.hidden}, "
          f"{args.dtype}, inputs {', '.join(f'{k} {list(v.shape)}' for k, v in inputs.items())}")
    print(f"prepare_model: {seconds:.1f} s, tracer {report.tracer}, verification {report.verification.status} "
          f"(max |diff| {report.verification.max_abs_diff:.3g})")
    print(f"weights {weights / 2**20:.0f} MiB; memory before prepare {before / 2**20:.0f} MiB "
          f"({'allocated' if cuda else 'process RSS, weights included'}); peak during prepare {peak / 2**20:.0f} MiB")
    print(f"extra at the peak {extra / 2**20:.0f} MiB = {extra / weights:.2f}x the weights; "
          f"(weights + extra) / weights = {(weights + extra) / weights:.2f}x")


def _llama(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 512 or 1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model, {"input_ids": torch.randint(0, args.vocab, (1, args.tokens))}


def _qwen2_vl(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Qwen2-VL-2B's vision width (1280, 16 heads, patch 14, merge 2) at ``--vision-layers``, and a
    text model of ``--layers`` x ``--hidden``; one 224px image (16x16 patches, 64 image tokens)."""
    import transformers as tf

    image, vocab = 151655, max(args.vocab, 151680)
    vision = tf.Qwen2VLVisionConfig(depth=args.vision_layers, embed_dim=1280, hidden_size=args.hidden, num_heads=16,
                                    mlp_ratio=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    heads = args.hidden // 128
    text = tf.Qwen2VLTextConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                intermediate_size=int(args.hidden * 5.75) // 64 * 64, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 6),
                                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6})
    config = tf.Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=image,
                              video_token_id=image + 1, vision_start_token_id=image - 3, vision_end_token_id=image - 2)
    model = tf.Qwen2VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 16, 16]])
    pixel_values = torch.randn(256, 3 * 2 * 14 * 14)
    ids = torch.tensor([[5, 6, image - 3] + [image] * 64 + [image - 2] + list(range(7, 7 + args.tokens))])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "image_grid_thw": grid, "mm_token_type_ids": (ids == image).int()}


if __name__ == "__main__":
    main()
