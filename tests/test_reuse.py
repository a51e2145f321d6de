"""Block reuse on the Dynamo path: each repeated block captured once, its graph stamped out.

The contract: ``prepare_model`` with reuse gives exactly the graph of a whole-model capture (the
same nodes with the same targets and arguments in the same order, the same module stacks, the same
``state_dict`` keys, bit-equal outputs), and reuses a block only where the other instance runs the
same code. The zoo (``-m zoo``) runs the same check over more architectures.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

import fxprep
from fxprep.capture.common import LeafPolicy
from fxprep.capture.dynamo import blocks
from tests.helpers_reuse import _shape, _stamped, assert_reuse_exact, hf
from tests.zoo_models import HF_ARCHS, build_torchvision


# --------------------------------------------------------------------------------------------------
# The default suite: one decoder, alternating layers, an encoder-decoder, encoders, a CNN
# --------------------------------------------------------------------------------------------------
def test_llama_reuses_every_layer() -> None:
    reuse = assert_reuse_exact(*hf("llama", layers=4))
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.1", "model.layers.2", "model.layers.3"]}
    assert reuse["why"] == {}


def test_gemma2_sliding_window_layers_are_captured_apart() -> None:
    reuse = assert_reuse_exact(*hf("gemma2", layers=4))
    # layer_types alternate sliding / full: two kinds of layer, each captured once
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.2"], "model.layers.1": ["model.layers.3"]}
    assert "sliding_window" in reuse["why"]["model.layers.1"]


def test_moe_every_kth_layer_is_captured_apart_and_said_why() -> None:
    """Qwen2-MoE with a sparse block every 2nd layer: dense and MoE layers are two kinds, each
    captured once; with one dense layer among MoE ones, that layer has no twin."""
    reuse = assert_reuse_exact(*hf("qwen2_moe", layers=4, decoder_sparse_step=2))
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.2"], "model.layers.1": ["model.layers.3"]}
    assert "'mlp' is a Qwen2MoeSparseMoeBlock, in 'model.layers.0' a Qwen2MoeMLP" in reuse["why"]["model.layers.1"]
    reuse = assert_reuse_exact(*hf("qwen2_moe", layers=4, mlp_only_layers=[2]))
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.1", "model.layers.3"]}
    assert "'mlp' is a Qwen2MoeMLP" in reuse["why"]["model.layers.2"]
    assert "no other instance" in reuse["why"]["model.layers.2"]


def test_excluded_classes_inside_blocks_stay_leaves_in_every_copy() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    model, example = hf("llama", layers=3)
    reuse = assert_reuse_exact(model, example, module_classes_to_exclude=[LlamaMLP, LlamaRMSNorm])
    # excluded modules are called without Dynamo tracing into them (issue 13): the layer holding them
    # is captured once with them as calls, and each copy calls its own
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.1", "model.layers.2"]}
    gm = fxprep.prepare_model(model, example_inputs=example, module_classes_to_exclude=[LlamaMLP])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("mlp")] == \
        [f"model.layers.{i}.mlp" for i in range(3)]
    assert set(fxprep.get_report(gm).leaves) == {f"model.layers.{i}.mlp" for i in range(3)}


def test_an_excluded_module_outside_the_blocks_keeps_reuse() -> None:
    """Excluding a module outside the repeated blocks (the final norm, a transformers class Dynamo
    then calls without tracing into it) used to switch block reuse off for the whole model (issue 27)."""
    model, example = hf("llama", layers=4)
    reuse = assert_reuse_exact(model, example, modules_to_exclude=[model.model.norm])
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.1", "model.layers.2", "model.layers.3"]}
    gm = fxprep.prepare_model(model, example_inputs=example, modules_to_exclude=[model.model.norm])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target == "model.norm"] == ["model.norm"]
    assert "model.norm" in fxprep.get_report(gm).leaves


def test_a_block_holding_an_excluded_module_is_captured_with_the_model_and_said_why() -> None:
    model, example = hf("llama", layers=4)
    reuse = assert_reuse_exact(model, example, modules_to_exclude=[model.model.layers[1].mlp])
    assert _stamped(reuse) == {"model.layers.0": ["model.layers.2", "model.layers.3"]}
    assert "it holds 'model.layers.1.mlp', which is called without tracing into it (excluded or opaque) where its " \
        "twins' code is traced" in reuse["why"]["model.layers.1"]


class _ClampIfLarge(nn.Module):
    """No layers, a branch on data: Dynamo stops here and the fallback makes it opaque."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.abs().max() > 100:
            return h.clamp(-100, 100)
        return h


class _DecoderThenClamp(nn.Module):
    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.clamp = _ClampIfLarge()
        self.head = nn.Linear(decoder.config.hidden_size, 5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.clamp(self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state))


