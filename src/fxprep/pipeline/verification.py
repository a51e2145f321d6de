"""The verification stage of ``prepare_model``: the prepared module checked against the original.

On the example (the reference run reused), then, for a static Dynamo capture, at other batch sizes
(the batch probe: :mod:`fxprep.capture.batch`); for a shape-general capture on a second size, whose failure
means static shapes (:class:`~fxprep.capture.shape_general.NotShapeGeneral`); for the user's declared
dimensions on a second size too; then on each extra input. What verification finds of state and
attention calls goes into the report here.
"""

from __future__ import annotations

import time
from typing import Any

import torch.fx as fx

from ..capture import batch, shape_general
from ..capture.dynamo import grown_example
from ..capture.routes import Route
from ..core.inputs import ExampleInputs, normalize_example_inputs, split_calls
from ..errors import EquivalenceError, InputMismatch
from ..reporting import notes, progress
from ..reporting.diagnose import first_line
from ..reporting.report import Report, Verification
from ..runtime.prepared import INPUT_SPEC
from ..verify import verify
from .state import Preparation


def verification(run: Preparation, gm: fx.GraphModule) -> None:
    """The prepared module checked against the original: on the example (then other batch sizes,
    for a static Dynamo capture), on a second size (dynamic shapes), on each extra input."""
    opts, report, example, result = run.opts, run.report, run.request.example, run.result
    assert result is not None
    if example is None or not opts.verify:
        detail = "no example_inputs given" if example is None else "verify=False"
        report.verification = Verification("skipped", detail=detail)
        if example is not None and run.proposal is not None:
            shape_general.notes(report, run.proposal, None)
        return
    t3 = time.perf_counter()
    progress.stage("verification")
    try:
        report.verification = verify_call(run, gm, (run.original_call, run.prepared_call), None)
        report.verification.assumed = list(run.assumed)  # what "passed" took as given (fxprep.runtime.baked)
    except (EquivalenceError, InputMismatch) as err:
        if run.proposal is None or run.proposal.explicit:
            raise
        raise shape_general.NotShapeGeneral(f"the graph captured at {run.proposal.capture_example.describe()} "
                                            f"did not match on the example: {str(err).splitlines()[0][:200]}") from err
    spec = gm.__dict__.get(INPUT_SPEC)
    if spec is not None and Route(result.tracer).dynamo and not run.dynamic:
        progress.step("other batch sizes")
        concrete = run.request.concrete_args

        def check(other: ExampleInputs, what: str) -> None:
            original, prepared = run.calls(other)
            verify(run.model, gm, original, prepared_example=prepared, rtol=opts.rtol, atol=opts.atol,
                   absent=run.absent, what=what)

        trace = batch.BranchTrace(lambda e: split_calls(run.model, e, concrete)[0], run.request.learned.fresh_kwargs)
        run.batch_baked = batch.probe(run.model, gm, example, report, check=check,
                                      trace=trace if Route(result.tracer).whole else None)
    if run.proposal is not None:
        verify_general(run, gm)
    elif run.dynamic:
        second = grown_example(run.model, example, run.dynamic)
        checked = verifysecond_size(run, gm, second)
        report.note(f"verified on {second_size(second)}: max |diff| = {checked.max_abs_diff:.3g}")
    verify_extra_inputs(run, gm)
    report.timings["verify"] = time.perf_counter() - t3


def verify_call(run: Preparation, gm: fx.GraphModule, calls: tuple[Any, Any], what: str | None) -> Verification:
    """``gm`` checked against the original on ``calls`` (original call, prepared call); ``what``
    names the input (None: the example, with the reference run reused); the state it leaves is noted."""
    opts = run.opts
    where_rewrite = run.rewrite is not None and run.rewrite.joins_with_where
    checked = verify(run.model, gm, calls[0], reference=run.reference if what is None else None,
                     prepared_example=calls[1], what=what or "the example inputs", rtol=opts.rtol, atol=opts.atol,
                     grad=opts.verify == "grad", where_rewrite=where_rewrite, absent=run.absent)
    note_state(run.report, checked)
    return checked


