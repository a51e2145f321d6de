"""The prepared module checks each call against the inputs it was captured for (issue 10).

Before: a model taking a list of tensors, prepared on 3 and called with 4, returned the sum of the
first 3 without error (fx's ``tree_flatten_spec`` takes the first 3 items); Faster R-CNN prepared on
one image and called with two returned one detection dict; a Dynamo graph captured at batch 3
through ``if x.shape[0] > 2`` silently took the same branch at batch 2.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fxprep

torch.set_num_threads(1)


class ListSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, xs: list[torch.Tensor], bias: torch.Tensor | None = None, extra: dict | None = None):
        out = sum(self.lin(x) for x in xs)
        if bias is not None:
            out = out + bias
        if extra is not None:
            out = out * extra["scale"]
        return out


def _xs(n: int, batch: int = 2) -> list[torch.Tensor]:
    return [torch.randn(batch, 4) for _ in range(n)]


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_list_longer_than_at_capture_is_refused(tracer: str) -> None:
    model = ListSum().eval()
    gm = fxprep.prepare_model(model, example_inputs={"xs": _xs(3)}, tracer=tracer, progress=False)
    assert gm.fxprep_report.tracer.split("+")[0] == tracer
    xs = _xs(3)
    torch.testing.assert_close(gm(xs), model(xs))  # the captured structure still works
    with pytest.raises(fxprep.InputMismatch, match=r"xs: a list of 3 item\(s\) at capture, got 4"):
        gm(_xs(4))
    with pytest.raises(fxprep.InputMismatch, match=r"got 2"):
        gm(_xs(2))
    with pytest.raises(fxprep.InputMismatch, match=r"xs: a list of 3 at capture, got a tensor"):
        gm(torch.randn(2, 4))


def test_none_at_capture_given_a_tensor_is_refused() -> None:
    """fx: ``bias`` None in the example is None in the graph; a tensor would be ignored."""
    gm = fxprep.prepare_model(ListSum().eval(), example_inputs={"xs": _xs(2)}, tracer="fx", progress=False)
    with pytest.raises(fxprep.InputMismatch, match="bias: None at capture .* got a tensor of shape 2x4"):
        gm(_xs(2), bias=torch.randn(2, 4))


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_dict_keys_and_tensor_given_where_none_was_captured(tracer: str) -> None:
    model = ListSum().eval()
    example = {"xs": _xs(2), "bias": torch.randn(2, 4), "extra": {"scale": torch.randn(2, 4)}}
    gm = fxprep.prepare_model(model, example_inputs=example, tracer=tracer, progress=False)
    with pytest.raises(fxprep.InputMismatch, match=r"extra: dict keys differ from capture; missing \['scale'\]; "
                                                   r"not captured \['factor'\]"):
        gm(_xs(2), bias=torch.randn(2, 4), extra={"factor": torch.randn(2, 4)})
    with pytest.raises(fxprep.InputMismatch, match="bias: a tensor at capture, got None|bias"):
        gm(_xs(2), bias=None, extra={"scale": torch.randn(2, 4)})


class ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:  # a shape-dependent branch: Dynamo bakes in the example's side
            return self.a(x)
        return self.b(x)


def test_dynamo_specialised_shape_is_checked() -> None:
    model = ShapeBranch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxprep.InputMismatch, match=r"x: shape 3x4 at capture \(Dynamo specialised it\), got 2x4") as info:
        gm(torch.randn(2, 4))  # would have run self.a where the model runs self.b
    assert "dynamic=" in str(info.value)
    assert "InputMismatch" in fxprep.get_report(gm).to_text()


def test_dynamic_dimension_is_not_checked() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4), tracer="dynamo", dynamic="batch", progress=False)
    x = torch.randn(5, 4)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxprep.InputMismatch, match=r"shape \*x4 at capture"):
        gm(torch.randn(5, 3))


def test_guard_survives_deepcopy_and_pickle_and_stays_out_of_tracing() -> None:
    model = ListSum().eval()
    gm = fxprep.prepare_model(model, example_inputs={"xs": _xs(3)}, tracer="fx", progress=False)
    for copied in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        with pytest.raises(fxprep.InputMismatch):
            copied(_xs(4))
        xs = _xs(3)
        torch.testing.assert_close(copied(xs), model(xs))
    program = fxprep.export_program(gm, {"xs": _xs(3)})  # export traces through the check unharmed
    xs = _xs(3)
    torch.testing.assert_close(program.module()(xs, None, None), model(xs))


def test_faster_rcnn_prepared_on_one_image_refuses_two() -> None:
    """Before: it returned one detection dict for two images."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None).eval()
    image = torch.rand(3, 160, 160)
    gm = fxprep.prepare_model(model, example_inputs=([image],), progress=False, verify=False)
    assert len(gm([image])) == 1
    with pytest.raises(fxprep.InputMismatch, match=r"a list of 1 item\(s\) at capture, got 2"):
        gm([image, torch.rand(3, 160, 160)])


