"""torchvision classification zoo through the fx path: ``prepare_model(model, tracer="fx", example_inputs=...)``.

Why real models: the passes are unit-tested on toy graphs, but the contract AIMET users rely on
(verified output, no functional compute left, one module per call site, the user's own Parameter
objects, state_dict parity in both directions, the user's model untouched) is only worth something
if it holds on the architectures people actually quantize: residual adds, SE blocks, channel
shuffles, stochastic depth, attention with shifted windows, densely concatenated features...

The default run checks a representative subset (eval mode, plus a few models in train mode, where
dropout / stochastic depth / BatchNorm statistics behave differently); ``-m zoo`` checks every model
``torchvision.models.list_models(module=torchvision.models)`` returns. Inputs are as small as each
architecture accepts, so a full zoo run stays CPU-friendly.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxprep
from fxprep.passes.functional_to_module import remaining_compute_ops

from .helpers import TV_VIT_KWARGS, zoo_params
from .zoo_models import ALL_MODELS, INPUT_SIZE, TRAIN_INPUT_SIZE
from .zoo_models import build_fx as build

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


# Models plain ``torch.fx.symbolic_trace`` cannot trace, with the reason. They are skipped by the zoo
# test and ``test_untraceable_list_is_current`` proves each one still fails, so the list cannot rot
# into hiding a model that fxprep should handle. Empty since torchvision 0.29: all 80 classification
# models trace with plain fx.
FX_UNTRACEABLE: dict[str, str] = {}

# Default run: one of each family that exercises something different (~40 s on one core).
SUBSET: list[str] = [
    "resnet18",  # residual add, in-place ReLU reused within a block
    "mobilenet_v3_small",  # SE blocks (multiply), hardswish, dropout
    "efficientnet_b0",  # SiLU, SE, stochastic depth
    "densenet121",  # torch.cat of many features, functional relu / pooling
    "convnext_tiny",  # permutes, LayerNorm2d, layer scale (Parameter * x), stochastic depth
    "vit_b_16",  # class token cat, attention, positional Parameter add
    "swin_t",  # shifted-window attention with rolls, masks, relative position bias
    "shufflenet_v2_x0_5",  # channel shuffle (views), chunk, cat
    "inception_v3",  # input transform, many cat branches
    "googlenet",  # transform_input arithmetic on slices
    "regnet_y_400mf",  # grouped convs, SE
    "squeezenet1_0",  # cat of expand branches, no linear head
    "mnasnet0_5",  # versioned _load_from_state_dict on the root (state_dict metadata must match)
    "maxvit_t",  # tensor constants created in forward, relative position bias, stochastic depth
    "mobilenet_v2",  # ReLU6, inverted residuals
    "efficientnet_v2_s",  # fused MBConv
    "swin_v2_t",  # log-spaced continuous position bias, cosine attention (clamp, normalize)
    "vit_b_32",
    "alexnet",  # dropout in the classifier, adaptive pooling
    "resnext50_32x4d",
]
# Train mode changes what is traced (dropout, stochastic depth, BatchNorm batch statistics).
TRAIN_SUBSET: list[str] = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "googlenet"]


def _attrs(m: nn.Module) -> list[tuple[str, int]]:
    """Every instance attribute by identity: tracing must not leave ``_tensor_constant0`` (or a
    Proxy a forward cached on ``self``) behind on the user's modules."""
    return sorted((k, id(v)) for k, v in vars(m).items())


