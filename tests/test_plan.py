"""The capture plan's decisions (fxprep.pipeline.plan): which attempt or capture follows which, and
why, on real requests and proposals of a small model; prepare_model runs them (tests/test_shape_general.py,
tests/test_guard.py, tests/test_shape_general_vlm.py check the whole path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture import shape_general
from fxprep.capture.common import CaptureResult
from fxprep.capture.request import CaptureRequest
from fxprep.capture.routes import Route
from fxprep.capture.shapes import autodims
from fxprep.core.inputs import normalize_example_inputs
from fxprep.pipeline import plan
from fxprep.pipeline.plan import CaptureKind, Kind
from fxprep.reporting.report import CaptureAttempt

TRACERS = [Route.DYNAMO, Route.FX]


class _Tokens(nn.Module):
    """A ViT's class token expanded to the batch: a static graph bakes the batch in."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1))


@pytest.fixture
def request_() -> CaptureRequest:
    model = _Tokens().eval()
    return CaptureRequest(model, example=normalize_example_inputs(torch.randn(3, 2, 4)))


@pytest.fixture
def proposal(request_: CaptureRequest) -> autodims.Proposal:
    found = autodims.batch_proposal(request_.model, request_.calls()[0])
    assert found is not None
    return found


def _result(tracer: str) -> CaptureResult:
    return CaptureResult(torch.fx.symbolic_trace(nn.Identity()), tracer)


# --- attempts ----------------------------------------------------------------------------------

def test_a_refused_attempt_as_asked_is_followed_by_static_shapes_with_its_reason_and_reference() -> None:
    first = plan.CapturePlan.first()
    reference = object()
    after = plan.after_refused(plan.Outcome(first, False, 1.0, "at a second size: EquivalenceError", "x",
                                            reference=reference))  # type: ignore[arg-type]
    assert after is not None and after.kind is Kind.STATIC
    assert after.with_options({"dynamic": None, "verify": True}) == {"dynamic": False, "verify": True}
    assert after.reference is reference and after.proposal is None
    assert after.note == shape_general.not_kept_note("at a second size: EquivalenceError")
    assert first.note is None and first.with_options({"a": 1}) == {"a": 1}


def test_a_multimodal_batch_that_did_not_hold_is_tried_with_the_length_alone_then_static(
        proposal: autodims.Proposal) -> None:
    narrower = dataclasses.replace(proposal, dropped={("x", 0): "the images"})
    refused = plan.Outcome(plan.CapturePlan.first(), False, 1.0, "Dynamo stopped", "x", narrower=narrower)
    step = plan.after_refused(refused)
    assert step is not None and step.kind is Kind.NARROWER and step.static_fallback
    assert step.proposal is not None and "the batch did not hold: Dynamo stopped" in step.proposal.dropped[("x", 0)]
    assert step.note is None  # its report says nothing before it is kept or not
    static = plan.after_refused(plan.Outcome(step, False, 1.0, "at a second size", "x"))
    assert static is not None and static.kind is Kind.STATIC
    assert static.why == "Dynamo stopped; with the prompt's length alone: at a second size"
    assert plan.after_refused(plan.Outcome(static, False, 1.0, "?", "x")) is None


def test_what_ends_an_attempt_without_ending_prepare_model() -> None:
    assert plan.Step(Kind.STATIC).refusals == ()  # the last resort: its errors are the user's
    assert plan.Step(Kind.ASKED).refusals == (shape_general.NotShapeGeneral,)
    assert plan.Step(Kind.BATCH).refusals == (Exception,) and not plan.Step(Kind.BATCH).static_fallback


def test_a_baked_batch_is_captured_again_with_dimension_0_declared(proposal: autodims.Proposal) -> None:
    asked = plan.CapturePlan.first()
    asked_for: list[int] = []

    def batch() -> autodims.Proposal:
        asked_for.append(1)
        return proposal

    assert plan.after_kept(asked, False, batch, None, {}, None) is None
    assert asked_for == []  # not proposed unless the probe found the batch baked in
    assert plan.after_kept(asked, True, batch, "batch", {}, None) is None  # the user's dynamic= stands
    assert plan.after_kept(plan.Step(Kind.STATIC, "why"), True, batch, None, {}, None) is None
    step = plan.after_kept(asked, True, batch, None, {"block": ["block2"]}, None)
    assert step is not None and step.kind is Kind.BATCH and step.proposal is proposal and step.options == ()
    kept = plan.batch_note(plan.Outcome(step, True, 1.0), ["Shape-general capture ... not kept: x."])
    assert kept == (f"The static-shape capture baked the example's batch into the graph ({proposal.describe()}): "
                    "captured again with it declared dynamic. Before that: Shape-general capture ... not kept: x.")
    refused = plan.batch_note(plan.Outcome(step, False, 1.0, "boom", "RuntimeError: boom"), [])
    assert refused == "Prepared again with dimension 0 of the inputs declared dynamic, not kept: RuntimeError: boom"


def test_block_reuse_is_off_for_the_batch_attempt_where_the_static_capture_stamped_fewer_blocks(
        proposal: autodims.Proposal) -> None:
    step = plan.after_kept(plan.CapturePlan.first(), True, lambda: proposal, None, {"a": [], "b": ["b2"]}, None)
    assert step is not None and step.with_options({"reuse_blocks": True}) == {"reuse_blocks": False}
    assert step.detail == " Block reuse was off for it: the static capture stamped 1 block(s) for 2 captured."
    assert plan.batch_note(plan.Outcome(step, True, 1.0), []).endswith(step.detail)


