"""The fixed cost of ``prepare_model`` on a small model (issue 60): a 2-layer Llama's default prepare
against ``torch.export.export(..., strict=False)`` of the same model, in one process, alternating.

    PYTHONPATH=src python benchmarks/small_cost.py [--runs 7] [--profile]

The model is ``benchmarks/shape_bench.py``'s (hidden 32, 2 layers, 4 heads, vocabulary 101; ``input_ids``
1x8, one thread). One of each is run first (imports, Dynamo's and fx's first-use costs), then
default ``prepare_model``, ``dynamic=False`` and ``torch.export`` in turn, ``--runs`` times; the best
and the median of each are printed, with the ratio to ``torch.export``. ``--profile``: the default
prepare's stages (``benchmarks/_spans.py``) and the functions with the most cumulative time under
``cProfile`` (fxprep's own first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build() -> tuple[Any, Any]:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    ids = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    return model, ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    ns = parser.parse_args(argv)
    import warnings

    import torch

    import fxprep

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, ids = build()
    ways: dict[str, Callable[[], Any]] = {
        "fxprep default": lambda: fxprep.prepare_model(model, example_inputs={"input_ids": ids}),
        "fxprep dynamic=False": lambda: fxprep.prepare_model(model, example_inputs={"input_ids": ids}, dynamic=False),
        "torch.export non-strict": lambda: torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False),
    }
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(ns.runs):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = min(times["torch.export non-strict"])
    print(f"fxprep from {os.path.dirname(fxprep.__file__)}; torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.1f}; best and median of {ns.runs}, alternating")
    print("| call | best (s) | median (s) | best / torch.export |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.3f} | {statistics.median(ts):.3f} | {min(ts) / base:.2f}x |")
    if ns.profile:
        profile(ways["fxprep default"])
    return 0


def profile(call: Callable[[], Any]) -> None:
    import cProfile
    import pstats

    from _spans import spans

    with spans() as rec:
        call()
    print("\nstages of one default prepare:")
    print(rec.tree(min_seconds=0.005))
    prof = cProfile.Profile()
    prof.enable()
    call()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative")
    print("\ncProfile, cumulative, fxprep's functions:")
    stats.print_stats(r"fxprep", 40)


if __name__ == "__main__":
    sys.exit(main())
