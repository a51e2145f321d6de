"""Hybrid capture: only the untraceable parts become opaque, everything else stays module-level."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import fxprep
from fxprep.capture.leaves import OpaqueFunction, OpaqueMethod

from .helpers import assert_unchanged, module_snapshot
from .helpers_io import WithMethods


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Linear(8, 8)
        self.neg = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.pos(x)
        return self.neg(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.gate = Gate()
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.gate(torch.relu(self.stem(x))) + 1)


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_only_the_branching_submodule_is_opaque(tracer):
    model = Net().eval()
    before = module_snapshot(model)
    positive = torch.rand(2, 8) + 1  # every branch input is > 0 after relu(stem(x)) for most seeds
    gm = fxprep.prepare_model(model, example_inputs=positive, tracer=tracer)
    report = gm.fxprep_report
    assert list(report.leaves) == ["gate"]
    assert "data-dependent branch" in report.leaves["gate"]
    assert report.tracer == ("fx+leaves" if tracer == "fx" else "dynamo+leaves")
    assert gm.gate is model.gate  # the opaque part is the user's module, called eagerly
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets[0] == "stem" and "head.1" in targets and "relu" in targets  # the rest is prepared
    assert_unchanged(model, before)
    # right on inputs taking either branch
    with torch.no_grad():
        model.stem.weight.zero_()
        model.stem.bias.fill_(1.0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), model(x))
    with torch.no_grad():
        model.stem.bias.fill_(-1.0)  # relu → 0, sum == 0 → the else branch
        model.gate.neg.bias.fill_(0.5)
    torch.testing.assert_close(gm(x), model(x))


def test_fallback_error_raises_with_the_issue():
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(Net(), example_inputs=torch.randn(2, 8), tracer="fx", fallback="error")
    assert info.value.issues[0].module == "gate"


def test_verify_inputs_cover_the_other_branch():
    model = Net().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8), verify_inputs=[torch.randn(2, 8) * 5, -torch.ones(1, 8)])
    assert len(gm.fxprep_report.extra_verifications) == 2
    assert all(v.status == "passed" for v in gm.fxprep_report.extra_verifications)
    assert "verify_inputs[1]" in str(gm.fxprep_report)


def test_check_traceability_reports_tracers_issues_and_opaque_parts():
    report = fxprep.check_traceability(Net(), example_inputs=torch.randn(2, 8))
    assert not report.traceable and report.hybrid_ok
    assert list(report.opaque) == ["gate"]
    assert {a.tracer for a in report.attempts} >= {"fx", "dynamo+leaves"}  # prepare_model's order
    assert any(i.category == "data-dependent branch" and i.module == "gate" for i in report.issues)
    text, md = report.to_text(), report.to_markdown()
    assert "would become opaque" in text and "gate" in text
    assert "| `gate` | data-dependent branch |" in md
    assert fxprep.check_traceability(torchvision.models.resnet18(), example_inputs=torch.randn(1, 3, 32, 32)).traceable


class RowLoop(nn.Module):
    """A root only Dynamo can trace (a Python loop over the batch), around a part only eager can run."""

    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        rows = [self.gate(x[i : i + 1]) for i in range(x.shape[0])]
        return self.out(torch.cat(rows))


def test_check_traceability_names_the_parts_prepare_model_makes_opaque():
    """Before: check ran fx with opaque parts, which cannot trace the loop at the root, and said
    "not traceable, even with opaque parts" for a model prepare_model prepares with one opaque part."""
    model, x = RowLoop().eval(), torch.randn(3, 8)
    report = fxprep.check_traceability(model, example_inputs=x)
    assert not report.traceable and report.hybrid_ok
    gm = fxprep.prepare_model(model, example_inputs=x, progress=False)
    assert gm.fxprep_report.tracer == "dynamo+leaves"
    assert list(report.opaque) == list(gm.fxprep_report.leaves) == ["gate"]


def test_root_forward_untraceable_fails_with_issue():
    class RootBranch(nn.Module):
        def forward(self, x):
            if x.mean() > 0:
                return x
            return x * 2

    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(RootBranch(), example_inputs=torch.randn(3))
    assert "if x.mean() > 0:" in str(info.value)


def test_methods_helpers_and_functions_become_opaque_calls():
    model = WithMethods().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4))
    leaves = gm.fxprep_report.leaves
    assert set(leaves) == {"post", "helper.clip", "_topk_like"}
    assert isinstance(gm.get_submodule("post"), OpaqueMethod)
    assert isinstance(gm.get_submodule("helper_clip"), OpaqueMethod)
    assert isinstance(gm.get_submodule("_topk_like"), OpaqueFunction)
    assert gm.a is model.a and gm.b is model.b  # the layers around them stay module-level
    for x in (torch.randn(3, 4), torch.randn(5, 4) * 3):
        torch.testing.assert_close(gm(x), model(x))


DETECTION = ["ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn"]
DETECTION_ZOO = ["retinanet_resnet50_fpn", "fcos_resnet50_fpn", "ssd300_vgg16", "fasterrcnn_resnet50_fpn",
                 "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"]
THRESHOLD = {"ssdlite320_mobilenet_v3_large": {"score_thresh": 0.0}, "ssd300_vgg16": {"score_thresh": 0.0},
             "retinanet_resnet50_fpn": {"score_thresh": 0.0}, "fcos_resnet50_fpn": {"score_thresh": 0.0}}


def _check_detection(name: str) -> None:
    kwargs = THRESHOLD.get(name, {"box_score_thresh": 0.0})
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kwargs).eval()
    before = module_snapshot(model)
    image = torch.rand(3, 96, 96)
    gm = fxprep.prepare_model(model, example_inputs=([image],))
    report = gm.fxprep_report
    assert report.verification.status == "passed"
    out = gm([torch.rand(3, 96, 96)])
    assert isinstance(out, list) and {"boxes", "scores", "labels"} <= set(out[0])
    assert out[0]["boxes"].shape[0] > 0  # thresholds at 0: real detections are compared
    assert report.tracer == "dynamo+leaves" and report.leaves
    for reason in report.leaves.values():
        assert "opaque:" in reason and ".py:" in reason
    # Every conv and Linear outside the opaque parts is a call_module of the user's own layer; the
    # opaque parts are post-processing only (never a head, the backbone or box_predictor, whose
    # `if x.dim() == 4` Dynamo specialises).
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for leaf in report.leaves:
        assert not any(name.startswith(f"{leaf}.") for name in layers), leaf
    for name in layers:
        assert name in called and gm.get_submodule(name) is model.get_submodule(name), name
    if hasattr(model, "roi_heads"):
        assert {"roi_heads.box_predictor.cls_score", "roi_heads.box_predictor.bbox_pred"} <= called
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", DETECTION)
def test_detection_models_prepare_with_opaque_postprocessing(name):
    _check_detection(name)


@pytest.mark.zoo
@pytest.mark.parametrize("name", DETECTION_ZOO)
def test_detection_zoo(name):
    _check_detection(name)
