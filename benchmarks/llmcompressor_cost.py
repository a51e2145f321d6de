"""What making the subgraphs costs: llm-compressor's own tracer (``trace_subgraphs``) against fxprep's
stages (``fxprep_subgraphs``) on the same model, in one process, alternating, best of ``--repeat``.

At LLM size the models are built on ``meta`` (no weights: a 7B in float32 is 28 GB, this machine has
24), as llm-compressor's tracer needs none either; fxprep then captures its twin on ``meta`` without
running anything. The tiny rows measure the fixed overhead on a 2-layer model with real weights, where
fxprep also verifies the graph against the model. Run in llm-compressor's environment::

    .venv-llmcompressor/bin/python benchmarks/llmcompressor_cost.py [--repeat 3] [--only tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _models(only: str | None) -> list[tuple[str, Any, dict[str, Any]]]:
    import torch
    import transformers as tf

    cases = []
    if only in (None, "llm"):
        with torch.device("meta"):
            llama = tf.LlamaForCausalLM(tf.LlamaConfig()).eval()  # the defaults are Llama-2-7B's shape
            # Mixtral-8x7B's shape; its experts looped over in eager (oneshot linearises them into Linear
            # layers first, which needs the weights; the fused grouped_mm kernel refuses float32 on meta)
            mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(experts_implementation="eager")).eval()
        for name, model in (("Llama-2-7B shape, meta", llama), ("Mixtral-8x7B shape, meta", mixtral)):
            ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
            cases.append((name, model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    if only in (None, "tiny"):
        from llmcompressor.modeling.moe.linearize import linearize_moe

        small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(**small, num_local_experts=4))
        linearize_moe(mixtral)
        for name, model in (("tiny Llama, 2 layers", tf.LlamaForCausalLM(tf.LlamaConfig(**small))),
                            ("tiny Mixtral, 2 layers", mixtral)):
            ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
            cases.append((name, model.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=("llm", "tiny"), default=None)
    args = parser.parse_args()
    import llmcompressor
    import torch
    import transformers
    from llmcompressor.args import DatasetArguments
    from llmcompressor.pipelines.sequential.helpers import trace_subgraphs
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    import fxprep.compat.llmcompressor as fxlc

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, llmcompressor {llmcompressor.__version__}; "
          f"best of {args.repeat}, alternating, one process")
    print("| model | llm-compressor's tracer s | fxprep's stages s | ratio | subgraphs (theirs / ours) |")
    print("|---|---|---|---|---|")
    ignore = DatasetArguments().tracing_ignore
    for name, model, batch in _models(args.only):
        targets = infer_sequential_targets(model, None)
        best = {"theirs": float("inf"), "ours": float("inf")}
        made = {}
        for _ in range(args.repeat):
            for who, make in (("theirs", trace_subgraphs), ("ours", fxlc.fxprep_subgraphs)):
                start = time.perf_counter()
                made[who] = make(model, batch, targets, ignore, 1)
                best[who] = min(best[who], time.perf_counter() - start)
        print(f"| {name} | {best['theirs']:.3f} | {best['ours']:.3f} | {best['ours'] / best['theirs']:.2f}x | "
              f"{len(made['theirs'])} / {len(made['ours'])} |", flush=True)


if __name__ == "__main__":
    main()
