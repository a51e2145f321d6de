"""``prepare_model``: capture cascade → passes → verify → report.

This module only orchestrates; every step lives in its own module and can be used alone.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import sys
import time
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import batch, decisions, guard, heap, progress, shape_general
from .arguments import check_concrete_args, check_model, defaults_as_concrete, leaf_policy
from .capture import cascade, dynamo_available, huggingface
from .capture.common import CaptureAttempt, CaptureResult, LeafPolicy
from .capture.dynamo import autodims, grown_example
from .capture.fx import mode_notes, trace_failure
from .capture.rewrite import branches
from .errors import EquivalenceError, InputMismatch, InvalidInput
from .inputs import ExampleInputs, normalize_example_inputs, split_calls
from .options import PrepareOptions
from .passes import aimet_modules, aimet_names, functional_to_module, owner_names, state_dict, unroll, values
from .prepared import BAKED, INPUT_SPEC, REPORT, as_prepared, set_preserved
from .report import Report, Verification
from .runs import hooks_left_as_found, preserved_state
from .threads import GLOBAL_LOCK
from .verify import run_original, verify
from .weights import remember_original


def _tracers(opts: PrepareOptions, example: ExampleInputs | None, report: Report,
             model: nn.Module) -> list[str]:
    tracers, note = cascade.plan(opts.tracer, example, model)
    if note:
        report.note(note)
    return tracers


def capture(
    model: nn.Module,
    tracers: list[str],
    policy: LeafPolicy,
    concrete_args: dict[str, Any] | None,
    example: ExampleInputs | None,
    opts: PrepareOptions,
) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
    """Run the tracers in order until one succeeds (:func:`fxprep.capture.cascade.capture`)."""
    return cascade.capture(model, tracers, policy, concrete_args, example,
                           autowrap_functions=opts.autowrap_functions, dynamic=opts.dynamic,
                           # block reuse stays off while control-flow sites are rewritten (their methods are
                           # bound to single instances for the capture)
                           reuse=opts.reuse_blocks and opts.control_flow is None,
                           block_pass=_block_conversion(model, opts))


def _block_conversion(model: nn.Module, opts: PrepareOptions) -> Any:
    """The functional-to-module pass for each repeated block, run once before the block is stamped
    out (with block reuse): converting an 80-layer LLM node by node on the whole graph cost ~0.25 s
    of a 2 s prepare. It is the pass :func:`_prepare` runs on the whole graph, which then reports
    these modules and converts the rest."""
    if not opts.convert_functionals:
        return None

    def convert(block: fx.GraphModule, first: nn.Module) -> None:
        values.annotate(block)
        functional_to_module.run(block, training=model.training, original=first, recompile=False)

    return convert


def _restore_output_type(gm: fx.GraphModule, reference: Any) -> None:
    """fx returns the dict literal it traced; a model returning an ``OrderedDict`` (torchvision
    segmentation) must still return one, so the output is wrapped in the original's type."""
    if type(reference) is not collections.OrderedDict:
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    if isinstance(value, dict):  # fx stores it as its immutable_dict
        value = dict(value)
        with gm.graph.inserting_before(output):
            wrapped = gm.graph.call_function(collections.OrderedDict, (value,))
        wrapped.meta["fxprep_kind"] = "other"
        output.args = (wrapped,)


