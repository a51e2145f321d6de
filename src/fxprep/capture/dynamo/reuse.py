"""Block reuse: each repeated block captured once, its graph stamped out for the other instances.

Dynamo re-traces every decoder layer of an LLM although they are all one class, so capture time
grows with depth. Here the model is captured once with its repeated blocks as single calls
(:mod:`.stubs`), the calls are grouped by signature, inputs and guards (:mod:`.blocks`), one member
of each group is captured on its own, and its graph is stamped out for the others (:mod:`.stamp`).
:func:`capture_reusing` returns None when there is nothing to reuse or a step fails (the reason
noted), and the caller captures the whole model.

See docs/concepts/block-reuse.md ("Under the hood") for the steps, dynamic shapes, values and opaque
parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...reporting.diagnose import first_line, stopped_at_data_guard
from ..common import LeafPolicy
from ..request import ScanStop
from ..sites import OpaqueFunction, OpaqueMethod
from . import early_limit, guard_log
from .block_calls import Member, block_call, block_spec, decided_otherwise, record_inputs
from .blocks import (
    beside_parts,
    groups_apart_from,
    guard_differences,
    guard_key,
    held_part,
    input_key,
    leaf_hook_guards,
    self_guards,
    structure_whys,
)
from .export import MUTATED_INPUT_DICT, AttributeGuard, dynamo_export, quiet_guard_logs
from .opaque import BlackBox
from .relift import ROUTE_META, LiftTarget, follow_input_device, relift
from .stamp import (
    Stamper,
    StampError,
    block_output_signature,
    converted_block,
    foreign_attributes,
    modules_not_of,
    names_free,
)
from .stubs import OtherOutput, Stubs
from .tied import disproof

BlockPass = Callable[[fx.GraphModule, nn.Module], Any]  # (block graph, its first instance) -> rewritten in place
REUSE_META = "fxprep_reuse"


@dataclass
class ReuseInfo:
    """What block reuse did, for the report: each block captured, the instances its graph was
    stamped out for, and why a block was captured rather than stamped from an earlier capture."""

    captured: dict[str, list[str]] = field(default_factory=dict)  # captured instance -> stamped for
    why: dict[str, str] = field(default_factory=dict)  # captured instance -> why it has its own capture

    def notes(self) -> list[str]:
        reused = {k: v for k, v in self.captured.items() if v}
        out = []
        if reused:
            total = sum(len(v) for v in reused.values())
            parts = [f"'{k}' for {_names(v)}" for k, v in reused.items()]
            out.append(f"block reuse: {len(reused)} block(s) captured once and stamped out for {total} other "
                       f"instance(s) running the same code: {'; '.join(parts)}.")
        for name, why in self.why.items():
            out.append(f"block reuse: '{name}' was captured on its own: {why}.")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"captured": {k: list(v) for k, v in self.captured.items()}, "why": dict(self.why)}


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])}, ... {names[-1]} ({len(names)})"


def _export_block(first: Member, call: ExampleInputs, job: ReuseJob, spec: dict[str, Any] | None,
                  fallback: dict[str, Any] | None) -> tuple[Any, ExampleInputs]:
    """Dynamo's capture of ``first`` alone on ``call`` with ``spec``'s dynamic dimensions, retried
    with ``fallback``'s (the declared ones alone) when those differ and the first fails; and the call
    it was made on."""
    # sizes made from values read from data alone may be fixed by the block itself (Qwen2-VL's
    # vision blocks split by cu_seqlens): a failure with them dynamic is retried with the declared
    # dimensions alone (static shapes where none reaches the block), and the stand-in's output in
    # the outer graph says whether that graph holds there
    retried = spec is not None and spec != fallback
    if job.box:
        job.box.rewind()  # the block's own opaque parts: their calls are counted from its first
    try:
        with quiet_guard_logs() if retried else contextlib.nullcontext():
            return dynamo_export(first.module, call, job.target.route, spec, real_values=job.real_values), call
    except Exception:
        if not retried:
            raise
    job.guard.reset()
    if job.box:
        job.box.rewind()
    call = call.fresh_copy(keep_strides=True)  # new tensors: the first attempt marked these dynamic
    return dynamo_export(first.module, call, job.target.route, fallback, real_values=job.real_values), call


@dataclass
class _Captured:
    members: list[Member]
    gm: fx.GraphModule
    extra: dict[str, str]
    notes: list[str]
    parts: dict[str, nn.Module]  # the modules calling opaque methods and functions, by target (:func:`_opaque_parts`)


@dataclass
class ReuseJob:
    """One whole-model capture with block reuse (:func:`capture_reusing`)."""

    target: LiftTarget  # the model, its policy, its capture and prepared calls, the route, the notes
    call: ExampleInputs  # what Dynamo is called with (the capture call, inputs maybe requiring grad)
    guard: AttributeGuard  # puts back what Dynamo leaves in the attributes forward() writes
    # run once on each repeated block's graph before it is stamped out (the caller's pass on the whole graph)
    convert: BlockPass | None = None
    # the model's dynamic dimensions (Dynamo's ``dynamic_shapes``); None: static shapes
    dynamic_spec: dict[str, Any] | None = None
    # the parts Dynamo calls without tracing into (excluded or opaque modules): kept out of the blocks
    box: BlackBox | None = None
    # values read from data are decided from the example's (:mod:`.values`), in the outer and every block capture
    real_values: bool = False
    # the outer capture traced from a root whose ``**kwargs`` is the trace's own (:func:`.export.fresh_kwargs_root`)
    fresh_kwargs: bool = False
    # a block's own capture stops at the first guard limiting a declared dimension (:mod:`.early_limit`)
    scan_search: ScanStop | None = None
    # the blocks (by id) whose stand-in output is computed, not guessed: what earlier captures learned
    # (:attr:`fxprep.capture.request.Learned.computed_blocks`), added to when a guess does not hold
    computed: set[int] = field(default_factory=set)


# a block's capture made by an earlier try of the same reuse (its graph, extra leaves, notes, opaque
# parts, guard sources, foreign attributes), by :func:`_traced_key`
Traced = dict[Any, tuple[fx.GraphModule, dict[str, str], list[str], dict[str, nn.Module], Any, list[str]]]


def _traced_key(first: Member, call: ExampleInputs, spec: Any, fallback: Any) -> Any:
    """What a block's own capture depends on, outside values read from data (not decided here, so
    Dynamo traces the inputs' shapes, dtypes, strides and devices and each other value as it is): the
    instance, the dynamic dimensions asked for, and each input. A try that computed a stand-in's
    output (:class:`.stubs.OtherOutput`) gives its blocks the same inputs as the try before
    (Dots3's sliding and full attention: the outer capture again, not both blocks again)."""
    leaves, tree = pytree.tree_flatten((call.args, call.kwargs))
    described: list[tuple[Any, ...]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type,
                              leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            described.append((type(leaf).__name__, leaf))
        else:
            return None  # a value of its own kind: captured again
    return id(first.module), first.k, repr(spec), repr(fallback), str(tree), tuple(described)


def _trace_group(first: Member, call: ExampleInputs, job: ReuseJob, spec: Any, fallback: Any,
                 sizes: dict[Any, str]) -> tuple[fx.GraphModule, dict[str, str], list[str], dict[str, nn.Module], Any,
                                                 list[str]]:
    """Dynamo's capture of ``first`` alone, re-lifted, with what grouping the others needs."""
    # the block's sizes that are declared dimensions, named as the model's inputs in the guards it records
    named = early_limit.sources(first.node, first.module, call, sizes) if spec is not None else early_limit.BlockSizes()
    names = named.names
    try:
        stop = (early_limit.Limit(named.recorded(), past_bounds=job.scan_search is ScanStop.PAST_BOUNDS)
                if job.scan_search else None)
        with guard_log.renamed(names, stop, named.derived):
            result, call = _export_block(first, call, job, spec, fallback)
    except guard_log.Stopped as stopped:
        raise early_limit.limited(f"'{first.name}' alone", stopped) from None
    except Exception as err:
        if job.scan_search:
            early_limit.raise_if_specialised(err, first.name, names)
        raise
    job.guard.reset()
    box = _block_box(job.box, result.graph_module, first)
    block = LiftTarget(first.module, job.target.policy, call, call, job.target.route)
    gm, extra = relift(result.graph_module, block, box, device_literals=False, decided=job.real_values)
    parts = _opaque_parts(gm, first.module)
    sources = leaf_hook_guards(self_guards(result.guards, first.module), first.module, job.target.policy)
    sources = beside_parts(sources, box.sites) if box else sources
    return gm, extra, block.notes, parts, sources, foreign_attributes(gm, first.module)


def _capture_group(group: list[Member], recorded: dict[tuple[int, int], Any], job: ReuseJob,
                   why: dict[str, str], sizes: dict[Any, str], traced: Traced) -> tuple[_Captured, list[list[Member]]]:
    """Capture the first member; the others its guards hold for share the graph, the rest are
    regrouped (by what the guarded attributes hold) for the next round, with the reason in ``why``.
    ``recorded``: the inputs each call receives (every member's when values are decided, else the
    first's). ``sizes``: the model inputs' sizes in the outer graph (:func:`.early_limit.input_sizes`).
    ``traced``: the block captures of earlier tries, taken where one was made on the same inputs."""
    first = group[0]
    call = block_call(first, recorded[(id(first.module), first.k)])
    if job.real_values:
        call = call.fresh_copy(keep_strides=True)  # its tensors may be shared with the other members' (block_calls.record_inputs)
    spec = block_spec(first, call)
    fallback = block_spec(first, call, declared_only=True) if spec is not None else None
    key = None if job.real_values else _traced_key(first, call, spec, fallback)
    if key is not None and key in traced:  # captured by an earlier try of this reuse: not traced again
        gm, extra, notes, parts, sources, foreign = traced[key]
    else:
        gm, extra, notes, parts, sources, foreign = _trace_group(first, call, job, spec, fallback, sizes)
        if key is not None:
            traced[key] = (gm, extra, notes, parts, sources, foreign)
    same, rest, undecided = [first], [], []
    for member in group[1:]:
        if member.module is first.module:
            same.append(member)
            continue
        if foreign:
            why[member.name] = (f"the graph of '{first.name}' reads {', '.join(foreign[:3])}, which is not one of its "
                                f"tensors and may be its own (a constant, a branch graph)")
            rest.append([member])
            continue
        decided = decided_otherwise(gm, first, member, recorded) if job.real_values else None
        if decided is not None:
            why[member.name] = f"its inputs decide values read from data otherwise than those of '{first.name}' ({decided})"
            undecided.append(member)  # together: the next round captures the first and checks the others
            continue
        differ = guard_differences(sources, first.module, member.module)
        if differ:
            why[member.name] = (f"its forward reads {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}, "
                                f"where '{first.name}' differs (Dynamo's guards)")
            regroup = guard_key(sources, member.module)
            for other in rest:
                if other[0].module is not first.module and guard_key(sources, other[0].module) == regroup:
                    other.append(member)
                    break
            else:
                rest.append([member])
        else:
            same.append(member)
    if foreign:
        rest = [[m] for group_ in rest for m in group_]
    if undecided:
        rest.append(undecided)
    return _Captured(same, gm, extra, notes, parts), rest


def _opaque_parts(gm: fx.GraphModule, first: nn.Module) -> dict[str, nn.Module]:
    """The modules calling an opaque method or function that re-lifting placed in the block graph
    ``gm`` (captured from ``first``), by target: each instance the graph is stamped for gets its own.
    (An opaque module of the block is the instance's own, stamped as any.)"""
    return {target: module for target, module in modules_not_of(gm, first).items()
            if isinstance(module, (OpaqueMethod, OpaqueFunction))}


def _block_box(box: BlackBox | None, dgm: fx.GraphModule, first: Member) -> BlackBox | None:
    """The opaque parts as the capture of ``first`` alone sees them (:meth:`.opaque.BlackBox.within`),
    or None when its graph calls none. A part it calls must be its own (inside it) or a function:
    a module or method elsewhere in the model has no place in a graph stamped for each instance."""
    called = box.calls_in(dgm) if box else []
    if not called or box is None:
        return None
    view = box.within(first.name, first.module)
    outside = [site for site in called if site.func is None and site.path != first.name
               and not site.path.startswith(f"{first.name}.")]
    if outside:
        raise RuntimeError(f"'{first.name}' calls '{outside[0].qualname}', which is called without tracing into it "
                           f"and is not part of it")
    return view


def capture_reusing(job: ReuseJob) -> tuple[fx.GraphModule, dict[str, str]] | None:
    """The model captured with each repeated block captured once (see the module docstring), or
    None when nothing repeats or reuse does not work out here (then the caller captures the whole
    model). ``job.call`` is what Dynamo is called with, ``job.target.capture_call`` the same without
    grad-requiring inputs (the eager recording run), ``job.target.prepared_call`` how the prepared
    module is called; notes go to ``job.target.notes``.
    ``job.convert(block_gm, first_instance)``: a pass the caller runs on the whole graph later, run
    once on each repeated block's graph before it is stamped out (the work of a pass that goes
    node by node then does not grow with depth); it must give what it gives on the whole graph.
    ``job.dynamic_spec``: the model's dynamic dimensions (Dynamo's ``dynamic_shapes``); each block is then
    captured with the dimensions that are symbolic at its call dynamic too (:func:`.block_calls.block_spec`)."""
    model, policy, guard, notes = job.target.model, job.target.policy, job.guard, job.target.notes
    sites = job.box.sites if job.box else []
    descend: set[int] = set()
    uncached: set[Any] = set()
    traced: Traced = {}  # a retry that computes a stand-in's output captures again only what changed
    for _ in range(4):  # a retry looks inside blocks whose output one call cannot return, or computes more
        instances: dict[int, tuple[nn.Module, Any]] = {}
        qualnames: dict[int, str] = {}
        for key, group in enumerate(groups_apart_from(model, policy, descend, sites)):
            for name, module in group:
                instances[id(module)] = (module, key)
                qualnames[id(module)] = name
        if not instances:
            if sites:
                notes.append(f"block reuse: off for this capture: the repeated blocks are parts called without "
                             f"tracing into them, or inside one (excluded or opaque, e.g. '{sites[0].qualname}').")
            return None
        uncached.update(key for mid, (_, key) in instances.items() if mid in job.computed)
        stubs = Stubs(instances, uncached, guess=job.dynamic_spec is not None and not job.real_values)
        around: Exception | None = None
        try:
            return _capture(job, stubs, qualnames, traced)
        except early_limit.LimitFound:
            guard.reset()
            raise
        except _AroundBlocks as failed:
            guard.reset()
            around = failed.error
        except Exception as err:  # noqa: BLE001 - reuse is an optimisation: the whole-model capture decides
            guard.reset()
            if isinstance(err, OtherOutput) and err.key not in uncached:
                uncached.add(err.key)
                job.computed.update(mid for mid, (_, key) in instances.items() if key == err.key)
                continue
            if stubs.unsupported:
                descend.update(mid for mid, (_, key) in instances.items() if key in stubs.unsupported)
                continue
            notes.append(f"block reuse did not apply ({type(err).__name__}: {first_line(err)}); the whole model "
                         f"was captured instead.")
            return None
        raise around  # outside the handler, so the error's own chain is left as Dynamo made it
    return None


def _around_blocks(err: BaseException, real_values: bool) -> bool:
    """Whether the outer capture's failure (not from a stand-in: ``Stubs.involved``) is one the
    whole-model capture has the same way: a value read from data (a guard on it, or a branch), the
    model's forward mutating the ``**kwargs`` it was called with (retried from a fresh-kwargs root),
    or, where values read from data are decided (``real_values``: each is a symbol, not a break),
    Python Dynamo cannot trace (``Unsupported``: Qwen2-VL's rope index groups tokens with
    ``itertools.groupby``). Elsewhere ``Unsupported`` may be a value the stand-ins' outputs gave
    (CLIP's "torch.* op returned non-Tensor" with dynamic shapes, which the whole model does not meet);
    and never a dimension's constraint violation: the outer capture's guards are not the whole model's."""
    branch = "Data-dependent branching" in (str(getattr(err, "gb_type", "") or ""), str(err).split("\n", 1)[0])
    unsupported = real_values and isinstance(err, torch._dynamo.exc.Unsupported)
    return stopped_at_data_guard(err) or branch or unsupported or MUTATED_INPUT_DICT in str(err)


class _AroundBlocks(Exception):
    """The outer capture failed in the model's own code, not in a block's stand-in: that failure
    is the capture's (raised as it is from :func:`capture_reusing`), since the whole-model capture
    would trace the same code and fail the same way, after tracing every block first."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _capture(job: ReuseJob, stubs: Stubs, qualnames: dict[int, str], traced: Traced
             ) -> tuple[fx.GraphModule, dict[str, str]]:
    target, guard = job.target, job.guard
    model, policy, route, notes = target.model, target.policy, target.route, target.notes
    prepared_call = target.prepared_call
    instances = stubs.instances
    if job.box:
        job.box.rewind()
    with stubs:
        try:
            result = dynamo_export(model, job.call, route, job.dynamic_spec, real_values=job.real_values,
                                   fresh_kwargs=job.fresh_kwargs)
        except Exception as err:
            # only a value read from data is the outer capture's own: other failures may come from calling
            # a stand-in (Gemma3n passes its layers a dict Dynamo cannot hand to one call_module)
            if stubs.involved(err) or not _around_blocks(err, job.real_values):
                raise  # reuse is given up and the whole model captured, as before
            # the model's code around the blocks failed (a value read from data, or its forward mutating
            # the **kwargs it was called with): the whole-model capture would fail there too
            raise _AroundBlocks(err) from None
    guard.reset()
    # Leaves the user named inside a block are called from the block's graph, not the outer one:
    # the outer re-lifting must see the blocks as leaves then (it records the outermost leaves' calls).
    # So must a module or method kept opaque inside one (xLSTM's backend, a per-step loop: .scans).
    user_leaves = (any(policy.reason(m) is not None for m in model.modules() if m is not model)
                   or any(held_part(name, job.box.sites if job.box else []) for name in qualnames.values()))
    outer_policy = LeafPolicy(modules=(*policy.modules, *(m for m, _ in instances.values())),
                              classes=policy.classes) if user_leaves else policy
    outer_target = LiftTarget(model, outer_policy, target.capture_call, prepared_call, route)
    outer_notes = outer_target.notes
    outer, extra = relift(result.graph_module, outer_target, job.box, device_literals=False, decided=job.real_values)
    by_name = {qualnames[mid]: module for mid, (module, _) in instances.items()}
    extra = {k: v for k, v in extra.items() if k not in by_name}
    groups: dict[Any, list[Member]] = {}
    seen: dict[str, int] = {}
    for node in outer.graph.nodes:
        if node.op == "call_module" and str(node.target) in by_name:
            name = str(node.target)
            module = by_name[name]
            member = Member(node, name, module, seen.get(name, 0))
            seen[name] = member.k + 1
            groups.setdefault((instances[id(module)][1], input_key(node)), []).append(member)
    info = ReuseInfo()
    why, alone = structure_whys(model, policy, instances, qualnames)
    for name in alone:
        held = held_part(name, job.box.sites if job.box else [])
        if held is not None:
            alone[name] = (f"it holds '{held.qualname}', which is called without tracing into it (excluded or opaque) "
                           f"where its twins' code is traced, so its inside is captured with the model around it")
    firsts: dict[int, str] = {}
    for key, group in groups.items():
        first_name = firsts.setdefault(key[0], group[0].name)
        if first_name != group[0].name:
            why[group[0].name] = f"its inputs differ from those '{first_name}' is called with"
    pending = list(groups.values())
    captured: list[_Captured] = []
    sizes = early_limit.input_sizes(outer, model, prepared_call) if job.dynamic_spec is not None else {}
    while pending:
        wanted = [m for g in pending for m in g] if job.real_values else [g[0] for g in pending]
        recorded = record_inputs(outer, model, prepared_call, wanted, share=job.real_values)
        guard.reset()
        next_round: list[list[Member]] = []
        for group in pending:
            done, rest = _capture_group(group, recorded, job, why, sizes, traced)
            captured.append(done)
            next_round.extend(rest)
        pending = next_round
    for done in captured:  # before any stamping: that rewires the calls' inputs to nodes of the block graphs
        for member in done.members:
            for tie in stubs.guesses.of(member.module):
                wrong = disproof(done.gm, member.node, tie)
                if wrong is not None:  # the stand-in's guessed output: captured again with it computed
                    raise OtherOutput(f"the output '{member.name}' was given in the outer capture does not hold: "
                                      f"{wrong}", instances[id(member.module)][1])
    traced.clear()  # stamping may convert a block graph in place: a retry from here captures afresh
    stamper = Stamper(outer, model)
    for done in captured:
        first = done.members[0]
        block, made = done.gm, done.parts
        if not names_free(made, [m.module for m in done.members[1:]]):
            raise StampError(f"the opaque parts of '{first.name}' have no free name in the blocks stamped from it")
        if job.convert is not None and len({id(m.module) for m in done.members}) == len(done.members) > 1:
            # converted once here rather than once per instance on the whole graph; an instance
            # called twice keeps the whole-graph conversion (its second call's ops get other names)
            converted = converted_block(done.gm, job.convert, first.module)
            if converted is not None and names_free(converted[1], [m.module for m in done.members[1:]]):
                block, made = converted[0], {**done.parts, **converted[1]}
        for member in done.members:
            returned = stubs.returned.get(id(member.module), set())
            if returned != {block_output_signature(done.gm)}:
                raise OtherOutput(f"the graph captured from '{first.name}' returns another structure than "
                                   f"'{member.name}' did in the outer capture", instances[id(member.module)][1])
            stamper.inline(member.node, block, first.module, member.name, member.module, made)
            for leaf, kind in done.extra.items():  # (not ``why``: that is the dict of reasons above)
                extra[f"{member.name}.{leaf}"] = kind
        info.captured[first.name] = [m.name for m in done.members[1:] if m.name != first.name]
        if first.name in why:
            info.why[first.name] = why[first.name]
        notes.extend(f"in '{first.name}'{' and the blocks stamped from it' if len(done.members) > 1 else ''}: {n}"
                     for n in done.notes)
    info.why.update(alone)
    placeholders = [n for n in outer.graph.nodes if n.op == "placeholder"]
    follow_input_device(outer, placeholders, prepared_call, outer_notes)
    gm = stamper.assemble({ROUTE_META: route, REUSE_META: info})
    notes.extend(outer_notes)
    notes.extend(info.notes())
    return gm, extra