def test_batch_dimension_probed_and_left_free_when_the_graph_agrees() -> None:
    """Prepared at batch 1 and calibrated at batch 4 (the README's hand-off): the probe at batch 2
    matched the original, so dimension 0 is not checked; the feature dimension still is."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 4), tracer="dynamo", progress=False)
    x = torch.randn(4, 4)
    torch.testing.assert_close(gm(x), model(x))
    assert "matched the original at batch 2" in gm.fxprep_report.to_text()
    with pytest.raises(fxprep.InputMismatch, match=r"shape \*x4 at capture"):
        gm(torch.randn(4, 5))


def test_batch_specialised_graph_is_named_in_the_report() -> None:
    gm = fxprep.prepare_model(ShapeBranch().eval(), example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False)
    text = gm.fxprep_report.to_text()
    assert "specialised to batch 3: at batch 2" in text
    # the branch itself, from Dynamo's guards: its source line and the side the graph took
    assert "if x.shape[0] > 2:" in text and "batch > 2 only" in text


class FarBranch(nn.Module):
    """A branch on the batch size that batch +- 1 of the example does not reach."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > 7:
            return self.lin(x) * 3
        return self.lin(x)


def test_branch_the_probe_misses_is_found_from_dynamos_guards() -> None:
    """Before: batch 2 +- 1 agreed, so dimension 0 was freed and a call at batch 8 silently took the
    batch-2 side (outputs 3x too small). Dynamo's guards with a symbolic batch name the branch."""
    model = FarBranch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4), tracer="dynamo", progress=False)
    text = gm.fxprep_report.to_text()
    assert "if len(x) > 7:" in text and "batch <= 7 only" in text
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxprep.InputMismatch, match="shape 2x4 at capture"):
        gm(torch.randn(8, 4))