@dataclass
class Snapshot:
    """Everything about the user's model that prepare_model promises not to change."""

    state: dict[str, torch.Tensor]
    tree: list[tuple[str, int, type]]
    tensor_ids: list[tuple[str, int]]
    training: dict[str, bool]
    hooks: dict[str, tuple[int, int, int, int]]
    attrs: dict[str, list[tuple[str, int]]]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        modules = list(model.named_modules(remove_duplicate=False))
        return cls(
            state={k: v.detach().clone() for k, v in model.state_dict().items()},
            tree=[(name, id(m), type(m)) for name, m in modules],
            tensor_ids=[(k, id(v)) for k, v in model.state_dict(keep_vars=True).items()],
            training={name: m.training for name, m in modules},
            hooks={
                name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                       len(m._state_dict_hooks))
                for name, m in modules
            },
            attrs={name: _attrs(m) for name, m in modules},
        )

    def assert_unchanged(self, model: nn.Module) -> None:
        modules = list(model.named_modules(remove_duplicate=False))
        assert [(name, id(m), type(m)) for name, m in modules] == self.tree, "module tree changed"
        assert [(k, id(v)) for k, v in model.state_dict(keep_vars=True).items()] == self.tensor_ids, (
            "parameter/buffer objects or state_dict keys changed"
        )
        assert {name: m.training for name, m in modules} == self.training, "training flags changed"
        hooks = {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._state_dict_hooks))
            for name, m in modules
        }
        assert hooks == self.hooks, "hooks added to or removed from the original model"
        attrs = {name: _attrs(m) for name, m in modules}
        changed_attrs = {n: sorted(set(a) ^ set(self.attrs[n])) for n, a in attrs.items() if a != self.attrs[n]}
        assert not changed_attrs, f"attributes of the original's modules changed: {changed_attrs}"
        state = model.state_dict()
        changed = [k for k, v in self.state.items() if not torch.equal(state[k], v)]
        assert not changed, f"original model values changed: {changed[:5]}"


