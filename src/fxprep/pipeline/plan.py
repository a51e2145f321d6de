"""The capture strategy of ``prepare_model`` as one object: what is tried, in which order, why, and
what came of it.

Two levels, each a small frozen step that a plain function of the previous outcome decides
(:mod:`fxprep.api` runs them): an **attempt** (:class:`Step`: as asked, the prompt length alone,
static shapes, dimension 0 declared) runs the stages again from capture to verification, and
:class:`CapturePlan` records each one's :class:`Outcome`; inside one attempt, a **capture**
(:class:`CaptureStep`: shape-general, the static fallback, the fallback's route with the dimensions
declared). The report's story of what was not kept comes from here. See docs/architecture.md,
"The capture plan".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from ..capture import shape_general
from ..capture.common import CaptureResult
from ..capture.request import CaptureRequest
from ..capture.routes import Route
from ..capture.shapes import autodims
from ..reporting.report import CaptureAttempt
from ..verify import Reference


class Kind(str, Enum):
    """What an attempt (:class:`Step`) is: each runs the stages of ``prepare_model`` once."""

    ASKED = "as asked"  # shape-general where the dimensions are proposed, else static
    NARROWER = "the prompt's length alone"  # a multimodal example whose batch did not hold
    STATIC = "static shapes"  # the proposed dimensions did not hold
    BATCH = "dimension 0 declared"  # the static graph baked the example's batch in


@dataclass(frozen=True)
class Step:
    """One attempt: ``why`` it is made (the reason the one before was not kept, or what the batch
    probe found), the dimensions it captures with (None: proposed by the stage for :attr:`Kind.ASKED`,
    none for :attr:`Kind.STATIC`), the options it changes, the original's run on the example an
    earlier attempt made (reused: it is the same run), and ``detail``: what else differs, said in
    the report."""

    kind: Kind
    why: str = ""
    proposal: autodims.Proposal | None = None
    options: tuple[tuple[str, Any], ...] = ()
    reference: Reference | None = None
    detail: str = ""

    @property
    def static_fallback(self) -> bool:
        """Whether a shape-general capture that fails falls back to static shapes inside this attempt;
        not for :attr:`Kind.BATCH`, whose static graph is already made: the attempt is refused."""
        return self.kind is not Kind.BATCH

    @property
    def refusals(self) -> tuple[type[BaseException], ...]:
        """The failures that end this attempt with another to try, or the graph before kept: the
        dimensions not holding; for :attr:`Kind.BATCH` any error (the static graph stands); none
        for :attr:`Kind.STATIC`, the last resort, whose errors are the user's."""
        if self.kind is Kind.STATIC:
            return ()
        return (Exception,) if self.kind is Kind.BATCH else (shape_general.NotShapeGeneral,)

    def with_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``prepare_model``'s options as this attempt runs them."""
        return {**options, **dict(self.options)} if self.options else options

    @property
    def note(self) -> str | None:
        """The note a static attempt opens its report with: why the dimensions were not kept."""
        return shape_general.not_kept_note(self.why) if self.kind is Kind.STATIC and self.why else None


@dataclass(frozen=True)
class Outcome:
    """What an attempt gave: kept, or refused with ``why`` (the message) and ``error`` (``Type: first
    line``), the original's run it made and the narrower dimensions its proposal had (for the next)."""

    step: Step
    kept: bool
    seconds: float
    why: str = ""
    error: str = ""
    reference: Reference | None = None
    narrower: autodims.Proposal | None = None


@dataclass
class CapturePlan:
    """The attempts of one ``prepare_model`` call, in the order made, each with its outcome."""

    outcomes: list[Outcome] = field(default_factory=list)

    @staticmethod
    def first() -> Step:
        return Step(Kind.ASKED)

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    @property
    def seconds(self) -> list[float]:
        """Each attempt's seconds, kept or not (the report's ``attempts not kept``)."""
        return [o.seconds for o in self.outcomes]


def after_refused(outcome: Outcome) -> Step | None:
    """The attempt after a refused one: the prompt's length alone where the proposal had a narrower
    one (a multimodal example's batch did not hold), else static shapes; None after the others."""
    step = outcome.step
    static = (("dynamic", False),)
    if step.kind is Kind.ASKED:
        if outcome.narrower is not None:
            return Step(Kind.NARROWER, outcome.why, autodims.batch_not_held(outcome.narrower, outcome.why),
                        reference=outcome.reference)
        return Step(Kind.STATIC, outcome.why, options=static, reference=outcome.reference)
    if step.kind is Kind.NARROWER:
        return Step(Kind.STATIC, f"{step.why}; with the prompt's length alone: {outcome.why}", options=static,
                    reference=outcome.reference)
    return None


def after_kept(step: Step, baked: bool, batch: Callable[[], autodims.Proposal | None], dynamic: Any,
               captured: dict[str, list[str]], reference: Reference | None) -> Step | None:
    """After a kept attempt as asked whose static graph the batch probe found specialised to the
    example's batch with no branch on it (``baked``): the same with dimension 0 declared (``batch()``,
    :func:`autodims.batch_proposal`), unless the user chose ``dynamic=``; block reuse off where the
    static capture stamped fewer blocks than it captured (``captured``: the report's), because under
    dynamic shapes each block's own capture costs more (reuse cost Swin 5x). None otherwise."""
    if step.kind is not Kind.ASKED or not baked:
        return None
    proposal = batch()
    if proposal is None or dynamic is not None:
        return None
    stamped = sum(len(v) for v in captured.values())
    if stamped < len(captured):
        return Step(Kind.BATCH, "", proposal, (("reuse_blocks", False),), reference,
                    f" Block reuse was off for it: the static capture stamped {stamped} block(s) for "
                    f"{len(captured)} captured.")
    return Step(Kind.BATCH, "", proposal, reference=reference)


