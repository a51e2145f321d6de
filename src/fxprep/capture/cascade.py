"""Which tracers run, in which order, and each one's run: shared by ``prepare_model`` and
``check_traceability`` so that the two never disagree about a model.

``prepare_model`` runs the tracers as a cascade (the first that captures the model wins);
``check_traceability`` runs each one alone to say what each makes of the model. Both go through
:func:`plan` (the same tracers for the same inputs, a family's models captured with inputs built
from their config when none are given) and :func:`run_tracer` (the same concrete arguments, the
same fallback to the family's own fx tracer), so a model the check calls "not traceable" is never
one that ``prepare_model`` then prepares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.inputs import ExampleInputs, normalize_example_inputs, split_calls
from ..core.runs import preserved_state
from ..errors import InvalidInput
from ..families import Family
from ..reporting import progress
from ..reporting.report import CaptureAttempt
from . import dynamo_available
from .common import CaptureResult
from .fx import capture_fx, restored_attributes
from .leaves import capture_hybrid
from .request import CaptureRequest
from .routes import Route

NO_INPUTS_DYNAMO = ("No example_inputs: Dynamo captured with inputs built from the model config "
                    "(input_ids, attention_mask, ...); the result is not verified.")
NO_INPUTS_FX = "No example_inputs: only the fx tracer can run, and the result is not verified."


def plan(tracer: str, example: ExampleInputs | None, model: nn.Module, family: Family) -> tuple[list[str], str | None]:
    """The tracers to try for ``tracer`` ("auto", "dynamo" or "fx"), and a note for the report
    (``family``: the model's, which may build inputs from its config)."""
    if tracer != "auto":
        if tracer == Route.DYNAMO and example is None and family.example_inputs(model) is None:
            raise InvalidInput("tracer='dynamo' needs example_inputs: Dynamo traces by running the model.")
        return [tracer], None
    if example is None:
        if dynamo_available() and family.example_inputs(model) is not None:
            return [Route.DYNAMO, Route.FX], NO_INPUTS_DYNAMO
        return [Route.FX], NO_INPUTS_FX
    return ([Route.DYNAMO, Route.FX] if dynamo_available() else [Route.FX]), None


def dynamo_call(model: nn.Module, example: ExampleInputs | None, family: Family) -> ExampleInputs | None:
    """What Dynamo runs the model on: the example, else inputs ``family`` builds from the model's config."""
    if example is not None:
        return example
    built = family.example_inputs(model)
    return normalize_example_inputs(built) if built is not None else None


def run_tracer(name: str, request: CaptureRequest) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
    """One tracer's capture of ``request`` (never raises for a capture failure); every attempt it made."""
    model, example = request.model, request.example
    if name == Route.FX:
        result, attempt = capture_fx(model, request.policy, request.concrete_args, request.autowrap_functions)
        attempts = [attempt]
        if result is None and not request.concrete_args:  # the family's own tracer (transformers < 5's), if any
            own_result, own_attempt = request.family.fx_capture(model, example)
            if own_attempt is not None:
                result = own_result
                attempts.append(own_attempt)
        return result, attempts
    from .dynamo import capture_dynamo

    call = dynamo_call(model, example, request.family)
    if call is None:
        return None, []
    changed: list[str] = []
    with restored_attributes(model, changed):  # Dynamo marks the root (_is_torch_compile)
        result, attempt = capture_dynamo(request.replace(example=call))
    return result, [attempt]


def capture(request: CaptureRequest, tracers: list[str] | None = None
            ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
    """Run the tracers (default: :func:`plan`'s for ``"auto"``) in order until one succeeds; every
    attempt is returned for the report
    (``request.reuse``: Dynamo captures each repeated block once, :mod:`fxprep.capture.dynamo.reuse`;
    ``request.block_pass``: run once on each such block before it is stamped out)."""
    if tracers is None:
        tracers = plan("auto", request.example, request.model, request.family)[0]
    attempts: list[CaptureAttempt] = []
    for k, name in enumerate(tracers, 1):
        progress.stage(f"capture {k}/{len(tracers)}: {name}")
        result, tried = run_tracer(name, request)
        attempts += tried
        if result is not None:
            return result, attempts
    return None, attempts


@dataclass
class EachTracer:
    """What :func:`run_each` found: each whole-model tracer's attempts (run alone), and, when none
    captured the model, the opaque-part fallback's attempts, capture and opaque ``(site, issue)`` pairs."""

    attempts: list[CaptureAttempt] = field(default_factory=list)
    fallback: list[CaptureAttempt] = field(default_factory=list)
    hybrid: CaptureResult | None = None
    opaque: list[Any] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        """True when some tracer captured the whole model (the fallback did not run)."""
        return any(a.ok for a in self.attempts)


def run_each(request: CaptureRequest) -> EachTracer:
    """Every tracer ``prepare_model`` would try, each run alone on ``request`` (what each makes of
    the model, for ``check_traceability``), then, when none captured the model whole, the same
    opaque-part fallback ``prepare_model`` would run."""
    found = EachTracer()
    tracers, _ = plan("auto", request.example, request.model, request.family)
    for name in tracers:
        found.attempts += run_tracer(name, request)[1]
    if not found.whole:
        tried = list(found.attempts)  # the fallback starts from Dynamo's failure, and appends its own
        found.hybrid, found.opaque = capture_with_opaque_parts(request, tried)
        found.fallback = tried[len(found.attempts):]
    return found


def capture_with_opaque_parts(request: CaptureRequest, attempts: list[CaptureAttempt], *, fx_too: bool = True
                              ) -> tuple[CaptureResult | None, list[Any]]:
    """The fallback after every whole-model tracer failed, in the one order ``prepare_model`` and
    ``check_traceability`` share: Dynamo with the failing parts opaque (``dynamo+leaves``, when
    Dynamo failed on example inputs); where those parts hide layers and Dynamo stopped at a value
    read from data (on the whole model or in one of those parts), Dynamo again deciding such values from the example, taken when its decisions
    follow the inputs' structure (``dynamo+values``, :mod:`.dynamo.values`); then fx with them
    (``fx+leaves``, unless ``fx_too`` is False: a forced ``tracer="dynamo"`` never takes fx's result). Returns the capture (None when both
    failed) and its opaque parts as ``(site, issue)`` pairs; each run is appended to ``attempts``.
    The model is left as it was (:func:`fxprep.core.runs.preserved_state`)."""
    model, policy, example = request.model, request.policy, request.example
    failed = next((a.exception for a in attempts if a.tracer == Route.DYNAMO and a.exception is not None), None)
    if failed is not None and example is not None:
        from .dynamo import values
        from .dynamo.fallback import capture_dynamo_leaves

        progress.stage("capture: Dynamo with the untraceable parts opaque")
        # opaque parts' eager recordings, shared by the two captures below
        request = request.replace(records={} if request.records is None else request.records)
        with preserved_state(model):
            result, attempt, sites = capture_dynamo_leaves(request, failed)
        attempts.append(attempt)
        hidden = values.hidden_layers(model, result, [s for s, _ in sites], policy) if result is not None else None
        if hidden != [] and values.worth_deciding(failed, sites, model):
            progress.stage("capture: Dynamo deciding values read from data from the example")
            # preserved: opaque parts run eagerly during this capture (their real outputs, .opaque)
            with restored_attributes(model, []), preserved_state(model):
                decided, attempt, decided_sites = values.capture_deciding_values(request)
            attempts.append(attempt)
            still = values.hidden_layers(model, decided, [s for s, _ in decided_sites], policy) if decided else []
            if decided is not None and (hidden is None or len(still) < len(hidden)):
                decided.notes.append(values.why_taken(hidden, still))
                return decided, decided_sites
        if result is not None:
            return result, sites
    if not fx_too:
        return None, []
    progress.stage("capture: fx with the untraceable parts opaque")
    hybrid_call = split_calls(model, example, request.concrete_args)[1] if example is not None else None
    result, attempt, sites = capture_hybrid(request.replace(example=hybrid_call))
    attempts.append(attempt)
    return result, sites