def _match_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give modules fxprep created the training flag of the scope they came from; the user's own
    module objects are left exactly as they are (setting gm.train() would flip them)."""
    originals = {id(m) for m in model.modules()}
    scopes = dict(model.named_modules(remove_duplicate=False))
    gm.training = model.training
    for name, module in gm.named_modules():
        if id(module) in originals or module is gm:
            continue
        scope = name
        mode = model.training
        while scope:
            scope = scope.rpartition(".")[0]
            if scope in scopes:
                mode = scopes[scope].training
                break
        if "." not in name:
            mode = model.training
        module.training = mode


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
    title = str(options.get("name") or type(model).__name__)
    with heap.frozen_heap(), progress.reporting(options.get("progress"), title), \
            hooks_left_as_found(model), huggingface.output_capturing_hooks(model):
        try:
            return _prepare(model, modules_to_exclude, module_classes_to_exclude, concrete_args, example_inputs, options)
        except shape_general.NotShapeGeneral as err:  # found dimensions did not hold: static shapes, as before
            return _prepare(model, modules_to_exclude, module_classes_to_exclude, concrete_args, example_inputs,
                            {**options, "dynamic": False}, not_general=str(err))


def _prepare(model: nn.Module, modules_to_exclude: Any, module_classes_to_exclude: Any, concrete_args: Any,
             example_inputs: Any, options: dict[str, Any], not_general: str | None = None) -> fx.GraphModule:
    t0 = time.perf_counter()
    model = check_model(model)
    opts = PrepareOptions.from_kwargs(options)
    if opts.copy:
        model, modules_to_exclude = _independent_copy(model, modules_to_exclude)
    policy = leaf_policy(model, modules_to_exclude, module_classes_to_exclude)
    example = normalize_example_inputs(example_inputs)
    user_concrete = check_concrete_args(model, concrete_args)
    concrete = huggingface.capture_concrete_args(model, user_concrete, example)
    report = Report(opts.name or type(model).__name__)
    report.inputs = example.describe() if example is not None else "none"
    absent = huggingface.absent_outputs(user_concrete, concrete)  # past_key_values, with use_cache=False added
    if absent:
        report.note(huggingface.CACHE_OFF_NOTE)

    concrete = defaults_as_concrete(model, example, concrete, report)
    reference = reference_state = None
    original_call = prepared_call = example
    if example is not None:
        # the original is verified as the user calls it (use_cache as given, or its default)
        original_call = split_calls(model, example, huggingface.without_added(concrete, absent))[0]
        prepared_call = split_calls(model, example, concrete)[1]
        if opts.verify:  # the reference run doubles as the check that the inputs suit the model
            progress.stage("reference run")
            reference, reference_state = run_original(model, original_call)

    if opts.dynamic and example is not None:
        _check_dynamic_inputs(model, example, concrete, opts.dynamic)
    proposal = None  # shape-general by default: a transformers model's batch and sequence dims (fxprep.shape_general)
    if opts.dynamic is None and example is not None and opts.tracer != "fx" and opts.control_flow is None \
            and dynamo_available():
        proposal = autodims.propose(model, example)
    if not_general:
        report.note(shape_general.not_kept_note(not_general))
    t1 = time.perf_counter()
    tracers = _tracers(opts, example, report, model)
    with GLOBAL_LOCK:  # capture patches process-wide state: one thread at a time (fxprep.threads)
        rewrite = _control_flow(model, opts, example, concrete, None if absent else reference)
        if rewrite is not None:  # control_flow="rewrite": data-dependent ifs rewritten, site by site
            result, attempts = rewrite.capture(lambda: capture(model, tracers, policy, concrete, example, opts))
        elif proposal is not None and example is not None:  # proposed only with an example
            result, attempts, proposal, opts = _capture_general(model, tracers, policy, concrete, example, opts,
                                                                proposal, report)
        else:
            result, attempts = capture(model, tracers, policy, concrete, example, opts)
        dynamic = proposal.dynamic if proposal is not None else opts.dynamic
        sites: list[Any] = []
        if result is None and opts.fallback == "leaf":  # Dynamo again with the failing parts opaque, then fx
            with rewrite.bound() if rewrite is not None else contextlib.nullcontext():
                result, sites = cascade.capture_with_opaque_parts(
                    model, policy, concrete, example, attempts, fx_too=opts.tracer != "dynamo", dynamic=opts.dynamic,
                    autowrap_functions=opts.autowrap_functions, handled=rewrite.learn if rewrite is not None else None)
    report.issues.extend(issue for _, issue in sites)
    if result is not None and sites and result.tracer.startswith("dynamo"):
        report.note(
            f"{len(sites)} part(s) could not be captured by Dynamo and run eagerly as opaque calls (see 'kept as "
            f"leaves'); their outputs were recorded from the example inputs: sizes that followed the data stay "
            f"symbolic, but Python values they return (ints, list lengths, None-ness) are the example's, so "
            f"inputs giving different ones need verify_inputs=[...] to be checked."
        )
    elif result is not None and sites:
        report.note(
            f"{len(sites)} part(s) could not be traced and run eagerly as opaque calls (see 'kept as "
            f"leaves'); their output structure (list lengths, None-ness) was recorded from the example "
            f"inputs, so inputs giving a differently-structured result need verify_inputs=[...] to be checked."
        )
    report.attempts = attempts
    report.timings["capture"] = time.perf_counter() - t1
    if result is None:
        failure = trace_failure(attempts, model)
        if rewrite is not None:
            failure.args = (f"{failure.args[0]}\n\n{rewrite.explain()}",)
        raise failure
    for attempt in attempts:  # a failed tracer's error holds its frames (fake tensors, globals): not kept alive
        attempt.exception = None
    gm = as_prepared(result.gm, compiled=False)  # recompiled once, after the passes
    report.tracer = result.tracer
    report.leaves.update(result.extra_leaves)
    reuse = gm.meta.get("fxprep_reuse")
    if reuse is not None:
        report.reuse = reuse.to_dict()
    for note in result.notes:
        report.note(note)
    for note in mode_notes(gm, model):
        report.note(note)
    if result.tracer.startswith("dynamo") and not dynamic and example is not None:
        report.note(
            f"Dynamo captured with static shapes: the graph is valid for inputs shaped like the example "
            f"({example.describe()}). Pass dynamic=... (or tracer='fx') to run it on other sizes."
        )

    t2 = time.perf_counter()
    progress.stage("passes")
    with preserved_state(model):
        values.annotate(gm, prepared_call)
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
        state_dict.run(gm, model)
    if opts.convert_functionals and opts.style != "aimet":  # AIMET's names are module_<node> for every added layer
        # after state_dict: it puts the owner's raw parameters back in place
        if owner_names.run(gm, original=model, report=report) and opts.share_parameters:
            state_dict.refresh_aliases(gm, model)  # the aliases of moved modules move with them
    _match_modes(gm, model)
    _restore_output_type(gm, reference)
    decisions.keep_locations(gm)
    gm.recompile()  # once, after every pass (generating the code is a large part of the cost)
    _guard_inputs(gm, model, result.tracer, prepared_call, concrete, dynamic, report,
                  shape_general.specialised_reasons(proposal))
    decided = decisions.summary(gm)
    if decided:
        report.note(
            f"The graph reads values from data (.item(), .tolist(), sizes from tensors) at {len(decided)} place(s) of the "
            f"model's code; what the capture took from the example's values there is checked on every call (an input "
            f"deciding otherwise raises InputMismatch): " + "; ".join(decided))
    report.timings["passes"] = time.perf_counter() - t2

    where_rewrite = rewrite is not None and rewrite.joins_with_where
    if example is not None and opts.verify:
        t3 = time.perf_counter()
        progress.stage("verification")
        assert original_call is not None
        try:
            report.verification = verify(
                model, gm, original_call, reference=reference, reference_state=reference_state,
                prepared_example=prepared_call, rtol=opts.rtol, atol=opts.atol, grad=opts.verify == "grad",
                where_rewrite=where_rewrite, absent=absent,
            )
        except (EquivalenceError, InputMismatch) as err:
            if proposal is None:
                raise
            raise shape_general.NotShapeGeneral(f"the graph captured at {proposal.capture_example.describe()} "
                                                f"did not match on the example: {str(err).splitlines()[0][:200]}") from err
        _note_state(report, report.verification)
        spec = gm.__dict__.get(INPUT_SPEC)
        if spec is not None and result.tracer.split("+")[0] == "dynamo" and not dynamic:
            progress.step("other batch sizes")
            batch.probe(model, gm, spec, example, lambda e: (split_calls(model, e, huggingface.without_added(concrete, absent))[0],
                                                             split_calls(model, e, concrete)[1]),
                        report, opts.rtol, opts.atol, absent, captured=lambda e: split_calls(model, e, concrete)[0])
        if proposal is not None:
            _verify_general(model, gm, example, concrete, opts, report, absent, proposal)
        elif dynamic:
            second = grown_example(model, example, dynamic)
            checked = _verify_second_size(model, gm, second, concrete, opts, report, absent)
            report.note(f"verified on {_second_size(second)}: max |diff| = {checked.max_abs_diff:.3g}")
        constructed = rewrite.coverage() if rewrite is not None else []
        for i, (label, extra) in enumerate([(None, e) for e in opts.verify_inputs] + constructed):
            progress.step(label or f"verify_inputs[{i}]")
            extra_example = normalize_example_inputs(extra)
            assert extra_example is not None
            extra_original = split_calls(model, extra_example, huggingface.without_added(concrete, absent))[0]
            extra_prepared = split_calls(model, extra_example, concrete)[1]
            try:
                checked = verify(
                    model, gm, extra_original, prepared_example=extra_prepared, what=label or f"verify_inputs[{i}]",
                    rtol=opts.rtol, atol=opts.atol, grad=opts.verify == "grad", where_rewrite=where_rewrite, absent=absent,
                )
            except InputMismatch as err:  # the graph cannot serve this input: a verification failure
                raise EquivalenceError(f"{label or f'verify_inputs[{i}]'}: the prepared module refuses it, {err}") from err
            checked.label = label or ""
            report.extra_verifications.append(checked)
            _note_state(report, checked)
        report.timings["verify"] = time.perf_counter() - t3
    elif example is None:
        report.verification = Verification("skipped", detail="no example_inputs given")
    else:
        report.verification = Verification("skipped", detail="verify=False")
        if proposal is not None:
            shape_general.notes(report, proposal, None)
    if rewrite is not None:
        rewrite.report(report, result.extra_leaves, result.tracer)
    report.timings["total"] = time.perf_counter() - t0
    set_preserved(gm, REPORT, report)
    remember_original(gm, model, concrete)  # for fxprep.load_weights / verify_prepared
    register_with_toolkits()
    return gm


def _note_state(report: Report, verification: Verification) -> None:
    """State the original's forward updates and the prepared module does not: said loudly."""
    names = verification.state_not_reproduced
    if names:
        shown = ", ".join(names[:8]) + ("..." if len(names) > 8 else "")
        report.note(
            f"WARNING: state not reproduced: a call of the original leaves {shown} other than a call of the "
            f"prepared module does (a counter or running value the original's forward updates and the graph "
            f"does not, or the reverse). Outputs matched on this call; later calls may not."
        )