def test_an_opaque_part_outside_the_blocks_keeps_reuse() -> None:
    """The Dynamo fallback makes a part outside the repeated blocks opaque: the blocks are still
    captured once and stamped out, and the graph is the whole-model capture's (issue 27)."""
    lm, example = hf("llama", layers=3)
    model = _DecoderThenClamp(lm.model).eval()
    example = {"input_ids": example["input_ids"]}
    reuse = assert_reuse_exact(model, example)
    assert _stamped(reuse) == {"decoder.layers.0": ["decoder.layers.1", "decoder.layers.2"]}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo+leaves" and "clamp" in report.leaves
    other = torch.randint(0, 64, example["input_ids"].shape)
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=other), model(input_ids=other), rtol=0, atol=1e-6)


class _DecoderThenClampMethod(_DecoderThenClamp):
    """The branch on data in a method of the root: the opaque part is that method, called through a
    module fxprep places at the root."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self._clamp(self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state))

    def _clamp(self, h: torch.Tensor) -> torch.Tensor:
        if h.abs().max() > 100:
            return h.clamp(-100, 100)
        return h


def test_an_opaque_method_of_the_root_keeps_reuse() -> None:
    lm, example = hf("llama", layers=3)
    model = _DecoderThenClampMethod(lm.model).eval()
    reuse = assert_reuse_exact(model, {"input_ids": example["input_ids"]})
    assert _stamped(reuse) == {"decoder.layers.0": ["decoder.layers.1", "decoder.layers.2"]}
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": example["input_ids"]}, dynamic=False)
    assert fxprep.get_report(gm).tracer == "dynamo+leaves" and "_clamp" in fxprep.get_report(gm).leaves


def test_t5_first_block_with_position_bias_is_its_own() -> None:
    reuse = assert_reuse_exact(*hf("t5", layers=3))
    assert _stamped(reuse) == {"encoder.block.1": ["encoder.block.2"], "decoder.block.1": ["decoder.block.2"]}
    # inside the first blocks, the sublayers encoder and decoder have in common are looked at too; the
    # decoder's run on another sequence length
    assert "inputs differ" in reuse["why"]["decoder.block.0.layer.2"]


def test_bert_and_vit_encoders() -> None:
    reuse = assert_reuse_exact(*hf("bert", layers=3))
    assert _stamped(reuse) == {"encoder.layer.0": ["encoder.layer.1", "encoder.layer.2"]}
    reuse = assert_reuse_exact(*hf("vit", layers=3))
    assert _stamped(reuse) == {"vit.layers.0": ["vit.layers.1", "vit.layers.2"]}


def test_resnet_bottlenecks_reuse_within_a_stage() -> None:
    model, example = build_torchvision("resnet50")
    reuse = assert_reuse_exact(model, example)
    # the first bottleneck of a stage has the downsample (another module tree): captured on its own
    assert _stamped(reuse) == {
        "layer1.1": ["layer1.2"], "layer2.1": ["layer2.2", "layer2.3"],
        "layer3.1": ["layer3.2", "layer3.3", "layer3.4", "layer3.5"], "layer4.1": ["layer4.2"],
    }


# --------------------------------------------------------------------------------------------------
# Soundness: layers that run different code are never stamped from each other
# --------------------------------------------------------------------------------------------------
class IndexedLayer(nn.Module):
    def __init__(self, dim: int, layer_idx: int, branch: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.branch = branch
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.fc(x))
        if self.branch and self.layer_idx % 2 == 1:  # layer-index-dependent code path
            x = torch.tanh(x) * 2
        return x + 1


class Stack(nn.Module):
    def __init__(self, n: int = 4, branch: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(IndexedLayer(8, i, branch) for i in range(n))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layer_idx_branch_is_not_wrongly_reused() -> None:
    torch.manual_seed(0)
    model = Stack(4, branch=True).eval()
    reuse = assert_reuse_exact(model, torch.randn(2, 8))
    # Dynamo guards the value of layer_idx (the branch computes with it): no layer can be proven to run
    # another's code, so each is captured on its own, and the graph is still the whole-model one
    assert _stamped(reuse) == {}
    assert sorted(reuse["captured"]) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all("layer_idx" in reuse["why"][f"layers.{i}"] for i in (1, 2, 3))
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and "tanh" in str(n.target)] == \
        ["layers.1.tanh", "layers.3.tanh"]


def test_an_unread_layer_idx_does_not_stop_reuse() -> None:
    torch.manual_seed(0)
    model = Stack(4, branch=False).eval()
    reuse = assert_reuse_exact(model, torch.randn(2, 8))
    assert _stamped(reuse) == {"layers.0": ["layers.1", "layers.2", "layers.3"]}


class Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale  # baked into the graph as a constant
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_a_constant_read_from_the_instance_is_its_own() -> None:
    model = nn.Sequential(Scaled(1.0), Scaled(2.0), Scaled(1.0)).eval()
    reuse = assert_reuse_exact(model, torch.randn(2, 4))
    assert _stamped(reuse) == {"0": ["2"]}
    assert "scale" in reuse["why"]["1"]


class MaybeAux(nn.Module):
    def __init__(self, aux: bool):
        super().__init__()
        self.aux = aux
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = self.fc(x)
        return y, (y * 2 if self.aux else None)


class AuxStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MaybeAux(aux) for aux in (False, True, False, True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum()
        for layer in self.layers:
            x, aux = layer(x)
            if aux is not None:  # the outer code branches on what the block returned
                total = total + aux.sum()
        return x + total


def test_an_output_structure_that_differs_by_layer_is_followed() -> None:
    reuse = assert_reuse_exact(AuxStack().eval(), torch.randn(2, 4))
    assert _stamped(reuse) == {"layers.0": ["layers.2"], "layers.1": ["layers.3"]}
    assert "aux" in reuse["why"]["layers.1"]


def test_inputs_of_another_shape_are_captured_apart() -> None:
    class Pyramid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Scaled(1.0) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.blocks[0](x)
            b = self.blocks[1](x[:1])  # another batch size: other shapes in the graph
            return self.blocks[2](a) + b.sum()

    reuse = assert_reuse_exact(Pyramid().eval(), torch.randn(2, 4))
    assert _stamped(reuse) == {"blocks.0": ["blocks.2"]}
    assert "inputs differ" in reuse["why"]["blocks.1"]


def test_shared_submodules_are_not_reused() -> None:
    shared = nn.Linear(4, 4)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = shared
            self.out = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.fc(x))

    model = nn.Sequential(Tied(), Tied(), Tied()).eval()
    reuse = assert_reuse_exact(model, torch.randn(2, 4))
    assert reuse == {}  # 1.fc is 0.fc: a stamped copy would name it differently from a whole capture


class FunctionalLayer(nn.Module):
    """Functional ops around one layer: ``F.linear`` on its own parameters (becomes an ``nn.Linear``
    bound to them), an arithmetic op and an activation (become fxprep op modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(self.norm(x), self.weight, self.bias) * 0.5 + x)


