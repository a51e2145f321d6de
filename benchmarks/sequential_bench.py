"""Sequential onloading (issue 31): calibration stage by stage against the whole model in memory.

    python benchmarks/sequential_bench.py [--layers 8] [--hidden 256] [--batches 8] [--runs 3]
    python benchmarks/sequential_bench.py --stages          # also the stages of the test models

A Llama-shaped model (``--layers`` x ``--hidden``, vocab 2000) is saved as sharded safetensors, prepared
on ``meta`` and calibrated on ``--batches`` batches of 2x64 token ids with torch.ao observers on
every Linear (a histogram observer on its input, a per-channel min/max one on its weight), three ways:

* ``whole``: ``load_weights`` into memory, every batch through the whole graph;
* ``seq-cpu``: weights in memory, ``run_sequential(..., device="cpu", offload="cpu")``;
* ``seq-disk``: ``load_weights(..., device_map={"": "disk"})`` (weights stay in the checkpoint's
  files), ``run_sequential(..., offload="disk")``.

Time is wall clock around the calibration alone (loading aside), median of ``--runs``, one thread.
Bytes: the runner's peak on the device (weights attached to modules + the running batch), against
the model's total weights. The observers' ranges are checked equal to ``whole``'s in every run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.ao.quantization.observer import HistogramObserver, PerChannelMinMaxObserver
from transformers import LlamaConfig, LlamaForCausalLM

import fxprep


def _observe(gm: Any) -> dict[str, tuple[Any, Any]]:
    observers: dict[str, tuple[Any, Any]] = {}
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, torch.nn.Linear):
            act, weight = HistogramObserver(), PerChannelMinMaxObserver(ch_axis=0)
            observers[node.target] = (act, weight)

            def hook(mod: Any, args: Any, act: Any = act, weight: Any = weight) -> None:
                act(args[0])
                weight(mod.weight)

            module.register_forward_pre_hook(hook)
    return observers


def _prepared(config: LlamaConfig, example: torch.Tensor) -> Any:
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    return fxprep.prepare_model(model, example_inputs={"input_ids": example.to("meta")}, verify=False)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k][0].min_val, b[k][0].min_val) and torch.equal(a[k][0].max_val, b[k][0].max_val)
               and torch.equal(a[k][1].min_val, b[k][1].min_val) for k in a)


def calibration(args: argparse.Namespace) -> None:
    config = LlamaConfig(vocab_size=2000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128)
    checkpoint = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(checkpoint, max_shard_size="2MB")
    batches = [{"input_ids": torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(i))}
               for i in range(args.batches)]
    times: dict[str, list[float]] = {"whole": [], "seq-cpu": [], "seq-disk": []}
    runs: dict[str, Any] = {}
    for _ in range(args.runs):
        gm = _prepared(config, batches[0]["input_ids"])
        fxprep.load_weights(gm, checkpoint)
        reference = _observe(gm)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                gm(**batch)
        times["whole"].append(time.perf_counter() - start)
        total = sum(t.numel() * t.element_size() for t in {id(t): t for t in gm.state_dict().values()}.values())

        for name, device_map, offload in (("seq-cpu", None, "cpu"), ("seq-disk", {"": "disk"}, "disk")):
            gm = _prepared(config, batches[0]["input_ids"])
            fxprep.load_weights(gm, checkpoint, device_map=device_map) if device_map else fxprep.load_weights(gm, checkpoint)
            observers = _observe(gm)
            stages = fxprep.partition(gm)
            start = time.perf_counter()
            runs[name] = fxprep.run_sequential(stages, batches, device="cpu", offload=offload)
            times[name].append(time.perf_counter() - start)
            assert _same(reference, observers), f"{name}: observer ranges differ from the whole-model calibration"
    mib = 1 << 20
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab 2000; weights {total / mib:.1f} MiB; "
          f"{args.batches} batches of 2x64 tokens; {len(stages)} stages: {[s.name for s in stages]}")
    print(f"\n| run | calibration s (median of {args.runs}) | x whole | peak on device MiB | peak / total weights |")
    print("|---|---|---|---|---|")
    whole = statistics.median(times["whole"])
    print(f"| whole | {whole:.2f} | 1.00 | {total / mib:.2f} (all weights) | 1.00 |")
    for name in ("seq-cpu", "seq-disk"):
        t = statistics.median(times[name])
        run = runs[name]
        print(f"| {name} | {t:.2f} | {t / whole:.2f} | {run.peak_bytes / mib:.2f} (weights {run.peak_weight_bytes / mib:.2f},"
              f" batch {run.peak_batch_bytes / mib:.2f}) | {run.peak_weight_bytes / total:.3f} |")
    print(f"\nlargest stage {max(runs['seq-disk'].stage_weight_bytes.values()) / mib:.2f} MiB; "
          f"activation cache peak {runs['seq-disk'].peak_cache_bytes / mib:.2f} MiB (CPU); observer ranges equal: yes")


def stage_list() -> None:
    import torchvision
    import transformers as tf

    cases = {
        "llama (3 layers)": (tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)).eval(),
                             {"input_ids": torch.randint(0, 99, (1, 8))}),
        "mixtral (2 layers, 4 experts)": (tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)).eval(),
            {"input_ids": torch.randint(0, 99, (1, 8))}),
        "torchvision ViT (3 blocks)": (torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64).eval(),
            (torch.randn(1, 3, 32, 32),)),
        "resnet18": (torchvision.models.resnet18(weights=None).eval(), (torch.randn(1, 3, 64, 64),)),
    }
    print("\n| model | stages | names |\n|---|---|---|")
    for name, (model, example) in cases.items():
        gm = fxprep.prepare_model(model, example_inputs=example)
        stages = fxprep.partition(gm)
        print(f"| {name} | {len(stages)} | {', '.join(s.name for s in stages)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stages", action="store_true", help="also list the stages of the test models")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibration(args)
    if args.stages:
        stage_list()


if __name__ == "__main__":
    main()