def register_with_toolkits() -> None:
    """Register fxprep's module classes with the quantization toolkits already imported, so the
    prepared module goes straight into them (AIMET QuantSim: :mod:`fxprep.compat.aimet_quantsim`).
    A toolkit that is not imported is not imported here: that would cost seconds."""
    if sys.modules.get("aimet_torch") is not None:
        from .compat.aimet_quantsim import register

        register()


def _control_flow(model: nn.Module, opts: PrepareOptions, example: ExampleInputs | None,
                  concrete: dict[str, Any] | None, reference: Any) -> Any:
    """The control-flow rewrite session when ``control_flow="rewrite"``, else None."""
    if opts.control_flow != "rewrite":
        return None
    from .capture.rewrite.session import ControlFlowRewrite

    extra = [e for e in (normalize_example_inputs(v) for v in opts.verify_inputs) if e is not None]
    return ControlFlowRewrite(model, example, extra, concrete, reference)


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


def _guard_inputs(gm: fx.GraphModule, model: nn.Module, tracer: str, call: ExampleInputs | None,
                  concrete: dict[str, Any] | None, dynamic: Any, report: Report,
                  why: dict[str, dict[int, str]] | None = None) -> None:
    """Record the inputs ``gm`` was captured for, and the values it took from the model's attributes
    and globals; each call is checked against them (fxprep.guard)."""
    baked = guard.record_baked(gm, model)
    if len(baked):
        setattr(gm, BAKED, baked)  # not preserved by a copy: a copy no longer shares the user's modules
        report.note(f"The prepared module checks at each call that the {len(baked)} Python value(s) its graph took "
                    f"from the model's attributes and globals are unchanged ({', '.join(baked.names()[:4])}"
                    f"{', ...' if len(baked) > 4 else ''}) and raises InputMismatch otherwise: the graph holds them "
                    f"as constants.")
    tracer = tracer.split("+")[0]  # dynamo+leaves: Dynamo's rules (static shapes) with opaque parts
    if call is None and tracer == "dynamo":  # captured on inputs built from a transformers config
        built = cascade.dynamo_call(model, None)
        call = split_calls(model, built, concrete)[1] if built is not None else None
    if call is None:
        return
    dims: dict[str, set[int]] = {}
    if dynamic and tracer == "dynamo":
        from .capture.dynamo import dynamic_dims

        named = dynamic_dims(model, call, dynamic)
        values = {**dict(zip(inspect.signature(gm.forward).parameters, call.args)), **call.kwargs}
        for name, spec in named.items():
            value = values.get(name)
            rank = value.dim() if isinstance(value, torch.Tensor) else 0
            dims[name] = {d % rank for d in spec} if rank else set()
    spec = guard.record(gm, call.args, call.kwargs, tracer, dims, why)
    if spec is not None:
        set_preserved(gm, INPUT_SPEC, spec)
        if tracer == "dynamo" and any(n.get("kind") == "tensor" and None not in (n.get("shape") or [None])
                                      for n in spec.params.values()):
            report.note("The prepared module checks every call against the inputs it was captured for (structure, "
                        "None-ness and, where Dynamo specialised them, shapes) and raises InputMismatch otherwise.")