def test_no_batch_branch_frees_the_batch_with_the_guards_as_evidence() -> None:
    gm = fxprep.prepare_model(FarBranch().eval(), example_inputs=torch.randn(9, 4)[:1], tracer="dynamo", progress=False)
    # traced at batch 2 (Dynamo never makes a size of 1 symbolic): the branch is still found
    assert "batch <= 7 only" in gm.fxprep_report.to_text()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4), tracer="dynamo", progress=False)
    assert "Dynamo's guards, traced with a symbolic batch, show no branch on it" in gm.fxprep_report.to_text()
    x = torch.randn(32, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_verify_input_the_graph_refuses_is_a_verification_failure() -> None:
    with pytest.raises(fxprep.EquivalenceError, match=r"verify_inputs\[0\]: the prepared module refuses it"):
        fxprep.prepare_model(ShapeBranch().eval(), example_inputs=torch.randn(3, 4), tracer="dynamo",
                             verify_inputs=[torch.randn(2, 4)], progress=False)


def test_guard_survives_save_and_load_as_data(tmp_path) -> None:
    import json

    model = ListSum().eval()
    gm = fxprep.prepare_model(model, example_inputs={"xs": _xs(3)}, tracer="fx", progress=False)
    fxprep.save(gm, tmp_path / "saved", example_inputs={"xs": _xs(3)})
    loaded = fxprep.load(tmp_path / "saved")
    xs = _xs(3)
    torch.testing.assert_close(loaded(xs), model(xs))
    with pytest.raises(fxprep.InputMismatch, match=r"a list of 3 item\(s\) at capture, got 4"):
        loaded(_xs(4))
    manifest = tmp_path / "saved" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["input_guard"] = {"params": {"xs": {"kind": "exec", "code": "import os"}}, "tracer": "fx"}
    manifest.write_text(json.dumps(data))
    with pytest.raises(fxprep.SerializationError, match="input_guard .* malformed"):
        fxprep.load(tmp_path / "saved")
    for kind in ([], {}, 3):  # found by the tamper fuzzer: an unhashable kind was a TypeError
        data["input_guard"] = {"params": {"xs": {"kind": kind}}, "tracer": "fx"}
        manifest.write_text(json.dumps(data))
        with pytest.raises(fxprep.SerializationError, match="input_guard .* malformed"):
            fxprep.load(tmp_path / "saved")


def test_branches_are_not_listed_on_meta_and_the_report_says_why() -> None:
    """On meta (LLM-size models prepared without weights) the second, whole-model Dynamo trace is
    not paid; the report says the probe's evidence is all there is."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4, device="meta"), tracer="dynamo", progress=False)
    assert "the inputs are on meta" in gm.fxprep_report.to_text()


class BakedBatch(nn.Module):
    """``reshape(x.shape[0], ...)``: Dynamo bakes the example's batch in, so at another batch the
    prepared graph raises where the original runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(x.shape[0], 2, 2)


def test_the_batch_probe_prints_no_fx_traceback(capsys) -> None:
    """The probe's failing run at another batch is a finding for the report; fx's own print of the
    error (a traceback and the generated code) is not shown in the middle of a successful prepare."""
    gm = fxprep.prepare_model(BakedBatch().eval(), example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False,
                              dynamic=False)  # static shapes asked for: the graph found baked in is kept
    assert "specialised to batch 3" in gm.fxprep_report.to_text()
    err = capsys.readouterr().err
    assert "FX-traced" not in err and "Traceback" not in err
    with pytest.raises(fxprep.InputMismatch):
        gm(torch.randn(2, 4))


def test_a_batch_baked_in_without_a_branch_is_captured_again_declared() -> None:
    """The probe found the example's batch baked into the static graph (``reshape(x.shape[0], ...)``)
    and no branch on it: prepared again with dimension 0 declared dynamic, verified at a second
    batch, and kept. Before, every other batch size raised InputMismatch."""
    model = BakedBatch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 4), tracer="dynamo", progress=False)
    for batch in (2, 5, 1):
        x = torch.randn(batch, 4)
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    text = gm.fxprep_report.to_text()
    assert "captured again with it declared dynamic" in text and "x dim 0 (batch)" in text
    with pytest.raises(fxprep.InputMismatch):  # other dimensions stay checked
        gm(torch.randn(2, 5))


class ConvBakedBatch(nn.Module):
    """A batch baked in (``reshape(x.shape[0], ...)``) after a convolution, whose backend choice in
    torch's fake kernel reads the batch size: captured with the batch declared, Dynamo bounded it to
    <= 15, a bound of its trace, not of the model (now the choice leaves no guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).reshape(x.shape[0], -1)


def test_a_kernel_choice_bounds_no_batch_of_the_batch_retry() -> None:
    """The batch retry's graph takes every batch (the probe found no branch on it). The convolution's
    kernel choice bounded the batch to <= 15 (said in the report as a bound of the trace); it now
    leaves no guard, so there is no bound to say."""
    model = ConvBakedBatch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 8, 8), tracer="dynamo", progress=False)
    for batch in (2, 16, 40):
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x))
    text = gm.fxprep_report.to_text()
    assert "Dynamo bounded 'batch'" not in text and "the model's code requires" not in text
    assert "found from dimension 0 of the inputs, after the static capture" in text  # not "input names"


class _ScaledBlock(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale  # read in forward: Dynamo guards on it, so unequal scales share no graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _Stack(nn.Module):
    def __init__(self, scales: list[float]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledBlock(s) for s in scales])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.reshape(x.shape[0], 2, 2)  # the batch baked into a static graph


@pytest.mark.parametrize(("scales", "reused"), [([1.0, 1.0, 1.0, 1.0], True), ([1.0, 1.1, 1.2, 1.3], False)])
def test_the_batch_retry_keeps_block_reuse_only_where_it_paid(scales: list[float], reused: bool) -> None:
    """Where the static capture stamped fewer blocks than it captured (Swin: each block's drop_prob
    differs), the retry under dynamic shapes captures the whole model instead: there each block's
    own capture costs more (Swin-Tiny's retry took 15.1 s with reuse, 2.9 s without)."""
    torch.manual_seed(0)
    model = _Stack(scales).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 4), tracer="dynamo", progress=False)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    report = gm.fxprep_report
    assert "captured again with it declared dynamic" in report.to_text()
    assert bool(report.reuse.get("captured")) is reused
    assert ("Block reuse was off for it: the static capture stamped 0 block(s) for 4 captured" in report.to_text()) is not reused