def _added(gm: fx.GraphModule) -> list[tuple[str, str, str]]:
    return [(a.name, a.cls, a.reason) for a in fxprep.get_report(gm).added]


def test_blocks_converted_once_get_their_own_op_modules_bound_to_their_own_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[FunctionalLayer() for _ in range(3)]).eval()
    x = torch.randn(2, 8)
    reuse = assert_reuse_exact(model, x)
    assert _stamped(reuse) == {"0": ["1", "2"]}
    reused = fxprep.prepare_model(model, example_inputs=x)
    whole = fxprep.prepare_model(model, example_inputs=x, reuse_blocks=False)
    # the report lists the same modules, in graph order, as the whole-graph conversion
    assert _added(reused) == _added(whole)
    assert [name for name, _, _ in _added(reused)][:3] == ["0.linear", "0.mul", "0.add"]
    for i, layer in enumerate(model):
        linear = reused.get_submodule(f"{i}.linear")
        assert linear.weight is layer.weight and linear.bias is layer.bias  # that layer's own
    ops = [reused.get_submodule(f"{i}.mul") for i in range(3)]
    assert len({id(m) for m in ops}) == 3  # one module per call site (toolkits attach quantizers to each)
    layer = model[2]
    layer.weight.data.mul_(2)  # the prepared module follows the user's parameters
    with torch.no_grad():
        assert torch.equal(reused(x), model(x))


def test_a_name_taken_in_one_instance_is_not_stamped_over() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[FunctionalLayer() for _ in range(3)]).eval()
    model[2].mul = 3  # an attribute where the first layer's conversion puts its Mul module
    x = torch.randn(2, 8)
    reused = fxprep.prepare_model(model, example_inputs=x)
    whole = fxprep.prepare_model(model, example_inputs=x, reuse_blocks=False)
    assert _shape(reused) == _shape(whole) and _added(reused) == _added(whole)
    assert "2.mul_1" in dict(reused.named_modules()) and model[2].mul == 3
    assert _stamped(fxprep.get_report(reused).reuse) == {"0": ["1", "2"]}  # still reused, converted afterwards


def test_signature_tells_leaf_settings_apart() -> None:
    a = nn.Sequential(nn.Conv2d(3, 3, 3, stride=1), nn.ReLU())
    b = nn.Sequential(nn.Conv2d(3, 3, 3, stride=2), nn.ReLU())
    policy = LeafPolicy()
    assert blocks.signature(a, policy) != blocks.signature(b, policy)
    assert blocks.signature(a, policy) == blocks.signature(nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU()), policy)


