"""``prepare_model``: capture cascade → passes → verify → report.

This module only orchestrates; every step lives in its own module and can be used alone. It runs
the capture plan (:mod:`fxprep.pipeline.plan`: which attempts and captures, in which order, and why)
without deciding it. :func:`_prepare`, one attempt, reads as its stages (reference run, capture,
passes, input guard, verification, report), each a function of one :class:`Preparation`: the
:class:`~fxprep.capture.request.CaptureRequest` made once by :func:`_start`, and what the stages learn
on the way. The report's longer note texts live in :mod:`fxprep.reporting.notes`.

See docs/getting-started.md (using it) and docs/architecture.md ("The pipeline").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import time
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import decisions
from .big import stand_ins
from .big.weights import remember_original
from .capture import cascade, dynamo_available, shape_general
from .capture.common import CaptureResult
from .capture.fx import mode_notes, trace_failure
from .capture.request import CaptureRequest, ScanStop
from .capture.rewrite import branches
from .capture.routes import Route
from .capture.shapes import autodims
from .core import heap
from .core.inputs import ExampleInputs, normalize_example_inputs, split_calls
from .core.runs import hooks_left_as_found, preserved_state
from .core.threads import GLOBAL_LOCK
from .errors import InvalidInput
from .families import Family, family_for
from .options import PrepareOptions
from .passes import (
    aimet_modules,
    aimet_names,
    finish,
    functional_to_module,
    owner_names,
    portable,
    state_dict,
    unroll,
    values,
)
from .pipeline import plan, root_hooks
from .pipeline.arguments import (
    check_concrete_args,
    check_dynamic_inputs,
    check_model,
    defaults_as_concrete,
    leaf_policy,
)
from .pipeline.state import Preparation, UserArguments
from .pipeline.verification import verification
from .reporting import notes, progress
from .reporting.diagnose import first_line
from .reporting.report import CaptureAttempt, Report
from .runtime import baked, guard, toolkits
from .runtime.prepared import BAKED, INPUT_SPEC, REPORT, as_prepared, get_report, set_preserved
from .verify import Reference, run_original


def _block_conversion(model: nn.Module, opts: PrepareOptions) -> Any:
    """The functional-to-module pass for each repeated block, run once before the block is stamped
    out (with block reuse): converting an 80-layer LLM node by node on the whole graph cost ~0.25 s
    of a 2 s prepare. It is the pass :func:`_prepare` runs on the whole graph, which then reports
    these modules and converts the rest."""
    if not opts.convert_functionals:
        return None

    def convert(block: fx.GraphModule, first: nn.Module) -> None:
        portable.run(block)
        values.annotate(block)
        functional_to_module.run(block, training=model.training, original=first, recompile=False)

    return convert


def prepare_model(
    model: nn.Module,
    modules_to_exclude: list[nn.Module] | None = None,
    module_classes_to_exclude: list[type] | None = None,
    concrete_args: dict[str, Any] | None = None,
    *,
    example_inputs: Any = None,
    **options: Any,
) -> fx.GraphModule:
    """Turn ``model`` into a clean, module-level ``torch.fx.GraphModule`` and verify it.

    A drop-in for AIMET's ``prepare_model``. The model is never changed and its parameters never copied:
    the result's leaves are the user's own modules (docs/getting-started.md).

    Args:
        model: The ``nn.Module`` to prepare.
        modules_to_exclude: Module instances kept as single calls, never traced into.
        module_classes_to_exclude: Module classes whose instances are kept as single calls.
        concrete_args: ``{argument name: value}`` fixed at capture, as in ``torch.fx``.
        example_inputs: A tensor, a tuple of positional or a dict of keyword arguments; Dynamo captures on them and the result is verified on them.
        **options: Keyword-only options, each a field of :class:`fxprep.options.PrepareOptions`.

    Returns:
        The prepared ``GraphModule``; ``gm.fxprep_report`` says what was done.

    Raises:
        InvalidInput: An argument or option of the wrong kind (``UnknownOption`` for an unknown option name).
        ModelError: The model itself fails on ``example_inputs``.
        TraceFailure: No tracer could capture the model; the message locates each issue.
        EquivalenceError: The prepared module computes something else than the model on the examples.
    """
    start = time.perf_counter()
    if options.get("copy") is True and stand_ins.needed(model, example_inputs):
        # copied on meta (free), then stood in: a copy of the stand-ins would be zeros in memory
        model, modules_to_exclude = _independent_copy(model, modules_to_exclude)
        options = {**options, "copy": False}
    with stand_ins.standing_in(model, example_inputs) as (example, finish):
        gm = _prepare_model(model, modules_to_exclude, module_classes_to_exclude, concrete_args, example, options)
        if example is not example_inputs:  # meta tensors stood in: the graph holds them again
            finish(gm)
            get_report(gm).note(stand_ins.NOTE)
    # the whole call counted (the stand-ins' making and undoing, the heap and hooks put back after
    # the graph was made: 0.5 s of a 4-layer Llama's 6.6 s): the timings add up to the time it took
    _counted(get_report(gm), "meta stand-ins" if example is not example_inputs else "other", time.perf_counter() - start)
    return gm


def _counted(report: Report, stage: str, total: float) -> None:
    """``total`` seconds made the report's total, what its stages do not hold added to ``stage``."""
    timings = {k: v for k, v in report.timings.items() if k != "total"}
    timings[stage] = timings.get(stage, 0.0) + max(0.0, total - sum(timings.values()))
    report.timings = {**timings, "total": total}