def test_a_real_branch_on_the_batch_is_not_captured_again() -> None:
    gm = fxprep.prepare_model(ShapeBranch().eval(), example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False)
    assert "captured again" not in gm.fxprep_report.to_text()
    with pytest.raises(fxprep.InputMismatch):
        gm(torch.randn(2, 4))


def test_when_the_batch_general_capture_fails_the_static_graph_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxprep.capture import shape_general

    def fails(*args, **kwargs):
        raise shape_general.NotShapeGeneral("Dynamo refused the batch dimension (simulated)")

    monkeypatch.setattr(shape_general, "capture", fails)
    model = BakedBatch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False)
    text = gm.fxprep_report.to_text()
    assert "specialised to batch 3" in text and "not kept" in text and "simulated" in text
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxprep.InputMismatch):
        gm(torch.randn(2, 4))


def test_a_timm_vit_prepared_at_batch_one_runs_at_batch_four() -> None:
    """timm's ViT expands its class token to the batch: the static graph bakes batch 1 in; the
    prepared module now serves calibration batches of any size."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32), progress=False)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    assert gm.fxprep_report.verification.status == "passed"


def test_quiet_fx_errors_drops_only_fx_error_prints(capsys) -> None:
    import sys
    import threading

    from fxprep.core.runs import quiet_fx_errors

    with quiet_fx_errors():
        print("Traceback (most recent call last):\nCall using an FX-traced Module, line 3 of ...", file=sys.stderr)
        print("a warning of the user's own", file=sys.stderr)
        other = threading.Thread(target=lambda: print("Call using an FX-traced Module (another thread)", file=sys.stderr))
        other.start()
        other.join()
    print("after", file=sys.stderr)
    err = capsys.readouterr().err
    assert err.splitlines() == ["a warning of the user's own", "Call using an FX-traced Module (another thread)", "after"]


# --- issue 28: values baked into the graph --------------------------------------------------------------
BAKED_OFFSET = 2.0  # a module-level global read in forward: both tracers bake it


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(0.1)  # a leaf: called whole, its own attributes followed at each call
        self.scale = 2.0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # state the forward writes: the original's own runs change it, not a setting
        return self.act(self.fc(x)) * self.scale + BAKED_OFFSET


@pytest.mark.parametrize("tracer", ["dynamo", "fx"])
def test_a_changed_attribute_or_global_is_refused_not_silently_ignored(tracer: str) -> None:
    """Before, ``model.scale = 5.0`` after prepare_model left the prepared module computing with 2.0
    (both tracers), and the report said nothing."""
    global BAKED_OFFSET
    model = _Scaled().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x, tracer=tracer, progress=False)
    assert any("model.scale" in n for n in fxprep.get_report(gm).notes)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    model.scale = 5.0
    with pytest.raises(fxprep.InputMismatch, match=r"model\.scale: 2\.0 at capture, now 5\.0"):
        gm(x)
    model.scale = 2.0
    BAKED_OFFSET = 7.0
    try:
        with pytest.raises(fxprep.InputMismatch, match=r"global tests\.test_guard\.BAKED_OFFSET: 2\.0 at capture, now 7\.0"):
            gm(x)
    finally:
        BAKED_OFFSET = 2.0
    # what the graph does not hold is not checked: a leaf's own setting, a counter the forward writes
    model.act.negative_slope = 0.3
    model(x)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    assert copy.deepcopy(gm)(x) is not None  # a copy shares nothing with the model: it checks nothing