def batch_note(outcome: Outcome, before: list[str]) -> str:
    """The report's note on a :attr:`Kind.BATCH` attempt: kept (``before``: the static graph's notes
    on why it was static), or not kept and why."""
    step = outcome.step
    assert step.kind is Kind.BATCH and step.proposal is not None
    if not outcome.kept:
        return f"Prepared again with dimension 0 of the inputs declared dynamic, not kept: {outcome.error}"
    return (f"The static-shape capture baked the example's batch into the graph ({step.proposal.describe()}): "
            f"captured again with it declared dynamic.{step.detail}" + "".join(f" Before that: {n}" for n in before))


# --- inside one attempt's capture stage ---------------------------------------------------------------

class CaptureKind(str, Enum):
    """What a capture inside the capture stage (:class:`CaptureStep`) is."""

    GENERAL = "shape-general"  # Dynamo alone with the proposal's dimensions (shape_general.capture)
    STATIC = "static shapes"  # the tracers in order on static shapes
    AS_ASKED = "the tracers as asked"  # the user's own dimensions did not hold Dynamo alone
    SECOND = "the static fallback's route with the dimensions"  # shape_general.fallback


@dataclass(frozen=True)
class CaptureStep:
    """One capture: the request it is made from and that the stages after it use (with the
    control-flow rewrite, the static capture's request is the one asked: its rounds run on static
    shapes inside the rewrite session), the tracers, the dimensions (kept: with their limits),
    ``why`` a static capture stands for a shape-general one (its report note), and ``elsewhere``:
    the shape-general capture that stopped for another reason than the dimensions, taken up again
    (:attr:`CaptureKind.SECOND`) when this static capture fails."""

    kind: CaptureKind
    request: CaptureRequest
    tracers: tuple[str, ...]
    proposal: autodims.Proposal | None = None
    why: str = ""
    elsewhere: shape_general.Elsewhere | None = None

    @property
    def note(self) -> str | None:
        """The report's note when this static capture stands for a shape-general one."""
        return shape_general.not_kept_note(self.why) if self.kind is CaptureKind.STATIC and self.why else None


class Captured(NamedTuple):
    """A capture made: its step (for a kept shape-general one, the proposal with its limits), the
    result (None: no tracer captured the model) and the attempts."""

    step: CaptureStep
    result: CaptureResult | None
    attempts: list[CaptureAttempt]


class Refusal(NamedTuple):
    """A shape-general capture not made: why, and where Dynamo stopped for another reason than the
    dimensions, what the static fallback's route may still keep (:class:`shape_general.Elsewhere`)."""

    why: str
    elsewhere: shape_general.Elsewhere | None


def first_capture(request: CaptureRequest, proposal: autodims.Proposal | None, tracers: list[str]) -> CaptureStep:
    """Shape-general where dimensions are proposed, else the tracers in order as asked."""
    if proposal is not None:
        return CaptureStep(CaptureKind.GENERAL, request, tuple(tracers), proposal)
    return CaptureStep(CaptureKind.STATIC, request, tuple(tracers))


def after_general(step: CaptureStep, refusal: Refusal, static_fallback: bool) -> CaptureStep | None:
    """The capture after a refused shape-general one: for the user's own dimensions the tracers as
    asked (Dynamo not twice where it has run already); else static shapes (the refusal said in the
    report), or None without a static fallback: the attempt is refused."""
    assert step.kind is CaptureKind.GENERAL and step.proposal is not None
    if step.proposal.explicit:
        ran = refusal.elsewhere is not None and bool(refusal.elsewhere.attempts)
        tracers = tuple(t for t in step.tracers if t != Route.DYNAMO) if ran else step.tracers
        return CaptureStep(CaptureKind.AS_ASKED, step.request, tracers)
    static = CaptureStep(CaptureKind.STATIC, step.request.replace(dynamic=False), step.tracers,
                         elsewhere=refusal.elsewhere)
    return static_instead(static, refusal.why, static_fallback)


def static_instead(static: CaptureStep, why: str, static_fallback: bool) -> CaptureStep | None:
    """``static`` standing for a shape-general capture that was not kept (``why``), or None without
    a static fallback."""
    return dataclasses.replace(static, why=why) if static_fallback else None


def not_after_rewrite(made: Captured) -> str | None:
    """Why the shape-general capture is not tried after the control-flow rewrite (``made``: its
    capture on static shapes): only a whole-model Dynamo graph is captured again with the dimensions."""
    if made.result is not None and made.result.tracer == Route.DYNAMO:
        return None
    return ("with the control-flow rewrite, Dynamo did not capture the model as one graph on static shapes "
            f"({made.result.tracer if made.result is not None else 'no capture'}), so its dimensions were not declared")


def second(static: CaptureStep, result: CaptureResult | None) -> CaptureStep | None:
    """After a static capture that stands for a shape-general one which Dynamo stopped for another
    reason (a value read from data, an untraceable helper): when the static tracers failed, the
    dimensions are tried again on the route the opaque-part fallback takes (decided on the static
    capture alone, made after that fallback)."""
    if static.kind is not CaptureKind.STATIC or static.elsewhere is None or result is not None:
        return None
    return CaptureStep(CaptureKind.SECOND, static.request.replace(dynamic=None), static.tracers,
                       static.elsewhere.proposal, static.why, static.elsewhere)


def second_not_tried(fallback: CaptureResult | None) -> str | None:
    """Why the :attr:`CaptureKind.SECOND` capture is not made after the opaque-part fallback gave
    ``fallback``: only a capture by Dynamo's fallback routes is made again with the dimensions."""
    if fallback is None or fallback.tracer not in shape_general.FALLBACK_TRACERS:
        return shape_general.NOT_TRIED
    return None