def _prepare_model(model: nn.Module, modules_to_exclude: list[nn.Module] | None,
                   module_classes_to_exclude: list[type] | None, concrete_args: dict[str, Any] | None,
                   example_inputs: Any, options: dict[str, Any]) -> fx.GraphModule:
    """The attempts of the capture plan (:mod:`fxprep.pipeline.plan`), each the stages run once, until
    one is kept and none follows it."""
    title = str(options.get("name") or type(model).__name__)
    start = time.perf_counter()
    family = family_for(model)  # asked once: the capture request carries it to every stage
    with heap.frozen_heap(), progress.reporting(options.get("progress"), title), hooks_left_as_found(model), \
            family.working_on(model), root_hooks.set_aside(model) as aside:
        user = UserArguments(modules_to_exclude, module_classes_to_exclude, concrete_args, example_inputs)
        capture_plan = plan.CapturePlan()
        step: plan.Step | None = capture_plan.first()
        gm: fx.GraphModule | None = None
        while step is not None:
            # a refused attempt's frames (its capture, its copy of the model with copy=True) are freed
            # before the next one starts; its reference run is reused
            made, outcome = _prepare(model, family, user, options, step)
            capture_plan.record(outcome)
            if step.kind is plan.Kind.BATCH:  # kept or not, the report says so; the static graph before stands
                assert gm is not None
                before = [n for n in get_report(gm).notes if n.startswith("Shape-general capture")]
                gm = made[0] if made is not None else gm
                get_report(gm).note(plan.batch_note(outcome, before))
                break
            if made is None:
                step = plan.after_refused(outcome)
                continue
            gm, run = made
            batch = functools.partial(_batch_proposal, model, run)  # made only where the batch was baked in
            step = plan.after_kept(step, run.batch_baked, batch, options.get("dynamic"),
                                   get_report(gm).reuse.get("captured", {}), run.reference)
        assert gm is not None
        return _timed(root_hooks.carry(gm, aside, get_report(gm)), start, capture_plan.seconds)


def _timed(gm: fx.GraphModule, start: float, tries: list[float]) -> fx.GraphModule:
    """The report's timings made to add up to the time this ``prepare_model`` call took: the kept
    attempt's stages, the attempts that were not kept (a static capture prepared again with its batch
    dynamic: Swin's report said 10.9 s of 39.6 s), and the rest (checks, hooks, the report)."""
    report = get_report(gm)
    total = time.perf_counter() - start
    timings = {k: v for k, v in report.timings.items() if k != "total"}
    if len(tries) > 1:  # the kept attempt is one of them; its own time is report.timings["total"]
        timings["attempts not kept"] = max(0.0, sum(tries) - report.timings.get("total", 0.0))
    timings["other"] = max(0.0, total - sum(timings.values()))
    timings["total"] = total
    report.timings = timings
    return gm