def test_find_groups_takes_the_outermost_repeated_block() -> None:
    model = Stack(3)
    found = blocks.find_groups(model, LeafPolicy())
    assert [[n for n, _ in group] for group in found] == [["layers.0", "layers.1", "layers.2"]]
    # an excluded block is a leaf: nothing to reuse
    assert blocks.find_groups(model, LeafPolicy(classes=(IndexedLayer,))) == []
    # T5: the two stacks differ, so their blocks are looked at; the first block of each has the bias
    t5, _ = hf("t5", layers=3)
    found = blocks.find_groups(t5, LeafPolicy())
    names = [[n for n, _ in group] for group in found]
    assert ["encoder.block.1", "encoder.block.2"] in names and ["decoder.block.1", "decoder.block.2"] in names
    assert not any("encoder.block.0" in group or "encoder" in group for group in names)


def test_a_block_with_hooks_of_its_own_is_looked_inside() -> None:
    # Dynamo calls a module with hooks through its _call_impl (hooks, then forward), never as one node,
    # so a stand-in for it would be traced into: its repeated children are the blocks. transformers
    # installs output-capturing hooks on Pixtral's layers at the first call (Llava reads their outputs)
    from . import vlm_models

    model, inputs = vlm_models.llava_pixtral()
    with torch.no_grad():
        model(**inputs)
    vision = "model.vision_tower.transformer.layers"
    assert all(layer._forward_hooks for layer in model.get_submodule(vision))
    names = [[n for n, _ in group] for group in blocks.find_groups(model, LeafPolicy())]
    assert [f"{vision}.0.feed_forward", f"{vision}.1.feed_forward"] in names
    assert ["model.language_model.layers.0", "model.language_model.layers.1"] in names  # no hooks there
    assert not any(f"{vision}.{i}" in group for group in names for i in (0, 1))


def test_reuse_can_be_switched_off_and_the_user_model_is_untouched() -> None:
    model = Stack(3, branch=False).eval()
    classes = [type(m) for m in model.modules()]
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8), reuse_blocks=False)
    assert fxprep.get_report(gm).reuse == {}
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8))
    assert _stamped(fxprep.get_report(gm).reuse)
    assert [type(m) for m in model.modules()] == classes
    assert any("block reuse" in n for n in fxprep.get_report(gm).notes)
    with pytest.raises(fxprep.InvalidInput):
        fxprep.prepare_model(model, example_inputs=torch.randn(2, 8), reuse_blocks="yes")


def test_meta_model_reuse() -> None:
    with torch.device("meta"):
        model, _ = hf("llama", layers=3)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, verify=False)
    assert _stamped(fxprep.get_report(gm).reuse) == {"model.layers.0": ["model.layers.1", "model.layers.2"]}
    assert all(p.is_meta for p in gm.parameters())


# --------------------------------------------------------------------------------------------------
# The zoo: every architecture of the issue
# --------------------------------------------------------------------------------------------------
ZOO: dict[str, tuple[int, dict[str, Any]]] = {
    "mistral": (3, {}), "qwen2": (3, {}), "mixtral": (3, {}), "qwen2_moe": (3, {}), "phi3": (3, {}),
    "gemma3_text": (4, {"layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gpt2": (3, {}), "whisper": (3, {}), "roberta": (3, {}), "bart": (3, {}), "clip": (3, {}),
}


@pytest.mark.zoo
@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_reuse_zoo_transformers(model_type: str) -> None:
    layers, extra = ZOO[model_type]
    reuse = assert_reuse_exact(*hf(model_type, layers=layers, **extra))
    assert _stamped(reuse)


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16", "swin_t", "convnext_tiny", "efficientnet_b0"])
def test_reuse_zoo_torchvision(name: str) -> None:
    assert_reuse_exact(*build_torchvision(name))


@pytest.mark.zoo
@pytest.mark.parametrize("family", ["vision_transformer", "resnet", "convnext"])
def test_reuse_zoo_timm(family: str) -> None:
    from tests.zoo_models import build_timm

    reuse = assert_reuse_exact(*build_timm(family))
    assert _stamped(reuse)


@pytest.mark.zoo
@pytest.mark.parametrize("model_type", sorted(HF_ARCHS))
def test_reuse_is_exact_on_the_whole_transformers_zoo(model_type: str) -> None:
    """Every zoo architecture with 3 layers: reuse where it applies, and the same graph either way."""
    extra = {"attention_types": [[["global", "local"], 1], [["global"], 1]]} if model_type == "gpt_neo" else {}
    assert_reuse_exact(*hf(model_type, layers=3, **extra))
