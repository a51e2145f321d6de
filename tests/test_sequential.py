"""``fxprep.run_sequential``: a partitioned graph run one stage at a time on accelerate's hooks.

Checked on a tiny Llama: the outputs equal the whole graph's for every offload and cache mode; while
a stage runs, only its weights are held by the model's modules (an independent count of every
tensor not on ``meta``, next to the runner's own accounting); weights ``on_stage`` changes are
written back; the model is left as found (same tensor objects, no hooks); what a user can get wrong
(batches, on_stage's signature, devices) is refused before any module runs. Write-back wherever the
weights live, transactions and offload folders: tests/test_sequential_transactions.py; ranks:
tests/test_sequential_ranks.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

import fxprep
from fxprep.errors import InvalidInput

CFG = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
BATCHES = [{"input_ids": torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(i))} for i in range(3)]


@pytest.fixture(scope="module")
def gm() -> Any:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    return fxprep.prepare_model(model, example_inputs=BATCHES[0])


def _tensors(gm: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    return {(id(m), k): t for m in gm.modules() for k, t in list(m._parameters.items()) + list(m._buffers.items())
            if t is not None}


def _held_bytes(gm: nn.Module) -> int:
    """Bytes of the distinct tensors the modules hold that are not on meta (what is onloaded)."""
    seen: dict[int, int] = {}
    for t in _tensors(gm).values():
        if not t.is_meta:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("offload", ["cpu", "disk", None])
@pytest.mark.parametrize("cache", ["cpu", "disk"])
def test_outputs_equal_the_whole_graph(gm: Any, offload: str | None, cache: str) -> None:
    stages = fxprep.partition(gm)
    run = fxprep.run_sequential(stages, BATCHES, device="cpu", offload=offload, cache=cache)
    with torch.no_grad():
        for batch, got in zip(BATCHES, run.outputs, strict=True):
            assert type(got) is tf.modeling_outputs.CausalLMOutputWithPast
            assert torch.equal(got.logits, gm(**batch).logits)
    assert list(run.seconds) == [s.name for s in stages]


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_only_one_stage_is_resident(gm: Any, offload: str) -> None:
    stages = fxprep.partition(gm)
    held: dict[str, int] = {}
    offloaded: dict[str, bool] = {}

    def on_stage(stage: Any, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> None:
        assert len(inputs) == len(outputs) == len(BATCHES)
        assert set(outputs[0]) == set(stage.outputs) and set(inputs[0]) == set(stage.inputs)
        held[stage.name] = _held_bytes(gm)
        others = [m for s in stages if s is not stage for m in s.weight_modules.values()
                  if m not in stage.weight_modules.values()]
        offloaded[stage.name] = all(p.is_meta for m in others for p in m._parameters.values() if p is not None)

    run = fxprep.run_sequential(stages, BATCHES, device="cpu", offload=offload, on_stage=on_stage)
    assert set(held) == {s.name for s in stages} and all(offloaded.values())
    for stage in stages:  # counted independently of the runner: this stage's weights and the pinned buffers
        assert held[stage.name] <= run.stage_weight_bytes[stage.name] + run.pinned_bytes
    largest = max(run.stage_weight_bytes.values())
    assert run.peak_weight_bytes <= largest + run.pinned_bytes < run.total_weight_bytes
    assert run.peak_bytes <= run.peak_weight_bytes + run.peak_batch_bytes
    assert run.total_weight_bytes == sum(t.numel() * t.element_size() for t in gm.state_dict().values()
                                         if t.dtype.is_floating_point) - CFG["vocab_size"] * CFG["hidden_size"] * 4


def test_the_model_is_left_as_found(gm: Any) -> None:
    before = _tensors(gm)
    forward = {id(m): m.__dict__.get("forward") for m in gm.modules()}
    fxprep.run_sequential(fxprep.partition(gm), BATCHES, device="cpu", offload="disk")
    after = _tensors(gm)
    assert after.keys() == before.keys() and all(after[k] is t for k, t in before.items())
    assert not any(hasattr(m, "_hf_hook") or hasattr(m, "_old_forward") for m in gm.modules())
    assert {id(m): m.__dict__.get("forward") for m in gm.modules()} == forward


@pytest.fixture(scope="module")
def changed() -> tuple[nn.Module, Any]:
    """A model of its own (and its graph) for the test that changes weights: both offload modes use
    it, each wanting what it finds changed once more."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    return model, fxprep.prepare_model(model, example_inputs=BATCHES[0], verify=False)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_weights_changed_on_stage_are_written_back(changed: tuple[nn.Module, Any], offload: str) -> None:
    model, gm = changed
    want = {n: p.detach().clone() * (0.5 if n.endswith("down_proj.weight") else 1.0) for n, p in model.named_parameters()}

    def halve_down_proj(stage: Any, inputs: Any, outputs: Any) -> None:  # a GPTQ-style update, in place
        for path, module in stage.weight_modules.items():
            if path.endswith("down_proj"):
                with torch.no_grad():
                    module.weight.mul_(0.5)

    fxprep.run_sequential(fxprep.partition(gm), BATCHES, device="cpu", offload=offload, on_stage=halve_down_proj)
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], w) for n, w in want.items())