def _batch_proposal(model: nn.Module, run: Preparation) -> autodims.Proposal | None:
    """Dimension 0 of the example's inputs as ``batch`` (:func:`autodims.batch_proposal`)."""
    return autodims.batch_proposal(model, run.request.calls()[0])


def _prepare(model: nn.Module, family: Family, user: UserArguments, options: dict[str, Any], step: plan.Step
             ) -> tuple[tuple[fx.GraphModule, Preparation] | None, plan.Outcome]:
    """One attempt of the plan: the stages of ``prepare_model``, in order, each a function of the
    preparation ``run``; the prepared module and its preparation when kept, and the outcome. A
    failure in ``step.refusals`` is the outcome's reason (with the reference run made, and the
    narrower dimensions the proposal had, for the next attempt); any other is raised."""
    began = time.perf_counter()
    run: Preparation | None = None
    try:
        run = _start(model, family, user, step.with_options(options))
        _reference_run(run, step.reference)
        gm = _stages(run, step)
    except step.refusals as err:
        reference = run.reference if run is not None else None
        narrower = run.proposal.narrower if run is not None and run.proposal is not None else None
        return None, plan.Outcome(step, False, time.perf_counter() - began, str(err),
                                  f"{type(err).__name__}: {first_line(err)}", reference, narrower)
    return (gm, run), plan.Outcome(step, True, time.perf_counter() - began)


def _stages(run: Preparation, step: plan.Step) -> fx.GraphModule:
    """What follows the reference run, in order (see :func:`_prepare`)."""
    _propose_shapes(run, step)
    t1 = time.perf_counter()
    run.result = _capture(run, step.static_fallback)
    run.report.timings["capture"] = time.perf_counter() - t1
    gm = _captured_module(run)
    t2 = time.perf_counter()
    _passes(run, gm)
    _guard_inputs(run, gm)
    run.report.timings["passes"] = time.perf_counter() - t2
    verification(run, gm)
    return _finish(run, gm)


def _start(model: nn.Module, family: Family, user: UserArguments, options: dict[str, Any]) -> Preparation:
    """Check the arguments and make the capture request: the model (a deep copy with ``copy=True``),
    its family, its leaf policy, the example, the concrete arguments (the family's own added) and the options."""
    start = time.perf_counter()
    model = check_model(model)
    opts = PrepareOptions.from_kwargs(options)
    modules_to_exclude = user.modules_to_exclude
    if opts.copy:
        model, modules_to_exclude = _independent_copy(model, modules_to_exclude)
    policy = leaf_policy(model, modules_to_exclude, user.module_classes_to_exclude)
    example = normalize_example_inputs(user.example_inputs)
    user_concrete = check_concrete_args(model, user.concrete_args)
    concrete = family.concrete_args(model, user_concrete, example)
    report = Report(opts.name or type(model).__name__)
    report.inputs = example.describe() if example is not None else "none"
    absent = family.absent_outputs(user_concrete, concrete)  # transformers: past_key_values, with use_cache=False added
    if absent:
        report.note(family.absent_note)
    concrete = defaults_as_concrete(model, example, concrete, report)
    request = CaptureRequest(
        model, policy, example, concrete, autowrap_functions=opts.autowrap_functions, dynamic=opts.dynamic, family=family,
        # block reuse stays off while control-flow sites are rewritten (their methods are bound to
        # single instances for the capture)
        reuse=opts.reuse_blocks and opts.control_flow is None, block_pass=_block_conversion(model, opts))
    return Preparation(request, opts, report, absent, start)


