"""Block reuse on a VLM captured deciding values read from data (issue 27: "block reuse also keeps
working when a model has opaque parts outside the repeated blocks (the VLM above)").

Builds a Qwen2-VL, Qwen2.5-VL, Llava with a Pixtral tower or Mistral3 from its config (random
weights, no hub) with ``--depth`` vision blocks and ``--depth`` decoder layers, with the tests'
example (:mod:`tests.vlm_models`: Qwen's vision attention splits by ``cu_seqlens.tolist()``,
Pixtral's patch grid is sliced by ``image_sizes``, so all four take the ``dynamo+values`` route;
Pixtral's layers carry transformers' output-capturing hooks, so their feed-forwards are the
blocks there), and prepares it with block reuse and without (``reuse_blocks=False``, what every
earlier version did on that route), in that order, in one process. Prints the wall time of each default
``prepare_model``, the tracer, the blocks stamped out, the verification status and the largest
difference between the two graphs' logits.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/vlm_reuse.py [--model qwen2_vl --depth 8]
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/vlm_reuse.py --model llava_pixtral --depth 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the tests' model builders


def build(name: str, depth: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from tests import vlm_models

    model, inputs = getattr(vlm_models, name)()
    config = model.config
    if name.startswith("qwen"):
        config.vision_config.depth = depth
    else:
        config.vision_config.num_hidden_layers = depth
    config.text_config.num_hidden_layers = depth
    if getattr(config.text_config, "layer_types", None) is not None:
        config.text_config.layer_types = [config.text_config.layer_types[0]] * depth
    if name == "qwen2_5_vl":
        config.vision_config.fullatt_block_indexes = list(range(depth - 1, depth))  # the last block full
    torch.manual_seed(0)
    return type(model)(config).eval(), inputs


def main() -> None:
    import fxprep

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["qwen2_vl", "qwen2_5_vl", "llava_pixtral", "mistral3"], default="qwen2_vl")
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    model, inputs = build(args.model, args.depth)
    print(f"{args.model}: {args.depth} vision blocks, {args.depth} decoder layers; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    logits = {}
    for reuse in (True, False):
        start = time.perf_counter()
        gm = fxprep.prepare_model(model, example_inputs=inputs, reuse_blocks=reuse)
        seconds = time.perf_counter() - start
        report = fxprep.get_report(gm)
        stamped = sum(len(v) for v in report.reuse.get("captured", {}).values())
        with torch.no_grad():
            logits[reuse] = gm(**inputs)[0]
        print(f"  reuse_blocks={reuse!s:5}  prepare {seconds:7.1f} s  tracer {report.tracer}  "
              f"blocks stamped out {stamped}  verification {report.verification.status}")
    print(f"  max |logits with reuse - without| = {(logits[True] - logits[False]).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