def test_refusals(gm: Any) -> None:
    stages = fxprep.partition(gm)
    with pytest.raises(InvalidInput, match="offload"):
        fxprep.run_sequential(stages, BATCHES, device="cpu", offload="gpu")
    with pytest.raises(InvalidInput, match="at least one batch"):
        fxprep.run_sequential(stages, [], device="cpu")
    with pytest.raises(InvalidInput, match="partition"):
        fxprep.run_sequential(list(stages), BATCHES, device="cpu")
    with torch.device("meta"):
        empty = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    meta_gm = fxprep.prepare_model(empty, example_inputs={"input_ids": BATCHES[0]["input_ids"].to("meta")}, verify=False)
    with pytest.raises(InvalidInput, match="load them first"):
        fxprep.run_sequential(fxprep.partition(meta_gm), BATCHES, device="cpu", offload="cpu")


@pytest.mark.parametrize("name", ["resnet18", "vit"])
def test_vision_models_run_sequentially(name: str) -> None:
    """BatchNorm buffers (ResNet) and tensors the graph reads off the root (ViT's class token, never
    offloaded) on the same hooks."""
    import torchvision

    torch.manual_seed(0)
    if name == "resnet18":
        model, shape = torchvision.models.resnet18(weights=None, num_classes=10).eval(), (1, 3, 64, 64)
    else:
        model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                                                     hidden_dim=32, mlp_dim=64, num_classes=10).eval()
        shape = (2, 3, 32, 32)
    batches = [(torch.randn(shape, generator=torch.Generator().manual_seed(i)),) for i in range(2)]
    gm = fxprep.prepare_model(model, example_inputs=batches[0])
    run = fxprep.run_sequential(fxprep.partition(gm), batches, device="cpu", offload="disk", cache="disk")
    with torch.no_grad():
        assert all(torch.equal(gm(*b), out) for b, out in zip(batches, run.outputs, strict=True))
    assert run.peak_weight_bytes <= max(run.stage_weight_bytes.values()) + run.pinned_bytes < run.total_weight_bytes


def test_bad_input_is_refused_before_any_stage_runs(gm: Any, tmp_path: Any) -> None:
    """Batches whose keys or shapes do not fit, an on_stage of another signature, a device this machine
    does not have (named to run_sequential or in a device map), ranks without torch.distributed: each an
    FxprepError naming what to change, raised before any module runs or any weight is loaded."""
    stages = fxprep.partition(gm)
    calls: list[str] = []
    handle = gm.get_submodule("model.layers.0.mlp.up_proj").register_forward_pre_hook(lambda m, a: calls.append("ran"))

    def on_stage(stage: Any, inputs: Any, outputs: Any) -> None:
        calls.append(stage.name)

    try:
        with pytest.raises(InvalidInput, match=r"batch 1 does not fit the prepared graph: .*input_ids"):
            fxprep.run_sequential(stages, [BATCHES[0], {"input_idz": BATCHES[1]["input_ids"]}], device="cpu",
                                  on_stage=on_stage)
        with pytest.raises(fxprep.InputMismatch, match=r"(?s)batch 2 does not fit the prepared graph: .*input_ids: shape .*got 2x8x1"):
            fxprep.run_sequential(stages, BATCHES[:2] + [{"input_ids": BATCHES[2]["input_ids"][..., None]}],
                                  device="cpu", on_stage=on_stage)
        with pytest.raises(InvalidInput, match=r"on_stage\(stage, inputs, outputs\).*give it those three parameters"):
            fxprep.run_sequential(stages, BATCHES, device="cpu", on_stage=lambda stage: None)
        with pytest.raises(InvalidInput, match=r"device = 'cuda:99', but this machine has (no cuda device|\d+ cuda)"):
            fxprep.run_sequential(stages, BATCHES, device="cuda:99", on_stage=on_stage)
        with pytest.raises(InvalidInput, match=r"device = 'gpu' is not a device"):
            fxprep.run_sequential(stages, BATCHES, device="gpu", on_stage=on_stage)
        with pytest.raises(InvalidInput, match=r"torch.distributed initialised first"):
            fxprep.run_sequential(stages, BATCHES, device="cpu", on_stage=on_stage, ranks=fxprep.Ranks())
    finally:
        handle.remove()
    assert calls == []
    # a device map naming a device this machine does not have: refused before a tensor is loaded
    checkpoint = tmp_path / "llama"
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).save_pretrained(checkpoint)
    with torch.device("meta"):
        empty = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    meta_gm = fxprep.prepare_model(empty, example_inputs={"input_ids": BATCHES[0]["input_ids"].to("meta")}, verify=False)
    with pytest.raises(InvalidInput, match=r"device_map\['model.layers.1'\] = 'cuda:99', but this machine has"):
        fxprep.load_weights(meta_gm, checkpoint, device_map={"": "cpu", "model.layers.1": "cuda:99"})
    assert all(p.is_meta for p in meta_gm.parameters())