def _reference_run(run: Preparation, reference: Reference | None) -> None:
    """The original run on the example, as the user calls it (what the prepared module is verified against,
    and the check that the inputs suit the model). ``reference``: that run, made by the attempt before."""
    example = run.request.example
    run.original_call = run.prepared_call = example
    if example is None:
        return
    run.original_call, run.prepared_call = run.calls(example)
    if run.opts.verify and reference is not None:
        run.reference = reference
    elif run.opts.verify:
        progress.stage("reference run")
        start = time.perf_counter()
        run.reference = run_original(run.model, run.original_call)
        run.report.timings["reference run"] = time.perf_counter() - start


def _propose_shapes(run: Preparation, step: plan.Step) -> None:
    """The dimensions to capture with: the attempt's own (``step.proposal``), else without ``dynamic=``
    the shape-general proposal (a transformers model's batch and sequence:
    :mod:`fxprep.capture.shape_general`); with it, it checked against the example (grown where a size
    is below 2). A static attempt's report opens with why the dimensions were not kept."""
    opts, request = run.opts, run.request
    run.proposal = step.proposal
    if run.proposal is None and opts.dynamic is not False and request.example is not None and opts.tracer != Route.FX \
            and (opts.control_flow is None or opts.dynamic is None) and dynamo_available():
        run.proposal = (autodims.propose(run.model, request.example) if opts.dynamic is None
                        else autodims.declared(run.model, request.example, opts.dynamic))
    if opts.dynamic and request.example is not None:
        grown = run.proposal.capture_example if run.proposal is not None and run.proposal.explicit else None
        check_dynamic_inputs(request if grown is None else request.replace(example=grown), opts.dynamic)
    if step.note:
        run.report.note(step.note)


def _capture(run: Preparation, static_fallback: bool) -> CaptureResult:
    """The capture: the plan's captures (:mod:`fxprep.pipeline.plan`; with the control-flow rewrite, or
    shape-general first), then the opaque-part fallback; the request, dimensions and shapes of the
    capture kept are the preparation's from here. Raises the located failure when nothing captures
    the model, :class:`~.capture.shape_general.NotShapeGeneral` when the dimensions did not hold and
    the attempt has no static fallback."""
    opts, report = run.opts, run.report
    tracers, note = cascade.plan(opts.tracer, run.request.example, run.model, run.request.family)
    if note:
        report.note(note)
    with GLOBAL_LOCK:  # capture patches process-wide state: one thing at a time (fxprep.core.threads)
        run.rewrite = rewrite = _control_flow(run)
        first = plan.first_capture(run.request, run.proposal, tracers)
        if rewrite is not None:  # control_flow="rewrite": data-dependent ifs rewritten, site by site
            step, result, attempts = _capture_rewritten(run, rewrite, first, static_fallback)
        else:
            step, result, attempts = _capture_first(run, first, static_fallback)
        second = plan.second(step, result)  # decided on the static capture, made after the opaque-part fallback
        sites: list[Any] = []
        if result is None and opts.fallback == "leaf":  # Dynamo again with the failing parts opaque, then fx
            with rewrite.bound() if rewrite is not None else contextlib.nullcontext():
                handled = rewrite.learn if rewrite is not None else None
                result, sites = cascade.capture_with_opaque_parts(step.request.replace(handled=handled), attempts,
                                                                  fx_too=opts.tracer != Route.DYNAMO)
        if second is not None:
            step, result = _capture_second(run, second, step, attempts, result, sites)
        if step.note:
            report.note(step.note)
        run.request, run.proposal = step.request, step.proposal
        run.dynamic = step.proposal.dynamic if step.proposal is not None else step.request.dynamic
    report.issues.extend(issue for _, issue in sites)
    if result is not None and sites:
        report.note(notes.opaque_parts(len(sites), dynamo=Route(result.tracer).dynamo))
    report.attempts = attempts
    if result is None:
        failure = trace_failure(attempts, run.model)
        if rewrite is not None:
            failure.args = (f"{failure.args[0]}\n\n{rewrite.explain()}",)
        raise failure
    for attempt in attempts:  # a failed tracer's error holds its frames (fake tensors, globals): not kept alive
        attempt.exception = None
    return result