def _check_dynamic_inputs(model: nn.Module, example: ExampleInputs, concrete: dict[str, Any] | None, dynamic: Any) -> None:
    """``dynamic`` must name inputs and dimensions the example has, before minutes of capturing (a
    wrong one would otherwise only make the Dynamo capture fail, and fx be used instead)."""
    from .capture.dynamo import dynamic_shapes_spec

    try:
        dynamic_shapes_spec(model, split_calls(model, example, concrete)[0], dynamic)
    except ValueError as err:
        raise InvalidInput(f"dynamic={dynamic!r} does not fit the example inputs ({example.describe()}): {err}.") from err


def _capture_general(model: nn.Module, tracers: list[str], policy: LeafPolicy, concrete: dict[str, Any] | None,
                     example: ExampleInputs, opts: PrepareOptions, proposal: autodims.Proposal, report: Report,
                     ) -> tuple[CaptureResult | None, list[CaptureAttempt], autodims.Proposal | None, PrepareOptions]:
    """The shape-general capture (:func:`shape_general.capture`: Dynamo alone, with ``proposal``'s
    dimensions); when it fails, the static-shape capture as before, said in the report (the reference
    run is kept). Returns the capture, the proposal kept (None when static) and the options it used."""

    def run(call: ExampleInputs, dims: Any) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
        return capture(model, ["dynamo"], policy, concrete, call, shape_general.with_dynamic(opts, dims))

    try:
        result, attempts, kept = shape_general.capture(model, example, proposal, run)
        return result, attempts, kept, opts
    except shape_general.NotShapeGeneral as err:
        report.note(shape_general.not_kept_note(str(err)))
        static = shape_general.with_dynamic(opts, False)
        result, attempts = capture(model, tracers, policy, concrete, example, static)
        return result, attempts, None, static