def assert_prepared_contract(model: nn.Module, gm: fx.GraphModule) -> None:
    """The structural promises of prepare_model, independent of the model family."""
    report = fxprep.get_report(gm)
    assert report.tracer == "fx", f"captured with {report.tracer}: {[a.error for a in report.attempts]}"
    assert not report.leaves, f"parts kept opaque although torch.fx traces every torchvision model: {report.leaves}"
    assert report.verification.status == "passed", report.to_text()
    assert report.verification.outputs_compared >= 1

    left = remaining_compute_ops(gm)
    assert not left, f"functional compute ops left in the graph: {[(n.name, n.target) for n in left]}"

    calls = Counter(id(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module")
    twice = [n.target for n in gm.graph.nodes if n.op == "call_module" and calls[id(gm.get_submodule(n.target))] > 1]
    assert not twice, f"modules called more than once: {sorted(set(map(str, twice)))}"

    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            assert gm.get_parameter(name) is tensor, f"parameter {name} is not shared with the original"
        else:
            assert gm.get_buffer(name) is tensor, f"buffer {name} is not shared with the original"

    gm_keys, model_keys = list(gm.state_dict().keys()), list(model.state_dict().keys())
    assert len(gm_keys) == len(set(gm_keys))
    assert set(gm_keys) == set(model_keys), (set(gm_keys) ^ set(model_keys))
    gm.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(gm.state_dict(), strict=True)


def check_model(name: str, training: bool) -> None:
    if name in FX_UNTRACEABLE:
        pytest.skip(f"torch.fx cannot trace {name}: {FX_UNTRACEABLE[name]}")
    model, x = build(name, training)
    before = Snapshot.of(model)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
    before.assert_unchanged(model)
    assert gm.training == model.training
    assert_prepared_contract(model, gm)
    before.assert_unchanged(model)  # the state_dict round trip must not have changed a value either

    # Shared means shared: new weights loaded through the prepared module (aliases of unrolled and
    # converted modules included) are the original's, and both compute the same with them. This
    # comparison is ours, independent of fxprep's verifier.
    # (scaled, not shifted: +0.01 on every weight of a 100-layer network overflows to NaN)
    new_state = {k: v * 0.99 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    gm.load_state_dict(new_state, strict=True)
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in new_state.items()), "weights loaded into gm did not reach the model"
    with torch.no_grad():
        torch.manual_seed(1)
        ref = model(x.clone())
        torch.manual_seed(1)
        got = gm(x.clone())
    assert type(got) is type(ref)
    ref_flat, got_flat = _flat(ref), _flat(got)
    assert len(ref_flat) == len(got_flat)
    for r, g in zip(ref_flat, got_flat):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)

    if not training:  # save -> load -> the same outputs, without pickle (issue: deliver)
        with tempfile.TemporaryDirectory() as tmp:
            fxprep.save(gm, tmp)
            loaded = fxprep.load(tmp, trusted_modules=("torchvision",))
        loaded.eval()
        with torch.no_grad():
            again = loaded(x.clone())
        for r, g in zip(ref_flat, _flat(again)):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    return [value]


@pytest.mark.parametrize("name", SUBSET)
def test_zoo_subset_eval(name: str) -> None:
    check_model(name, training=False)


@pytest.mark.parametrize("name", TRAIN_SUBSET)
def test_zoo_subset_train(name: str) -> None:
    check_model(name, training=True)


@pytest.mark.zoo
@pytest.mark.parametrize("name", zoo_params(ALL_MODELS))
def test_zoo_full_eval(name: str) -> None:
    check_model(name, training=False)


@pytest.mark.zoo
@pytest.mark.parametrize("name", zoo_params(ALL_MODELS))
def test_zoo_full_train(name: str) -> None:
    check_model(name, training=True)


def test_model_lists_name_real_models() -> None:
    """A renamed or removed torchvision model must not silently drop out of the subset or the overrides."""
    names = set(ALL_MODELS)
    for listed in (SUBSET, TRAIN_SUBSET, FX_UNTRACEABLE, INPUT_SIZE, TRAIN_INPUT_SIZE, TV_VIT_KWARGS):
        assert set(listed) <= names, set(listed) - names
    assert len(ALL_MODELS) >= 80


def test_untraceable_list_is_current() -> None:
    """Every model skipped as fx-untraceable must really fail plain ``torch.fx.symbolic_trace``."""
    for name, reason in FX_UNTRACEABLE.items():
        model, _ = build(name)
        with pytest.raises(Exception):  # noqa: B017 - any tracer error counts; the reason is documented above
            fx.symbolic_trace(model)
        assert reason


@pytest.mark.parametrize("name", ["mnasnet0_5", "vit_b_16", "densenet121"])
def test_state_dict_metadata_versions_match(name: str) -> None:
    """``load_state_dict`` hands each module the version recorded in the state_dict's metadata, and
    versioned modules act on it: MNASNet (alpha != 1) reads version 1 as the old checkpoint layout and
    rebuilds its stem; ViT's MLPBlock and DenseNet's blocks (version 2) rename old keys. A prepared
    module's state_dict must carry the versions the original's does, or saving the prepared model and
    loading the checkpoint into the original architecture breaks (or mutates) it. Modules the graph
    no longer contains may be missing from the metadata when their class has the default version 1."""
    model, x = build(name)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
    model_meta = model.state_dict()._metadata  # type: ignore[attr-defined]
    gm_meta = gm.state_dict()._metadata  # type: ignore[attr-defined]
    versions = {k: (v.get("version"), gm_meta.get(k, {}).get("version")) for k, v in model_meta.items()}
    wrong = {k: v for k, v in versions.items() if v[0] != v[1] and v != (1, None)}
    assert not wrong, f"state_dict metadata versions (original, prepared) differ: {dict(list(wrong.items())[:5])}"
    fresh, _ = build(name)
    fresh.load_state_dict(gm.state_dict(), strict=True)  # a checkpoint of the prepared model loads


@pytest.mark.parametrize("name", ["swin_t", "googlenet"])
def test_state_dict_order_matches(name: str) -> None:
    """Order-sensitive consumers (an optimizer state_dict saved for the original, zip(model.parameters(),
    gm.parameters())) need the same order, not just the same keys."""
    model, x = build(name)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
    assert list(gm.state_dict().keys()) == list(model.state_dict().keys())
    assert [id(p) for p in gm.parameters()] == [id(p) for p in model.parameters()]