def _captured_module(run: Preparation) -> fx.GraphModule:
    """The captured graph as the prepared module, and what the capture says in the report."""
    result, report, example = run.result, run.report, run.request.example
    assert result is not None
    gm = as_prepared(result.gm, compiled=False)  # recompiled once, after the passes
    report.tracer = result.tracer
    report.leaves.update(result.extra_leaves)
    reuse = gm.meta.get("fxprep_reuse")
    if reuse is not None:
        report.reuse = reuse.to_dict()
    for note in result.notes:
        report.note(note)
    for note in mode_notes(gm, run.model):
        report.note(note)
    if Route(result.tracer).dynamo and not run.dynamic and example is not None:
        report.note(notes.static_shapes(example))
    return gm


def _passes(run: Preparation, gm: fx.GraphModule) -> None:
    """The passes, in place, in their order; the module is recompiled once at the end."""
    model, opts, report = run.model, run.opts, run.report
    progress.stage("passes")
    portable.run(gm)  # before the kinds are recorded: it adds nodes
    if opts.convert_functionals:
        with preserved_state(model):
            values.annotate(gm, run.prepared_call)
    else:  # the kinds only label the report's ops left functional: inferred from the ops, nothing run
        values.annotate(gm, None)
    if opts.convert_functionals:
        functional_to_module.run(gm, training=model.training, original=model, report=report, recompile=False)
    branches.run(gm, training=model.training, report=report, original=model, convert=opts.convert_functionals,
                 unroll=opts.unroll, share_parameters=opts.share_parameters)  # inside torch.cond branches
    if opts.unroll:
        unroll.run(gm, share_parameters=opts.share_parameters, original=model, report=report, recompile=False)
    if opts.style == "aimet":
        aimet_modules.run(gm, report=report)
        aimet_names.run(gm, original=model, report=report)
    original_state = model.state_dict(keep_vars=True) if opts.share_parameters else None  # read once: nothing changes it
    if original_state is not None:
        state_dict.restore(gm, model, original_state)  # the owner's raw parameters back in place, for owner_names
    if opts.convert_functionals and opts.style != "aimet":  # AIMET's names are module_<node> for every added layer
        owner_names.run(gm, original=model, report=report)
    if original_state is not None:
        state_dict.record_aliases(gm, model, original_state)  # after every pass that moves modules
    finish.match_modes(gm, model)
    finish.restore_output_type(gm, None if run.reference is None else run.reference.output)
    decisions.keep_locations(gm)
    gm.recompile()  # once, after every pass (generating the code is a large part of the cost)


def _finish(run: Preparation, gm: fx.GraphModule) -> fx.GraphModule:
    """The report completed and attached, the original remembered (for ``load_weights`` and
    ``verify_prepared``), the hooks of the toolkits imported run (:mod:`fxprep.runtime.toolkits`)."""
    report, result = run.report, run.result
    assert result is not None
    if run.rewrite is not None:
        run.rewrite.report(report, result.extra_leaves, result.tracer)
    report.timings["total"] = time.perf_counter() - run.start
    set_preserved(gm, REPORT, report)
    remember_original(gm, run.model, run.request.concrete_args)  # for fxprep.load_weights / verify_prepared
    toolkits.run_hooks()  # the toolkits already imported accept the module (AIMET QuantSim)
    return gm


def _control_flow(run: Preparation) -> Any:
    """The control-flow rewrite session when ``control_flow="rewrite"``, else None."""
    if run.opts.control_flow != "rewrite":
        return None
    from .capture.rewrite.session import ControlFlowRewrite

    extra = [e for e in (normalize_example_inputs(v) for v in run.opts.verify_inputs) if e is not None]
    request = run.request
    return ControlFlowRewrite(request.model, request.example, extra, request.concrete_args,
                              None if run.absent or run.reference is None else run.reference.output, request.family)


