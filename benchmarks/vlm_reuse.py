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
    PYTHONPATH=src python benchmarks/vlm_reuse.py --shape 2b    # Qwen2-VL at 2B sizes, bf16 (~5 GB)
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


# Qwen2-VL-2B's sizes (its published config.json), for ``--shape 2b``: the tests' example and token ids kept
QWEN2_VL_2B_VISION = {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4}
QWEN2_VL_2B_TEXT = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768}


def build_2b(dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Qwen2-VL at the 2B model's sizes (random weights, no hub; 2.2 billion parameters), with the
    tests' multimodal example (two small images, 22 tokens)."""
    from tests import vlm_models

    model, inputs = vlm_models.qwen2_vl()
    config = model.config
    for key, value in QWEN2_VL_2B_VISION.items():
        setattr(config.vision_config, key, value)
    for key, value in QWEN2_VL_2B_TEXT.items():
        setattr(config.text_config, key, value)
    config.text_config.head_dim = 128
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": [16, 24, 24]}
    if getattr(config.text_config, "layer_types", None) is not None:
        config.text_config.layer_types = [config.text_config.layer_types[0]] * 28
    torch.manual_seed(0)
    with torch.device("cpu"):
        big = type(model)(config).to(dtype).eval()
    return big, {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def main() -> None:
    import fxprep

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["qwen2_vl", "qwen2_5_vl", "llava_pixtral", "mistral3"], default="qwen2_vl")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--shape", choices=["tiny", "2b"], default="tiny",
                        help="2b: Qwen2-VL at the 2B model's sizes (qwen2_vl only), bfloat16, block reuse only")
    args = parser.parse_args()
    if args.shape == "2b":
        import gc
        import resource

        def peak() -> str:  # the process's peak resident memory so far (Linux: kilobytes)
            return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB"

        model, inputs = build_2b(torch.bfloat16)
        print(f"qwen2_vl at 2B sizes: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, bfloat16; "
              f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); peak memory after the build {peak()}")
        for dynamic in (None, False):
            start = time.perf_counter()
            gm = fxprep.prepare_model(model, example_inputs=inputs, **({} if dynamic is None else {"dynamic": False}))
            report = fxprep.get_report(gm)
            stamped = sum(len(v) for v in report.reuse.get("captured", {}).values())
            print(f"  {'default (shape-general)' if dynamic is None else 'dynamic=False':24} prepare "
                  f"{time.perf_counter() - start:7.1f} s  tracer {report.tracer}  blocks stamped out {stamped}  "
                  f"verification {report.verification.status} (max |diff| {report.verification.max_abs_diff}); "
                  f"peak memory so far {peak()}")
            del gm, report
            gc.collect()
        return
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