def verify_extra_inputs(run: Preparation, gm: fx.GraphModule) -> None:
    """``verify_inputs=[...]``, then the inputs the control-flow rewrite built to run each branch."""
    constructed = run.rewrite.coverage() if run.rewrite is not None else []
    for i, (label, extra) in enumerate([(None, e) for e in run.opts.verify_inputs] + constructed):
        what = label or f"verify_inputs[{i}]"
        progress.step(what)
        extra_example = normalize_example_inputs(extra)
        assert extra_example is not None
        try:
            checked = verify_call(run, gm, run.calls(extra_example), what)
        except InputMismatch as err:  # the graph cannot serve this input: a verification failure
            raise EquivalenceError(f"{what}: the prepared module refuses it, {err}") from err
        checked.label = label or ""
        run.report.extra_verifications.append(checked)


def note_state(report: Report, verification: Verification) -> None:
    """State the original's forward updates and the prepared module does not: said loudly; and
    attention called otherwise than eager does."""
    if verification.state_not_reproduced:
        report.note(notes.state_not_reproduced(verification.state_not_reproduced))
    if verification.attention:
        report.note(verification.attention)


def verify_general(run: Preparation, gm: fx.GraphModule) -> None:
    """A shape-general capture checked on a second size (batch and sequence 3 larger): the proof that
    lets calls at other sizes through; a failure means static shapes (:class:`shape_general.NotShapeGeneral`)."""
    proposal, example = run.proposal, run.request.example
    assert proposal is not None and example is not None
    second = grown_example(run.model, example, proposal.dynamic, grow=shape_general.second_grow(run.model, proposal, example))
    try:
        result = verifysecond_size(run, gm, second)
    except Exception as err:  # noqa: BLE001 - any failure at another size: the dims did not hold
        if proposal.explicit:
            raise
        first = first_line(err)
        raise shape_general.NotShapeGeneral(f"at {second_size(second)}: {type(err).__name__}: {first}") from err
    checked = f"{second.describe()} (max |diff| {result.max_abs_diff:.3g})"
    past = shape_general.past_scans(run.model, proposal, example, second)
    if past:  # a loop kept opaque: also where its step count differs from the example's (capture.dynamo.scans)
        third = grown_example(run.model, example, proposal.dynamic, grow=past)
        try:
            more = verifysecond_size(run, gm, third)
        except Exception as err:  # noqa: BLE001 - as for the second size
            if proposal.explicit:
                raise
            raise shape_general.NotShapeGeneral(f"at {second_size(third)}: {type(err).__name__}: {first_line(err)}") from err
        checked += f" and on {third.describe()} (max |diff| {more.max_abs_diff:.3g})"
    if proposal.explicit:  # the user's own dimensions: the note as for any declared ones
        run.report.note(f"verified on {second_size(second)}: max |diff| = {result.max_abs_diff:.3g}")
    shape_general.notes(run.report, proposal, checked)


def second_size(second: ExampleInputs) -> str:
    return f"a second input size ({second.describe()})"


def verifysecond_size(run: Preparation, gm: fx.GraphModule, second: ExampleInputs) -> Verification:
    """The prepared module checked against the original on ``second`` (the example grown in its dynamic
    dimensions: :func:`fxprep.capture.dynamo.grown_example`); raises EquivalenceError where they differ."""
    label = second_size(second)
    progress.step(label)
    original_call, prepared_call = run.calls(second)
    opts = run.opts
    result = verify(run.model, gm, original_call, prepared_example=prepared_call, what=label,
                    rtol=opts.rtol, atol=opts.atol, grad=opts.verify == "grad", absent=run.absent)
    note_state(run.report, result)
    return result