def _independent_copy(model: nn.Module, modules_to_exclude: Any) -> tuple[nn.Module, Any]:
    """``copy=True``: prepare a deep copy, so the result shares no module, parameter or mode with
    ``model``; the modules to exclude are mapped to their copies (they are matched by identity)."""
    memo: dict[int, Any] = {}
    try:
        clone = copy.deepcopy(model, memo)
    except Exception as err:  # noqa: BLE001 - a model deepcopy cannot take (open files, locks...)
        raise InvalidInput(f"copy=True: the model cannot be deep-copied ({type(err).__name__}: {err}); "
                           f"prepare it without copy=True, or copy it yourself.") from err
    if modules_to_exclude:
        modules_to_exclude = [memo.get(id(m), m) for m in modules_to_exclude]
    return clone, modules_to_exclude


def _guard_inputs(run: Preparation, gm: fx.GraphModule) -> None:
    """Record the inputs ``gm`` was captured for, and the values it took from the model's attributes
    and globals; each call is checked against them (fxprep.runtime.guard), and so is each value the graph
    decided from data (fxprep.decisions)."""
    model, report, concrete = run.model, run.report, run.request.concrete_args
    assert run.result is not None
    changed = run.reference.changed.names() if run.reference is not None else []
    found = baked.record_baked(gm, model, changed)
    if len(found):
        setattr(gm, BAKED, found)  # not preserved by a copy: a copy no longer shares the user's modules
        if found.names():
            report.note(notes.baked_values(found.names()))
        if found.unchecked:
            report.note(notes.baked_unchecked(found.assumed()))
    run.assumed = found.assumed()
    tracer = Route(run.result.tracer).rules  # dynamo+leaves: Dynamo's rules (static shapes) with opaque parts
    call = run.prepared_call
    if call is None and tracer.dynamo:  # captured on inputs the family built from the model's config
        built = cascade.dynamo_call(model, None, run.request.family)
        call = split_calls(model, built, concrete)[1] if built is not None else None
    if call is not None:
        dims: dict[str, set[int]] = {}
        if run.dynamic and tracer.dynamo:
            from .capture.dynamo import dynamic_dims

            named = dynamic_dims(model, call, run.dynamic)
            given = {**dict(zip(inspect.signature(gm.forward).parameters, call.args)), **call.kwargs}
            for name, declared in named.items():
                value = given.get(name)
                rank = value.dim() if isinstance(value, torch.Tensor) else 0
                dims[name] = {d % rank for d in declared} if rank else set()
        spec = guard.record(gm, call.args, call.kwargs, tracer, dims, shape_general.specialised_reasons(run.proposal),
                            shape_general.limits_by_input(run.proposal))
        if spec is not None:
            set_preserved(gm, INPUT_SPEC, spec)
            if tracer.dynamo and any(n.get("kind") == "tensor" and None not in (n.get("shape") or [None])
                                          for n in spec.params.values()):
                report.note(notes.INPUT_CHECKS)
    decided = decisions.summary(gm)
    if decided:
        report.note(notes.decided_values(decided))


def _capture_first(run: Preparation, first: plan.CaptureStep, static_fallback: bool) -> plan.Captured:
    """``first`` (:func:`plan.first_capture`), and where it is a shape-general capture that is
    refused, the capture :func:`plan.after_general` says comes next (static shapes, or the tracers
    as asked); raises :class:`~.capture.shape_general.NotShapeGeneral` when none does."""
    if first.kind is not plan.CaptureKind.GENERAL:
        return plan.Captured(first, *cascade.capture(first.request, list(first.tracers)))
    general = _capture_general(run, first)
    if isinstance(general, plan.Captured):
        return general
    step = plan.after_general(first, general, static_fallback)
    if step is None:
        raise shape_general.NotShapeGeneral(general.why)
    result, attempts = cascade.capture(step.request, list(step.tracers))
    done = general.elsewhere.attempts if step.kind is plan.CaptureKind.AS_ASKED and general.elsewhere is not None else []
    return plan.Captured(step, result, done + attempts)


