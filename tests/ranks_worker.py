"""One calibration run for tests/test_sequential_ranks.py, under ``torchrun`` (each rank) or alone.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ranks_worker.py CKPT OUT --ranks
    python tests/ranks_worker.py CKPT OUT

A Llama prepared on ``meta``, its weights left on disk (``load_weights(device_map={"": "disk"})``,
each process its own offload folder), calibrated stage by stage on 5 batches with torch.ao
observers on every Linear (a histogram observer on its input, a per-channel min/max observer on its
weight, a moving-average min/max observer on its output). ``on_stage`` does what a GPTQ-style
quantizer does: it sums a Hessian ``X^T X`` of the stage's input over its batches (all-reduced over
ranks) and, on rank 0 only, rounds every Linear weight of the stage to a grid set by the replayed
input observer's range. Each process saves what it ended with: observers, Hessians, every weight
(as accelerate reads it back from disk), the logits of a last call of the graph, its own outputs.
``--fail-rank R``: on_stage raises ValueError on rank R at model.layers.1.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import transformers as tf
from torch.ao.quantization.observer import (
    HistogramObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

import fxprep

CFG = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
BATCHES = [{"input_ids": torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(i))} for i in range(5)]


def _observe_inputs(trio: tuple[Any, Any, Any]) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        trio[0](args[0])
        trio[1](module.weight)

    return hook


def _observe_output(trio: tuple[Any, Any, Any]) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        trio[2](output)

    return hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--ranks", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = 0
    if args.ranks:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": BATCHES[0]["input_ids"].to("meta")}, verify=False)
    fxprep.load_weights(gm, args.checkpoint, device_map={"": "disk"}, offload_dir=tempfile.mkdtemp())
    observers: dict[str, tuple[Any, Any, Any]] = {}
    handles = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, torch.nn.Linear):
            trio = (HistogramObserver(bins=64), PerChannelMinMaxObserver(ch_axis=0), MovingAverageMinMaxObserver())
            observers[str(node.target)] = trio
            handles.append(module.register_forward_pre_hook(_observe_inputs(trio)))
            handles.append(module.register_forward_hook(_observe_output(trio)))
    hessians: dict[str, torch.Tensor] = {}

    def on_stage(stage: Any, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> None:
        hidden = [v for v in inputs[0].values() if isinstance(v, torch.Tensor) and v.dtype == torch.float32
                  and v.shape[-1] == CFG["hidden_size"]]
        if hidden:
            name = next(n for n, v in inputs[0].items() if v is hidden[0])
            h = sum((x[name].reshape(-1, CFG["hidden_size"]).T @ x[name].reshape(-1, CFG["hidden_size"]) for x in inputs),
                    torch.zeros(CFG["hidden_size"], CFG["hidden_size"]))
            if args.ranks:
                torch.distributed.all_reduce(h)
            hessians[stage.name] = h
        if rank == 0:
            for path, module in stage.weight_modules.items():
                if isinstance(module, torch.nn.Linear) and path in observers:
                    act = observers[path][0]
                    step = (act.max_val - act.min_val) / 256
                    module.weight.data = torch.round(module.weight.data / step) * step
        if stage.name == "model.layers.1" and rank == args.fail_rank:
            raise ValueError(f"on_stage failed on rank {rank}")

    ranks = fxprep.Ranks(observers=[o for trio in observers.values() for o in trio]) if args.ranks else None
    error = None
    run = None
    try:
        run = fxprep.run_sequential(fxprep.partition(gm), BATCHES, device="cpu", offload="disk", on_stage=on_stage,
                                    ranks=ranks)
    except Exception as err:  # noqa: BLE001 - what each rank raised is what the test checks
        if os.environ.get("FXPREP_TRACE"):
            import traceback

            traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
    for handle in handles:  # a call of the graph on accelerate's hooks: its weights are onloaded inside forward
        handle.remove()
    weights = {}
    for name, module in gm.named_modules():
        for key, t in module._parameters.items():
            if t is not None:
                weights[f"{name}.{key}"] = module._hf_hook.weights_map[key] if t.is_meta else t.detach().clone()
    with torch.no_grad():
        logits = gm(input_ids=BATCHES[0]["input_ids"]).logits
    torch.save({"observers": {n: [o.state_dict() for o in trio] for n, trio in observers.items()},
                "hessians": hessians, "weights": weights, "logits": logits, "error": error,
                "outputs": [o.logits for o in run.outputs] if run else None, "batches": run.batches if run else None},
               os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