def test_the_plan_records_each_attempts_seconds_kept_or_not() -> None:
    recorded = plan.CapturePlan()
    recorded.record(plan.Outcome(plan.CapturePlan.first(), False, 2.0, "why", "x"))
    recorded.record(plan.Outcome(plan.Step(Kind.STATIC, "why"), True, 1.5))
    assert recorded.seconds == [2.0, 1.5]


# --- captures inside one attempt -----------------------------------------------------------------

def test_shape_general_first_where_dimensions_are_proposed(request_: CaptureRequest, proposal: autodims.Proposal) -> None:
    assert plan.first_capture(request_, None, TRACERS) == plan.CaptureStep(CaptureKind.STATIC, request_, tuple(TRACERS))
    general = plan.first_capture(request_, proposal, TRACERS)
    assert general.kind is CaptureKind.GENERAL and general.proposal is proposal and general.note is None


def test_a_refused_shape_general_capture_falls_back_to_static_shapes_saying_why(
        request_: CaptureRequest, proposal: autodims.Proposal) -> None:
    general = plan.first_capture(request_, proposal, TRACERS)
    elsewhere = shape_general.Elsewhere(proposal, [CaptureAttempt(Route.DYNAMO, False, 0.1)])
    static = plan.after_general(general, plan.Refusal("Dynamo stopped at .item()", elsewhere), static_fallback=True)
    assert static is not None and static.kind is CaptureKind.STATIC and static.proposal is None
    assert static.request.dynamic is False and static.request.model is request_.model and static.tracers == general.tracers
    assert static.elsewhere is elsewhere and static.note == shape_general.not_kept_note("Dynamo stopped at .item()")
    # without a static fallback (the batch attempt, whose static graph is made already): the attempt is refused
    assert plan.after_general(general, plan.Refusal("x", None), static_fallback=False) is None


def test_the_users_own_dimensions_that_do_not_hold_run_the_tracers_as_asked(
        request_: CaptureRequest, proposal: autodims.Proposal) -> None:
    general = plan.first_capture(request_, dataclasses.replace(proposal, explicit=True), TRACERS)
    asked = plan.after_general(general, plan.Refusal("bounded", None), static_fallback=False)
    assert asked is not None and asked.kind is CaptureKind.AS_ASKED and asked.request is request_
    assert asked.tracers == tuple(TRACERS) and asked.note is None  # the user's dimensions are never silently dropped
    ran = shape_general.Elsewhere(proposal, [CaptureAttempt(Route.DYNAMO, False, 0.1)])
    again = plan.after_general(general, plan.Refusal("stopped", ran), static_fallback=True)
    assert again is not None and again.tracers == (Route.FX,)  # Dynamo not twice


def test_the_static_fallbacks_route_is_tried_with_the_dimensions_only_after_a_failed_static_capture(
        request_: CaptureRequest, proposal: autodims.Proposal) -> None:
    elsewhere = shape_general.Elsewhere(proposal, [])
    general = plan.first_capture(request_, proposal, TRACERS)
    static = plan.after_general(general, plan.Refusal("stopped", elsewhere), static_fallback=True)
    assert static is not None
    assert plan.second(static, _result(Route.FX)) is None  # the static tracers captured it: no second capture
    second = plan.second(static, None)
    assert second is not None and second.kind is CaptureKind.SECOND and second.proposal is proposal
    assert second.request.dynamic is None and second.why == "stopped" and second.note is None
    assert plan.second(dataclasses.replace(static, elsewhere=None), None) is None
    assert plan.second_not_tried(None) == shape_general.NOT_TRIED
    assert plan.second_not_tried(_result(Route.FX)) == shape_general.NOT_TRIED
    assert plan.second_not_tried(_result(Route.DYNAMO_LEAVES)) is None
    assert plan.second_not_tried(_result(Route.DYNAMO_VALUES)) is None


def test_after_the_control_flow_rewrite_only_a_whole_dynamo_graph_is_captured_again(
        request_: CaptureRequest) -> None:
    step = plan.first_capture(request_, None, TRACERS)
    assert plan.not_after_rewrite(plan.Captured(step, _result(Route.DYNAMO), [])) is None
    why = plan.not_after_rewrite(plan.Captured(step, _result(Route.DYNAMO_LEAVES), []))
    assert why is not None and "(dynamo+leaves)" in why
    assert "(no capture)" in (plan.not_after_rewrite(plan.Captured(step, None, [])) or "")
    assert plan.static_instead(step, why, static_fallback=False) is None
    assert plan.static_instead(step, why, static_fallback=True) == dataclasses.replace(step, why=why)


def test_prepare_model_runs_the_plan_a_baked_batch_then_dimension_0() -> None:
    torch.manual_seed(0)
    model = _Tokens().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 2, 4), tracer="dynamo", progress=False)
    report = fxprep.get_report(gm)
    assert any(n.startswith("The static-shape capture baked the example's batch") for n in report.notes)
    assert "attempts not kept" in report.timings
    x = torch.randn(5, 2, 4)
    torch.testing.assert_close(gm(x), model(x))