def _capture_general(run: Preparation, step: plan.CaptureStep) -> plan.Captured | plan.Refusal:
    """The shape-general capture (:func:`shape_general.capture`: Dynamo alone, with the proposal's
    dimensions), kept with the proposal's limits; or why not (a branch of the model's code bounding
    the user's own dimensions: the tracers as asked, where an opaque part takes both ways)."""
    request, proposal = step.request, step.proposal
    assert proposal is not None and request.example is not None

    def capture_at(call: ExampleInputs, dims: Any, opaque: list[Any], search: ScanStop | None
                   ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
        return cascade.capture(request.replace(example=call, dynamic=dims, opaque=tuple(opaque), scan_search=search),
                               [Route.DYNAMO])

    try:
        result, attempts, found = shape_general.capture(request.model, request.example, proposal, capture_at,
                                                        scans_of=shape_general.scans_finder(request))
    except shape_general.NotShapeGeneral as err:
        return plan.Refusal(str(err), err.elsewhere)
    kept = shape_general.limits(request, found, request.replace(example=found.capture_example).calls()[0])
    if kept.explicit and kept.limits:
        return plan.Refusal("a branch of the model's code bounds them", None)
    return plan.Captured(dataclasses.replace(step, proposal=kept), result, attempts)


def _capture_rewritten(run: Preparation, rewrite: Any, first: plan.CaptureStep, static_fallback: bool
                       ) -> plan.Captured:
    """``control_flow="rewrite"``. The sites are found and rewritten on static shapes (each round is
    a capture, and a failure's cause is plainest there); with dimensions proposed, the model with
    the plan found is then captured once more with them (:func:`_capture_general`), kept when Dynamo
    captures it whole. Otherwise the static capture stands and the report says why, or, without a
    static fallback, :class:`~.capture.shape_general.NotShapeGeneral` is raised."""
    static = first.request if first.proposal is None else first.request.replace(dynamic=False)
    made = plan.Captured(dataclasses.replace(first, kind=plan.CaptureKind.STATIC, proposal=None),
                         *rewrite.capture(lambda: cascade.capture(static, list(first.tracers))))
    if first.kind is not plan.CaptureKind.GENERAL:
        return made
    why = plan.not_after_rewrite(made)
    if why is None:
        with rewrite.bound():
            general = _capture_general(run, first)
            if isinstance(general, plan.Captured):
                return general._replace(attempts=made.attempts + general.attempts)
            step = plan.after_general(first, general, static_fallback=False)
            if step is not None:  # the user's own dimensions: the tracers as asked
                result, attempts = cascade.capture(step.request, list(step.tracers))
                done = general.elsewhere.attempts if general.elsewhere is not None else []
                return plan.Captured(step, result, made.attempts + done + attempts)
        why = general.why
    step = plan.static_instead(made.step, why, static_fallback)
    if step is None:
        raise shape_general.NotShapeGeneral(why)
    return made._replace(step=step)


def _capture_second(run: Preparation, second: plan.CaptureStep, static: plan.CaptureStep,
                    attempts: list[CaptureAttempt], result: CaptureResult | None, sites: list[Any]
                    ) -> tuple[plan.CaptureStep, CaptureResult | None]:
    """The static fallback's capture (``result``, made from the ``static`` step's request), or where
    Dynamo made it (with parts opaque, maybe deciding values read from data), the same capture with
    the dimensions (``second``: :func:`shape_general.fallback`) when that holds, with their limits;
    else the static step, its report note saying why."""
    assert second.elsewhere is not None and second.proposal is not None
    why_not = plan.second_not_tried(result)
    if why_not is None:
        assert result is not None
        dims, found, why_not = shape_general.fallback(second.request, second.elsewhere, attempts, result.tracer, sites)
        if dims is not None and found is not None:
            call = second.request.replace(example=found.capture_example).calls()[0]
            return dataclasses.replace(second, proposal=shape_general.limits(run.request, found, call)), dims
    return dataclasses.replace(static, why=f"{static.why}; {why_not}"), result
