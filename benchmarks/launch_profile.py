"""Where a launch-bound prepared forward spends its host time, next to eager's (issue 27, item 4).

    PYTHONPATH=src python benchmarks/launch_profile.py          # CUDA: Llama 8 x 1024, bf16, bs 1, 64 tokens
    PYTHONPATH=src python benchmarks/launch_profile.py --cpu    # the same on a tiny width, on the CPU

At batch 1 a GPU forward waits on the host: the prepared graph was 1.055x eager on an H200 (10.61 vs
10.05 ms) before ``fxprep.runtime.forward_code`` (module lookups once per call, ``nn.Module.__call__``
skipped where it would only call ``forward``), 0.93x-0.95x after. This prints, for eager and
prepared: wall and host time per forward (host: until the call returns, before synchronising;
medians of 100 calls each, alternating), cProfile's top functions by own time
(``nn.Module.__getattr__`` chains and ``_call_impl`` show there), and torch.profiler's top ops by
self CPU time (kernel launches, synchronisations).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import alternating, answer_cuda_capture_probe  # noqa: E402

import fxprep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="a tiny width on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu")
    answer_cuda_capture_probe()
    hidden, heads = (64, 4) if args.cpu else (1024, 16)
    cfg = tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=8,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=32000)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 64), device=device)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, progress=False)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    forwards = {"eager": lambda: model(input_ids=ids, use_cache=False), "prepared": lambda: gm(input_ids=ids)}
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {device}, Llama 8 x {hidden}, bf16, ids 1x64")
    with torch.no_grad():
        for forward in (*forwards.values(), *forwards.values()):  # warm up
            forward()
        times = alternating(forwards["eager"], forwards["prepared"], device == "cuda", 100)
        for name, (wall, host) in zip(forwards, times):
            print(f"{name}: wall {wall * 1e3:.2f} ms per forward, host {host * 1e3:.2f} ms (median of 100, alternating)")
        print(f"prepared / eager: wall {times[1][0] / times[0][0]:.3f}x, host {times[1][1] / times[0][1]:.3f}x")
        for name, forward in forwards.items():
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                forward()
            sync()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
            print(f"\n--- cProfile, {name}, 20 forwards, by own time")
            print("\n".join(text.getvalue().splitlines()[3:]))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for name, forward in forwards.items():
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(10):
                    forward()
                sync()
            print(f"\n--- torch.profiler, {name}, 10 forwards, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