def _verify_general(model: nn.Module, gm: fx.GraphModule, example: ExampleInputs, concrete: dict[str, Any] | None,
                    opts: PrepareOptions, report: Report, absent: dict[str, str], proposal: autodims.Proposal) -> None:
    """A shape-general capture checked on a second size (batch and sequence 3 larger): the proof that
    lets calls at other sizes through; a failure means static shapes (:class:`shape_general.NotShapeGeneral`)."""
    second = grown_example(model, example, proposal.dynamic, grow=3)
    try:
        result = _verify_second_size(model, gm, second, concrete, opts, report, absent)
    except Exception as err:  # noqa: BLE001 - any failure at another size: the dims did not hold
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise shape_general.NotShapeGeneral(f"at {_second_size(second)}: {type(err).__name__}: {first}") from err
    shape_general.notes(report, proposal, f"{second.describe()} (max |diff| {result.max_abs_diff:.3g})")


def _second_size(second: ExampleInputs) -> str:
    return f"a second input size ({second.describe()})"


def _verify_second_size(model: nn.Module, gm: fx.GraphModule, second: ExampleInputs, concrete: dict[str, Any] | None,
                        opts: PrepareOptions, report: Report, absent: dict[str, str]) -> Verification:
    """The prepared module checked against the original on ``second`` (the example grown in its
    dynamic dimensions: :func:`fxprep.capture.dynamo.grown_example`); raises EquivalenceError where
    they differ."""
    label = _second_size(second)
    progress.step(label)
    original_call = split_calls(model, second, huggingface.without_added(concrete, absent))[0]
    prepared_call = split_calls(model, second, concrete)[1]
    result = verify(model, gm, original_call, prepared_example=prepared_call, what=label,
                    rtol=opts.rtol, atol=opts.atol, grad=opts.verify == "grad", absent=absent)
    _note_state(report, result)
    return result


def get_report(gm: nn.Module) -> Report:
    """The :class:`Report` of a module returned by :func:`prepare_model`."""
    report = getattr(gm, REPORT, None)
    if not isinstance(report, Report):
        raise InvalidInput("this module was not produced by fxprep.prepare_model (it has no fxprep report).")
    return report
