"""Peak memory of ``prepare_model`` against the model's weights (issue 27: "preparing never needs
more than ~1.5x the weights' memory on the device").

Builds a Llama-shaped transformers model directly in the chosen dtype, measures the process's
resident memory once the model exists (weights included), then samples it every 5 ms on a thread
while ``prepare_model`` runs (capture, passes, verification: the default call). Prints the weights'
bytes, the extra memory preparation took at its peak, and ``(weights + extra) / weights``, the
figure the issue bounds. On CPU the device is the process's memory; the same script on CUDA reads
``torch.cuda.max_memory_allocated`` instead (``--device cuda``).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/prepare_memory.py [--layers 8 --hidden 2048 --dtype bfloat16]
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
    args = parser.parse_args()

    import transformers

    import fxprep

    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 512 or 1,
    )
    torch.set_default_dtype(dtype)  # initialise directly in the dtype: no float32 copy first
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=args.device)
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
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, progress=False)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else sampler.peak
    extra = peak - before
    report = gm.fxprep_report
    print(f"torch {torch.__version__}, {args.device}, Llama {args.layers} layers, hidden {args.hidden}, {args.dtype}, "
          f"ids 1x{args.tokens}")
    print(f"prepare_model: {seconds:.1f} s, tracer {report.tracer}, verification {report.verification.status} "
          f"(max |diff| {report.verification.max_abs_diff:.3g})")
    print(f"weights {weights / 2**20:.0f} MiB; memory before prepare {before / 2**20:.0f} MiB "
          f"({'allocated' if cuda else 'process RSS, weights included'}); peak during prepare {peak / 2**20:.0f} MiB")
    print(f"extra at the peak {extra / 2**20:.0f} MiB = {extra / weights:.2f}x the weights; "
          f"(weights + extra) / weights = {(weights + extra) / weights:.2f}x")


if __name__ == "__main__":
    main()
