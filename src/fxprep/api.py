"""``prepare_model``: capture cascade → passes → verify → report.

This module only orchestrates; every step lives in its own module and can be used alone.
:func:`_prepare` reads as its stages (reference run, capture, passes, input guard, verification,
report), each a function of one :class:`Preparation`: the :class:`~fxprep.capture.request.CaptureRequest`
made once by :func:`_start`, and what the stages learn on the way. The report's longer note texts
live in :mod:`fxprep.reporting.notes`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import time
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import decisions
from .big import stand_ins
from .big.weights import remember_original
from .capture import cascade, dynamo_available, shape_general
from .capture.common import CaptureAttempt, CaptureResult
from .capture.fx import mode_notes, trace_failure
from .capture.request import CaptureRequest
from .capture.rewrite import branches
from .capture.routes import Route
from .capture.shapes import autodims
from .core import heap
from .core.inputs import ExampleInputs, normalize_example_inputs, split_calls
from .core.runs import hooks_left_as_found, preserved_state
from .core.threads import GLOBAL_LOCK
from .errors import InvalidInput
from .families.transformers import model as huggingface
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
from .pipeline import root_hooks
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
from .reporting.report import Report
from .runtime import baked, guard
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

    Drop-in for AIMET's ``prepare_model(model, modules_to_exclude, module_classes_to_exclude,
    concrete_args)``. With ``example_inputs`` (a tensor, a tuple of positional arguments or a dict of
    keyword arguments) the result is checked against the original and the max difference recorded.
    The user's model is never mutated and its parameters are never copied: the returned module's
    leaves are the user's own module objects. ``gm.fxprep_report`` says what was done.

    Options are keyword-only; see :class:`fxprep.options.PrepareOptions`.
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
    title = str(options.get("name") or type(model).__name__)
    start = time.perf_counter()
    with heap.frozen_heap(), progress.reporting(options.get("progress"), title), hooks_left_as_found(model), \
            huggingface.output_capturing_hooks(model), root_hooks.set_aside(model) as aside:
        user = UserArguments(modules_to_exclude, module_classes_to_exclude, concrete_args, example_inputs)
        tries: list[float] = []  # the seconds of each attempt (_prepare call), for the report's timings
        try:
            gm, run = _prepare(model, user, options, tries=tries)
        except shape_general.NotShapeGeneral as err:  # found dimensions did not hold: static shapes, as before
            why, reference, narrower = str(err), err.reference, err.narrower
        else:
            gm = _batch_general(model, user, options, gm, run, tries) if run.batch_baked else gm
            return _timed(root_hooks.carry(gm, aside, get_report(gm)), start, tries)
        if narrower is not None:  # a multimodal example's batch did not hold: its prompt length alone
            try:
                gm, _ = _prepare(model, user, options, reference=reference,
                                 proposal=autodims.batch_not_held(narrower, why), static_fallback=True, tries=tries)
                return _timed(root_hooks.carry(gm, aside, get_report(gm)), start, tries)
            except shape_general.NotShapeGeneral as err:
                why, reference = f"{why}; with the prompt's length alone: {err}", err.reference
        # outside the except block: the first attempt's frames (its capture, its copy of the model
        # with copy=True) are freed before the second one starts; its reference run is reused
        gm, _ = _prepare(model, user, {**options, "dynamic": False}, not_general=why, reference=reference, tries=tries)
        return _timed(root_hooks.carry(gm, aside, get_report(gm)), start, tries)


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


def _batch_general(model: nn.Module, user: UserArguments, options: dict[str, Any], gm: fx.GraphModule,
                   run: Preparation, tries: list[float]) -> fx.GraphModule:
    """A static graph the batch probe found specialised to the example's batch with no branch on it
    (a ViT's ``cls_token.expand(B, -1, -1)``) prepared again with dimension 0 declared dynamic
    (:func:`autodims.batch_proposal`), the reference run reused; kept when it verifies on the example
    and on a second batch, else the static graph, which says why."""
    proposal = autodims.batch_proposal(model, run.request.calls()[0])
    if proposal is None or options.get("dynamic") is not None:
        return gm
    captured = get_report(gm).reuse.get("captured", {})
    stamped, off = sum(len(v) for v in captured.values()), ""
    if stamped < len(captured):  # reuse stamped fewer blocks than it captured: under dynamic shapes each
        options = {**options, "reuse_blocks": False}  # capture costs more, and reuse cost Swin 5x
        off = f" Block reuse was off for it: the static capture stamped {stamped} block(s) for {len(captured)} captured."
    try:
        general, _ = _prepare(model, user, options, reference=run.reference, proposal=proposal, tries=tries)
    except Exception as err:  # noqa: BLE001 - the static graph stands; why the other did not is said
        get_report(gm).note(f"Prepared again with dimension 0 of the inputs declared dynamic, not kept: "
                            f"{type(err).__name__}: {first_line(err)}")
        return gm
    before = [n for n in get_report(gm).notes if n.startswith("Shape-general capture")]  # why the first try was static
    get_report(general).note(f"The static-shape capture baked the example's batch into the graph ({proposal.describe()}): "
                             f"captured again with it declared dynamic.{off}" + "".join(f" Before that: {n}" for n in before))
    return general


def _prepare(model: nn.Module, user: UserArguments, options: dict[str, Any], not_general: str | None = None,
             reference: Reference | None = None, proposal: autodims.Proposal | None = None,
             static_fallback: bool | None = None, tries: list[float] | None = None
             ) -> tuple[fx.GraphModule, Preparation]:
    """The stages of ``prepare_model``, in order; each is a function of the preparation ``run``.
    ``reference``: the original's run on the example from an attempt before. ``proposal``: the
    dimensions to capture with, and by default no static fallback (:func:`_batch_general`). ``tries``
    gets the seconds this attempt took, kept or not."""
    began = time.perf_counter()
    try:
        run = _start(model, user, options)
        run.proposal = proposal
        run.static_fallback = proposal is None if static_fallback is None else static_fallback
        _reference_run(run, reference)
        try:
            return _stages(run, not_general), run
        except shape_general.NotShapeGeneral as err:
            err.reference, err.narrower = run.reference, run.proposal.narrower if run.proposal is not None else None
            raise
    finally:
        if tries is not None:
            tries.append(time.perf_counter() - began)


def _stages(run: Preparation, not_general: str | None) -> fx.GraphModule:
    """What follows the reference run, in order (see :func:`_prepare`)."""
    _propose_shapes(run, not_general)
    t1 = time.perf_counter()
    run.result = _capture(run)
    run.report.timings["capture"] = time.perf_counter() - t1
    gm = _captured_module(run)
    t2 = time.perf_counter()
    _passes(run, gm)
    _guard_inputs(run, gm)
    run.report.timings["passes"] = time.perf_counter() - t2
    verification(run, gm)
    return _finish(run, gm)


def _start(model: nn.Module, user: UserArguments, options: dict[str, Any]) -> Preparation:
    """Check the arguments and make the capture request: the model (a deep copy with ``copy=True``),
    its leaf policy, the example, the concrete arguments (transformers' own added) and the options."""
    start = time.perf_counter()
    model = check_model(model)
    opts = PrepareOptions.from_kwargs(options)
    modules_to_exclude = user.modules_to_exclude
    if opts.copy:
        model, modules_to_exclude = _independent_copy(model, modules_to_exclude)
    policy = leaf_policy(model, modules_to_exclude, user.module_classes_to_exclude)
    example = normalize_example_inputs(user.example_inputs)
    user_concrete = check_concrete_args(model, user.concrete_args)
    concrete = huggingface.capture_concrete_args(model, user_concrete, example)
    report = Report(opts.name or type(model).__name__)
    report.inputs = example.describe() if example is not None else "none"
    absent = huggingface.absent_outputs(user_concrete, concrete)  # past_key_values, with use_cache=False added
    if absent:
        report.note(huggingface.CACHE_OFF_NOTE)
    concrete = defaults_as_concrete(model, example, concrete, report)
    request = CaptureRequest(
        model, policy, example, concrete, autowrap_functions=opts.autowrap_functions, dynamic=opts.dynamic,
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


def _propose_shapes(run: Preparation, not_general: str | None) -> None:
    """Without ``dynamic=``, propose the shape-general dimensions (a transformers model's batch and
    sequence: :mod:`fxprep.capture.shape_general`); with it, check it against the example (grown where a size is below 2)."""
    opts, request = run.opts, run.request
    if run.proposal is None and opts.dynamic is not False and request.example is not None and opts.tracer != Route.FX \
            and (opts.control_flow is None or opts.dynamic is None) and dynamo_available():
        run.proposal = (autodims.propose(run.model, request.example) if opts.dynamic is None
                        else autodims.declared(run.model, request.example, opts.dynamic))
    if opts.dynamic and request.example is not None:
        grown = run.proposal.capture_example if run.proposal is not None and run.proposal.explicit else None
        check_dynamic_inputs(request if grown is None else request.replace(example=grown), opts.dynamic)
    if not_general:
        run.report.note(shape_general.not_kept_note(not_general))


def _capture(run: Preparation) -> CaptureResult:
    """The capture: the tracers in order (with the control-flow rewrite, or shape-general first),
    then the opaque-leaf fallback; raises the located failure when nothing captures the model."""
    opts, report = run.opts, run.report
    tracers, note = cascade.plan(opts.tracer, run.request.example, run.model)
    if note:
        report.note(note)
    with GLOBAL_LOCK:  # capture patches process-wide state: one thing at a time (fxprep.core.threads)
        run.rewrite = rewrite = _control_flow(run)
        if rewrite is not None:  # control_flow="rewrite": data-dependent ifs rewritten, site by site
            static = run.request if run.proposal is None else run.request.replace(dynamic=False)
            result, attempts = rewrite.capture(lambda: cascade.capture(static, tracers))
            if run.proposal is not None:
                result, attempts = _general_after_rewrite(run, rewrite, tracers, result, attempts)
        elif run.proposal is not None:  # proposed only with an example
            result, attempts = _capture_general(run, tracers, static_fallback=run.static_fallback)
        else:
            result, attempts = cascade.capture(run.request, tracers)
        sites: list[Any] = []
        if result is None and opts.fallback == "leaf":  # Dynamo again with the failing parts opaque, then fx
            with rewrite.bound() if rewrite is not None else contextlib.nullcontext():
                handled = rewrite.learn if rewrite is not None else None
                result, sites = cascade.capture_with_opaque_parts(run.request.replace(handled=handled), attempts,
                                                                  fx_too=opts.tracer != Route.DYNAMO)
        if run.elsewhere is not None:
            result, sites = _fallback_general(run, attempts, result, sites)
        run.dynamic = run.proposal.dynamic if run.proposal is not None else run.request.dynamic
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
    with preserved_state(model):
        values.annotate(gm, run.prepared_call)
    if opts.convert_functionals:
        functional_to_module.run(gm, training=model.training, original=model, report=report, recompile=False)
    branches.run(gm, training=model.training, report=report, original=model, convert=opts.convert_functionals,
                 unroll=opts.unroll, share_parameters=opts.share_parameters)  # inside torch.cond branches
    if opts.unroll:
        unroll.run(gm, share_parameters=opts.share_parameters, original=model, report=report, recompile=False)
    if opts.style == "aimet":
        aimet_modules.run(gm, report=report)
        aimet_names.run(gm, original=model, report=report)
    if opts.share_parameters:
        state_dict.restore(gm, model)  # the owner's raw parameters back in place, for owner_names
    if opts.convert_functionals and opts.style != "aimet":  # AIMET's names are module_<node> for every added layer
        owner_names.run(gm, original=model, report=report)
    if opts.share_parameters:
        state_dict.record_aliases(gm, model)  # after every pass that moves modules
    finish.match_modes(gm, model)
    finish.restore_output_type(gm, None if run.reference is None else run.reference.output)
    decisions.keep_locations(gm)
    gm.recompile()  # once, after every pass (generating the code is a large part of the cost)


def _finish(run: Preparation, gm: fx.GraphModule) -> fx.GraphModule:
    """The report completed and attached, the original remembered (for ``load_weights`` and
    ``verify_prepared``), fxprep's module classes registered with the toolkits imported."""
    report, result = run.report, run.result
    assert result is not None
    if run.rewrite is not None:
        run.rewrite.report(report, result.extra_leaves, result.tracer)
    report.timings["total"] = time.perf_counter() - run.start
    set_preserved(gm, REPORT, report)
    remember_original(gm, run.model, run.request.concrete_args)  # for fxprep.load_weights / verify_prepared
    register_with_toolkits()
    return gm


def register_with_toolkits() -> None:
    """Register fxprep's module classes with the quantization toolkits already imported, so the
    prepared module goes straight into them (AIMET QuantSim: :mod:`fxprep.compat.aimet_quantsim`).
    A toolkit that is not imported is not imported here: that would cost seconds."""
    if sys.modules.get("aimet_torch") is not None:
        from .compat.aimet_quantsim import register

        register()


def _control_flow(run: Preparation) -> Any:
    """The control-flow rewrite session when ``control_flow="rewrite"``, else None."""
    if run.opts.control_flow != "rewrite":
        return None
    from .capture.rewrite.session import ControlFlowRewrite

    extra = [e for e in (normalize_example_inputs(v) for v in run.opts.verify_inputs) if e is not None]
    request = run.request
    return ControlFlowRewrite(request.model, request.example, extra, request.concrete_args,
                              None if run.absent or run.reference is None else run.reference.output)


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
    if call is None and tracer.dynamo:  # captured on inputs built from a transformers config
        built = cascade.dynamo_call(model, None)
        call = split_calls(model, built, concrete)[1] if built is not None else None
    if call is not None:
        dims: dict[str, set[int]] = {}
        if run.dynamic and tracer.dynamo:
            from .capture.dynamo import dynamic_dims

            named = dynamic_dims(model, call, run.dynamic)
            given = {**dict(zip(inspect.signature(gm.forward).parameters, call.args)), **call.kwargs}
            for name, spec in named.items():
                value = given.get(name)
                rank = value.dim() if isinstance(value, torch.Tensor) else 0
                dims[name] = {d % rank for d in spec} if rank else set()
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


def _capture_general(run: Preparation, tracers: list[str], *, static_fallback: bool
                     ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
    """The shape-general capture (:func:`shape_general.capture`: Dynamo alone, with the proposal's
    dimensions); when it fails, the static-shape capture as before, said in the report (the reference
    run is kept), or :class:`~.capture.shape_general.NotShapeGeneral` without ``static_fallback``.
    ``run.proposal`` becomes the proposal kept (None when static) and ``run.request`` the request
    the capture used."""
    request, proposal = run.request, run.proposal
    assert proposal is not None and request.example is not None

    def capture_at(call: ExampleInputs, dims: Any, opaque: list[Any], search: bool
                   ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
        return cascade.capture(request.replace(example=call, dynamic=dims, opaque=tuple(opaque), scan_search=search),
                               [Route.DYNAMO])

    try:
        result, attempts, found = shape_general.capture(request.model, request.example, proposal, capture_at,
                                                        scans_of=shape_general.scans_finder(request))
        run.proposal = shape_general.limits(request.model, found, request.replace(example=found.capture_example).calls()[0])
        if run.proposal.explicit and run.proposal.limits:  # the tracers as asked: an opaque part takes both ways
            raise shape_general.NotShapeGeneral("a branch of the model's code bounds them")
        return result, attempts
    except shape_general.NotShapeGeneral as err:
        if proposal.explicit:  # the user's dimensions: the tracers as asked, as before (Dynamo not twice)
            run.proposal, done = None, err.elsewhere.attempts if err.elsewhere is not None else []
            result, attempts = cascade.capture(request, [t for t in tracers if t != Route.DYNAMO] if done else tracers)
            return result, done + attempts
        if not static_fallback:
            raise
        run.proposal = None
        run.request = request.replace(dynamic=False)
        result, attempts = cascade.capture(run.request, tracers)
        if result is None and err.elsewhere is not None:  # the static fallback, then maybe with the dimensions
            run.elsewhere = (err.elsewhere, str(err))
        else:
            run.report.note(shape_general.not_kept_note(str(err)))
        return result, attempts


def _general_after_rewrite(run: Preparation, rewrite: Any, tracers: list[str], result: CaptureResult | None,
                           attempts: list[CaptureAttempt]) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
    """``control_flow="rewrite"`` with the shape-general proposal. The sites are found and rewritten
    on static shapes (each round is a capture, and a failure's cause is plainest there); the model
    with the plan found is then captured once more with the proposal's dimensions
    (:func:`_capture_general`), kept when Dynamo captures it whole. Otherwise the static capture
    stands and the report says why, or, without a static fallback, :class:`NotShapeGeneral` is raised."""
    if result is None or result.tracer != Route.DYNAMO:
        why = ("with the control-flow rewrite, Dynamo did not capture the model as one graph on static shapes "
               f"({result.tracer if result is not None else 'no capture'}), so its dimensions were not declared")
    else:
        try:
            with rewrite.bound():
                general, more = _capture_general(run, tracers, static_fallback=False)
            return general, attempts + more
        except shape_general.NotShapeGeneral as err:
            why = str(err)
    if not run.static_fallback:
        raise shape_general.NotShapeGeneral(why)
    run.proposal = None
    run.report.note(shape_general.not_kept_note(why))
    return result, attempts


def _fallback_general(run: Preparation, attempts: list[CaptureAttempt], result: CaptureResult | None,
                      sites: list[Any]) -> tuple[CaptureResult | None, list[Any]]:
    """The static fallback's capture, or the shape-general one :func:`shape_general.after_fallback` takes."""
    assert run.elsewhere is not None
    (elsewhere, why), run.elsewhere = run.elsewhere, None
    general = run.request.replace(dynamic=None)
    result, sites, kept = shape_general.after_fallback(general, elsewhere, why, attempts, result, sites, run.report)
    if kept is not None:
        run.proposal = shape_general.limits(run.model, kept, general.replace(example=kept.capture_example).calls()[0])
        run.request = general
    return result, sites
