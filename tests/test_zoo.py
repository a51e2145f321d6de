"""The Dynamo path on real models: torchvision, one model per timm family, transformers architectures.

Every model is prepared with ``tracer="dynamo"`` (no fx fallback hides a Dynamo failure) and must
give a module that (1) verified against the original, (2) has no tensor compute left outside
modules, (3) calls every module object once, (4) holds the user's own Parameter objects under their
original names, (5) has the original's state_dict keys and (6) returns the original's output type
(``ModelOutput`` subclasses for transformers).

The default run (no marker) checks a handful; ``pytest -m zoo`` runs the lot. Models Dynamo or
fxprep cannot take are listed in ``KNOWN_FAILURES`` with the reason: they are expected to fail with
a clear :class:`fxprep.FxprepError`, never with a crash or a wrong graph, and the test says so if
one starts passing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo import unreferenced_parameters
from fxprep.core.inputs import normalize_example_inputs
from fxprep.families.transformers.model import capture_concrete_args
from fxprep.passes.functional_to_module import remaining_compute_ops

from .helpers import zoo_params
from .zoo_models import (
    HF_ARCHS,
    TIMM_FAMILIES,
    TV_CLASSIFICATION,
    TV_DETECTION,
    TV_FLOW,
    TV_SEGMENTATION,
    TV_VIDEO,
    build_hf,
    build_timm,
    build_torchvision,
)

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# Never let the hybrid/leaf fallback (another issue) turn a capture failure into a partial success.
_NO_FALLBACK = {"fallback": "error"}


# Parameters the original forward itself does not use on these inputs (eval-mode auxiliary heads,
# mask tokens without a mask, ESM's contact head without return_contacts).
UNUSED_IN_EVAL = ("aux1.", "aux2.", "AuxLogits.", "mask_token", "masked_spec_embed", "contact_head.")


def prepare(model: nn.Module, example: Any, **options: Any) -> torch.fx.GraphModule:
    return fxprep.prepare_model(model, example_inputs=example, tracer="dynamo", **_NO_FALLBACK, **options)


def call(module: nn.Module, example: Any) -> Any:
    with torch.no_grad():
        if isinstance(example, dict):
            return module(**example)
        if isinstance(example, tuple):
            return module(*example)
        return module(example)


# Models whose prepared graph save() refuses, with the text its SerializationError must contain.
# (none now: wav2vec2's and HuBERT's weight_norm convolution is saved since issue 63, tests/test_io_parametrize.py)
SAVE_UNSUPPORTED: dict[str, str] = {}


def assert_prepared(model: nn.Module, gm: torch.fx.GraphModule, example: Any, save_error: str | None = None) -> None:
    """The contract every prepared zoo model must meet."""
    report = gm.fxprep_report
    assert report.tracer == "dynamo", report.attempts
    assert report.verification.status == "passed", report.verification
    left = remaining_compute_ops(gm)
    assert not left, [(n.name, n.target) for n in left]
    seen: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            assert id(module) not in seen, f"{node.target} and {seen[id(module)]} call the same module object"
            seen[id(module)] = str(node.target)
    for name, param in model.named_parameters():
        assert gm.get_parameter(name) is param, f"parameter {name} is not the user's object"
    assert set(gm.state_dict()) == set(model.state_dict())
    # No parameter silently became a constant (timm's attention-bias caches are the classic case).
    unused = [n for n in unreferenced_parameters(gm, model) if not any(a in n for a in UNUSED_IN_EVAL)]
    assert not unused, f"parameters the prepared graph never reads: {unused}"
    fixed = capture_concrete_args(model, None, normalize_example_inputs(example)) or {}
    out_model = call(model, {**example, **fixed}) if fixed else call(model, example)  # use_cache=False (HF)
    out_gm = call(gm, example)
    assert type(out_gm) is type(out_model)
    if hasattr(out_model, "keys") and not isinstance(out_model, torch.Tensor):
        assert list(out_gm.keys()) == list(out_model.keys())
    # save -> load -> the same outputs (no pickle; the model libraries are trusted explicitly)
    import tempfile

    from fxprep.verify.compare import flatten_output

    with tempfile.TemporaryDirectory() as tmp:
        if save_error is not None:  # a known limitation of save(): it must say so clearly, not crash
            with pytest.raises(fxprep.SerializationError, match=save_error):
                fxprep.save(gm, tmp)
            return
        fxprep.save(gm, tmp)
        loaded = fxprep.load(tmp, trusted_modules=("torchvision", "timm", "transformers"))
    out_loaded = call(loaded.eval(), example)
    got, want = flatten_output(out_loaded), flatten_output(out_gm)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, a), (_, b) in zip(got, want):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def run_zoo_case(build: Any, name: str, known: dict[str, str]) -> None:
    model, example = build(name)
    if name in known:
        try:
            gm = prepare(model, example)
        except fxprep.FxprepError:
            pytest.xfail(known[name])
        pytest.fail(f"{name} is listed as failing ({known[name]}) but now prepares: remove it from the list")
    gm = prepare(model, example)
    assert_prepared(model, gm, example, SAVE_UNSUPPORTED.get(name))


# --------------------------------------------------------------------------------------------------
# torchvision
# --------------------------------------------------------------------------------------------------
TV_KNOWN_FAILURES: dict[str, str] = {}


@pytest.mark.zoo
@pytest.mark.parametrize("name", zoo_params(TV_CLASSIFICATION + TV_SEGMENTATION + TV_VIDEO + TV_FLOW))
def test_torchvision_zoo(name: str) -> None:
    run_zoo_case(build_torchvision, name, TV_KNOWN_FAILURES)


@pytest.mark.zoo
@pytest.mark.parametrize("name", TV_DETECTION)
def test_torchvision_detection_fails_clearly(name: str) -> None:
    model, example = build_torchvision(name)
    with pytest.raises(fxprep.FxprepError) as info:
        prepare(model, example)
    assert "dynamo" in str(info.value)


# --------------------------------------------------------------------------------------------------
# timm: one model per family, the smallest variant, at a small input where the family allows it
# --------------------------------------------------------------------------------------------------
TIMM_KNOWN_FAILURES: dict[str, str] = {}


@pytest.mark.zoo
@pytest.mark.parametrize("family", sorted(TIMM_FAMILIES))
def test_timm_zoo(family: str) -> None:
    run_zoo_case(build_timm, family, TIMM_KNOWN_FAILURES)


# --------------------------------------------------------------------------------------------------
# transformers: tiny configs, random weights, inputs from fxprep.families.transformers.model
# --------------------------------------------------------------------------------------------------
HF_KNOWN_FAILURES: dict[str, str] = {}


@pytest.mark.zoo
@pytest.mark.parametrize("model_type", sorted(HF_ARCHS))
def test_transformers_zoo(model_type: str) -> None:
    run_zoo_case(build_hf, model_type, HF_KNOWN_FAILURES)


# --------------------------------------------------------------------------------------------------
# Default run: a representative handful (each family once, fast)
# --------------------------------------------------------------------------------------------------
@pytest.mark.smoke
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_subset(name: str) -> None:
    run_zoo_case(build_torchvision, name, TV_KNOWN_FAILURES)


@pytest.mark.smoke
@pytest.mark.parametrize("family", ["vision_transformer", "convnext"])
def test_timm_subset(family: str) -> None:
    run_zoo_case(build_timm, family, TIMM_KNOWN_FAILURES)


@pytest.mark.smoke
@pytest.mark.parametrize("model_type", ["bert", "llama", "t5"])
def test_transformers_subset(model_type: str) -> None:
    run_zoo_case(build_hf, model_type, HF_KNOWN_FAILURES)


# --------------------------------------------------------------------------------------------------
# Both re-lifting routes call the same modules in the same order, and so does fx where it works
# --------------------------------------------------------------------------------------------------
def _call_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


def assert_routes_agree(model: nn.Module, example: Any) -> None:
    from fxprep.capture import dynamo
    from fxprep.capture.common import LeafPolicy
    from fxprep.capture.dynamo.names import default_leaf
    from fxprep.capture.fx import capture_fx
    from fxprep.capture.request import CaptureRequest

    ex = normalize_example_inputs(example)
    concrete = capture_concrete_args(model, None, ex)
    got = {}
    for route in ("flag", "regroup") if dynamo.flag_available() else ("regroup",):
        result, attempt = dynamo.capture_dynamo(CaptureRequest(model, LeafPolicy(), ex, concrete, reuse=True), route=route)
        assert result is not None, f"{route}: {attempt.error}"
        got[route] = _call_targets(result.gm)
    assert len({tuple(t) for t in got.values()}) == 1, got
    # Subclasses keeping a torch.nn layer's forward (Conv3DSimple(nn.Conv3d)) are leaves on the Dynamo
    # path; give fx the same rule so the comparison is about capture, not about the leaf rule.
    inherited = tuple({type(m) for m in model.modules() if m is not model and default_leaf(m)
                       and not type(m).__module__.startswith("torch.")})
    fx_result, _ = capture_fx(model, LeafPolicy(classes=inherited), concrete)
    if fx_result is not None:
        assert _call_targets(fx_result.gm) == next(iter(got.values()))


# The smallest model of every torchvision family, plus segmentation and the small video models.
TV_ROUTES = [
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
    "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf",
    "regnet_y_400mf", "resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t",
    "swin_v2_t", "vgg11_bn", "vit_b_16", "wide_resnet50_2", *TV_SEGMENTATION,
    "r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v2_s", "swin3d_t",
]


@pytest.mark.zoo
@pytest.mark.parametrize("name", TV_ROUTES)
def test_routes_agree_torchvision(name: str) -> None:
    assert_routes_agree(*build_torchvision(name))


@pytest.mark.zoo
@pytest.mark.parametrize("family", ["resnet", "vision_transformer", "convnext", "efficientnet", "swin_transformer", "levit"])
def test_routes_agree_timm(family: str) -> None:
    assert_routes_agree(*build_timm(family))


@pytest.mark.zoo
@pytest.mark.parametrize("model_type", ["bert", "gpt2", "llama", "t5", "vit", "whisper"])
def test_routes_agree_transformers(model_type: str) -> None:
    assert_routes_agree(*build_hf(model_type))
