"""Shape-general by default: a transformers model captured with its batch and sequence dimensions
dynamic, and proven so, unless the user said otherwise.

:mod:`fxprep.capture.shapes.autodims` says which dimensions; this module runs the capture
(:func:`capture`), takes out a dimension the model's code specialises (saying why), captures again
after a static fallback with the same opaque parts (:func:`fallback`), and writes the notes. Any
failure is a :class:`NotShapeGeneral`, after which ``prepare_model`` captures with static shapes
(:mod:`fxprep.pipeline.plan`). See docs/shapes.md, "Shape-general capture, step by step".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.inputs import ExampleInputs
from ..core.runs import preserved_state
from ..reporting import progress
from ..reporting.diagnose import first_line
from ..reporting.report import CaptureAttempt, Report
from .common import CaptureResult
from .dynamo import guard_log, guard_read
from .dynamo.early_limit import LimitFound
from .dynamo.export import quiet_guard_logs
from .dynamo.fallback import capture_dynamo_leaves
from .dynamo.guard_log import GuardLog
from .dynamo.scans import Scan
from .dynamo.size_branches import SIZES, size_branches
from .fx import restored_attributes
from .request import CaptureRequest, ScanStop
from .routes import Route
from .shapes import autodims, violation
from .shapes.dims import SIZE_SOURCE, shortest_length

# (capture example, dynamic dimensions, sites kept opaque, where the capture stops for the scan search:
# CaptureRequest.scan_search, None where it runs to its end)
# -> the capture and its attempts
Capture = Callable[[ExampleInputs, Any, list[Any], "ScanStop | None"], tuple["CaptureResult | None", list[CaptureAttempt]]]
# (the guards of a failed capture, the declared symbols it limited, the proposal, the sites taken) -> new scans
ScanFinder = Callable[[GuardLog, set[str], autodims.Proposal, list[Any]], list[Scan]]
MAX_SCAN_ROUNDS = 3


@dataclasses.dataclass
class Elsewhere:
    """A shape-general capture that Dynamo could not make for a reason other than the dimensions (a
    value read from data, an untraceable helper): the opaque-part fallback may still keep them
    (:func:`fallback`). ``attempts``: that capture's, the fallback's starting point."""

    proposal: autodims.Proposal
    attempts: list[CaptureAttempt]


@dataclasses.dataclass
class _Tried:
    """A capture that a round of scans newly kept opaque must improve on (:func:`capture`):
    ``proposal`` without them, and what that capture left specialised (``found``) and bounded
    (``ranges``), and its failure ``err``. Where that is a :class:`LimitFound` (:attr:`stopped`),
    the capture was stopped at the first limiting guard, whose sources count as specialised, so where
    the scans do not help, the capture without stopping decides what to drop or bound; else ``err``
    is taken up again as it was."""

    proposal: autodims.Proposal
    err: BaseException
    found: dict[Any, str]
    ranges: dict[str, Any]

    @property
    def stopped(self) -> bool:
        return isinstance(self.err, LimitFound)


class NotShapeGeneral(Exception):
    """The automatically declared dimensions did not hold (capture or verification): prepare with
    static shapes instead. Not an FxprepError: it never reaches the user. ``reference``: the
    original's run on the example (:class:`fxprep.verify.Reference`) when one was made, for the static attempt.
    ``elsewhere``: set when the capture failed for another reason than the dimensions."""

    reference: Any = None  # fxprep.verify.Reference
    elsewhere: Elsewhere | None = None
    narrower: autodims.Proposal | None = None  # the proposal to try before static shapes (a VLM's length alone)


def capture(model: nn.Module, example: ExampleInputs, proposal: autodims.Proposal,
            run: Capture, tracer: str = Route.DYNAMO, scans_of: ScanFinder | None = None
            ) -> tuple[CaptureResult, list[CaptureAttempt], autodims.Proposal]:
    """``run(capture_example, dynamic, opaque sites, search)`` (Dynamo alone, or what ``tracer`` names) with
    ``proposal``'s dimensions; each dimension Dynamo finds specialised is dropped (its reason kept in
    ``proposal.dropped``), each range it needs is declared, and the capture retried. Before that,
    ``scans_of`` may name per-step loops behind the guards that limit them (:mod:`.dynamo.scans`):
    the capture is tried with those opaque, and they are kept where that frees a dimension or widens
    a range. They are looked for first in a capture stopped at the first guard that limits a
    declared dimension (``search``: :mod:`.dynamo.early_limit`; the model's, or a repeated
    block's own); the capture runs to the end only where none is found there or the one found leaves
    the dimension specialised. Raises :class:`NotShapeGeneral` when no dimension is left or the
    capture fails for another reason."""
    # first every dimension maybe-dynamic, the capture kept where its guards hold at every size
    # (.capture.dynamo.guard_read: one capture); the user's own dimensions are declared as they are
    current: autodims.Proposal | None = proposal if proposal.explicit else dataclasses.replace(proposal, auto=True)
    before: _Tried | None = None  # the failure scans try to pass
    rounds, refused = 0, list[Any]()  # scans tried that did not help are not tried again
    # captures stop at the first guard limiting a declared dimension (.capture.dynamo.early_limit) until
    # a scan search in such a stopped capture's guards finds nothing that makes the capture succeed
    stopping = scans_of is not None
    stopped: dict[str, autodims.SizeRange] = {}  # the bound a stopped first try's guard set, where it ran on
    while current is not None:
        # a first try run on past a bound stops at the next guard that does more than bound (ScanStop)
        search = ((ScanStop.PAST_BOUNDS if stopped else ScanStop.FIRST)
                  if stopping and before is None and rounds < MAX_SCAN_ROUNDS else None)
        with quiet_guard_logs(), guard_log.recording() as log:
            result, attempts = run(current.capture_example, current.for_export(),
                                   [site for scan in current.scans for site in scan.sites], search)
        if result is not None and result.tracer == tracer:
            limited = guard_read.limiting(log, current, model, current.capture_example) if current.auto else None
            if limited is not None:  # declared as Dims again: the violation says what to drop or bound
                progress.step(f"the dimensions maybe-dynamic do not hold at every size ({limited[:120]})")
                bound = guard_read.bounds(log, current, model, current.capture_example)
                holds_within, bound = bool(bound), bound or stopped
                read = guard_read.branches(log, current, model, current.capture_example)
                at = autodims.BranchesRead(current.dynamic, current.sizes(model, current.capture_example),
                                           current.scans, read) if read is not None else None
                current = dataclasses.replace(current, auto=False, branches=at)
                if bound and scans_of is not None and rounds < MAX_SCAN_ROUNDS:
                    rounds += 1  # a per-step loop behind a bound may free it (Qwen3.5's chunked scan): tried first
                    new = scans_of(log, set(bound), current, [site for scan in current.scans for site in scan.sites] + refused)
                    if new:  # where they do not help, the bounds are declared as below
                        before = _Tried(current, RuntimeError(limited), {}, bound)
                        current = dataclasses.replace(current, scans=current.scans + tuple(new))
                        continue
                if bound:  # bounds alone: the graph holds inside them, as its guards do
                    within = autodims.revised(current, {}, bound, model, example)
                    if holds_within and within is not None and _same_call(within, current, model):
                        progress.step("kept within " + ", ".join(f"{k} {v.low or 2}..{v.high or ''}" for k, v in bound.items()))
                        return _scans_noted(result, within), attempts, within
                    current = within or current
                continue
            return _scans_noted(result, current), attempts, current
        err = next((a.exception for a in reversed(attempts) if a.exception is not None), None)
        if current.auto and not (isinstance(err, LimitFound) and scans_of is not None):
            current = dataclasses.replace(current, auto=False)  # a failure: every next capture as before
        if isinstance(err, LimitFound) and scans_of is not None:  # a capture stopped at a limit
            rounds += 1
            # the guard it stopped at was found limiting already: the scan search starts from it alone
            new = scans_of(GuardLog([err.guard]) if err.guard is not None else log, _declared(err.sources, current),
                           current, [site for scan in current.scans for site in scan.sites] + refused)
            if new:  # the dimensions it stopped at count as specialised, for judging the scans
                before = _Tried(current, err, {key: err.sources[0] for key in _keys(err.sources, current)}, {})
                current = dataclasses.replace(current, scans=current.scans + tuple(new))
            else:  # no scan there
                bound = _bound_at(err, current)
                if current.auto and bound and not stopped:  # a bound: the maybe-dynamic try runs on past it,
                    # and past any other bound, reading every bound and the branches at once, kept within them;
                    # a guard that does more (specialises: it would refuse the try) stops it for a scan search
                    stopped = bound
                else:  # the capture without stopping says what to drop or bound (its violation)
                    stopping, bound = False, bound or stopped
                    current = dataclasses.replace(current, auto=False)
                    if bound and not current.explicit:  # the range declared at once: no capture to be told it
                        current = autodims.revised(current, {}, bound, model, example) or current
            continue
        found, ranges = violation.findings(err, current) if err is not None else ({}, {})
        if before is not None:  # the capture with new scans opaque
            if not _freer(found, ranges, before.found, before.ranges):  # they did not help: traced, as before
                refused.extend(site for scan in current.scans if scan not in before.proposal.scans
                               for site in scan.sites)
                if before.stopped:  # the capture without stopping decides
                    current, before, stopping = dataclasses.replace(before.proposal, auto=False), None, False
                    continue
                current, err, found, ranges = before.proposal, before.err, before.found, before.ranges
            before = None
        elif scans_of is not None and (found or ranges) and rounds < MAX_SCAN_ROUNDS:
            rounds += 1
            bounded = {current.dynamic[n][d] for n, d in found if d in current.dynamic.get(n, {})} | set(ranges)
            new = scans_of(log, bounded, current, [site for scan in current.scans for site in scan.sites] + refused)
            if new and err is not None:  # found or ranges come from a failure: there is one
                before = _Tried(current, err, found, ranges)
                current = dataclasses.replace(current, scans=current.scans + tuple(new))
                continue
        if current.explicit and found:  # the user declared them: not dropped behind their back
            raise NotShapeGeneral("; ".join(sorted(set(found.values()))))
        new_ranges = {k: v for k, v in ranges.items() if current.ranges.get(k) != v}
        if not (set(found) - set(current.dropped)) and not new_ranges:
            first = (first_line(err) if err is not None else "") or "no capture"
            failure = NotShapeGeneral(f"Dynamo could not capture it with {current.describe()} dynamic "
                                      f"({type(err).__name__ if err is not None else 'no error'}: {first})")
            if err is not None and not found and not ranges:
                failure.elsewhere = Elsewhere(_without_batch(current, first), attempts)
            raise failure
        nxt = autodims.revised(current, found, ranges, model, example)
        if nxt is None:
            why = "; ".join(sorted(set(found.values())))
            raise NotShapeGeneral(f"every declared dimension is specialised by the model: {why}")
        current = nxt
    raise NotShapeGeneral("no dimension left to declare")  # pragma: no cover - the loop returns or raises


def _same_call(bounded: autodims.Proposal, tried: autodims.Proposal, model: nn.Module) -> bool:
    """Whether ``bounded`` (``tried`` with ranges declared) captures with the same dimensions at the
    same sizes as ``tried`` did: then ``tried``'s maybe-dynamic capture, whose guards fail only
    outside those ranges (:func:`.dynamo.guard_read.bounds`), is the graph a capture with them
    declared would give, and it is kept (a sliding window's ``seq < 4096`` cost Mistral a second
    whole capture)."""
    return (bounded.dynamic == tried.dynamic and bounded.scans == tried.scans
            and bounded.sizes(model, bounded.capture_example) == tried.sizes(model, tried.capture_example))


def _scans_noted(result: CaptureResult, proposal: autodims.Proposal) -> CaptureResult:
    """``result`` with each per-step loop ``proposal`` keeps opaque named among its opaque parts."""
    for scan in proposal.scans:
        for site in scan.sites:
            result.extra_leaves[site.qualname] = f"opaque: a loop over '{scan.symbol}' at {scan.where}"
    return result


def _bound_at(err: LimitFound, proposal: autodims.Proposal) -> dict[str, autodims.SizeRange]:
    """The range a capture stopped at its first limiting guard (``err``) says at once, where that
    guard bounds one declared dimension by a constant (BERT's ``seq <= 64``: a learned position
    table): ``{symbol: range}``, the example's size inside it. The capture without stopping would
    be refused by the same guard, and its constraint violation suggest this range; taken from the
    guard, that whole capture is saved. Empty for any other guard (two sizes, ``%``, an
    equality): the violation says what to do then."""
    keys = _keys(err.sources, proposal)
    if err.guard is None or len(keys) != 1:
        return {}
    name, dim = keys[0]
    held = guard_read.bound(err.guard, f"{name}.shape[{dim}]")
    return {proposal.dynamic[name][dim]: held} if held is not None else {}


def _keys(sources: list[str], proposal: autodims.Proposal) -> list[tuple[str, int]]:
    """``(input name, dim)`` of each declared input size ``sources`` names (``L['input_ids'].size()[1]``)."""
    out = []
    for source in sources:
        m = SIZE_SOURCE.fullmatch(source)
        if m and int(m.group(2)) in proposal.dynamic.get(m.group(1), {}):
            out.append((m.group(1), int(m.group(2))))
    return out


def _declared(sources: list[str], proposal: autodims.Proposal) -> set[str]:
    """The declared names of the input sizes ``sources`` names (``L['input_ids'].size()[1]`` -> ``seq``)."""
    return {proposal.dynamic[name][dim] for name, dim in _keys(sources, proposal)}


def scans_finder(request: CaptureRequest) -> ScanFinder:
    """The :data:`ScanFinder` for captures of ``request`` at other examples: each finding's eager runs
    (locating a guard's frames, watching a candidate scan) use the example as Dynamo was called with it."""
    from .dynamo import scans

    def find(log: GuardLog, symbols: set[str], at: autodims.Proposal, taken: list[Any]) -> list[Scan]:
        call = request.replace(example=at.capture_example).calls()[0]
        return scans.usable(log, symbols, at, request.model, call, taken)

    return find


def _freer(found: dict[Any, str], ranges: dict[str, Any], found_before: dict[Any, str],
           ranges_before: dict[str, Any]) -> bool:
    """Whether a capture's findings (dimensions specialised, ranges) leave more free than those before."""
    if set(found) != set(found_before):
        return set(found) < set(found_before)
    if not ranges_before:
        return False
    return all(sym not in ranges or _higher(ranges[sym].high, bound.high) for sym, bound in ranges_before.items())


def _higher(high: int | None, before: int | None) -> bool:
    return high is None or (before is not None and high > before)


def _without_batch(proposal: autodims.Proposal, stopped: str) -> autodims.Proposal:
    """For the fallback that decides values read from data from the example (:func:`fallback`): a
    multimodal proposal without its batch (its :attr:`~.autodims.Proposal.narrower`), because those
    values (each image's size, its number of tiles) are one set per image: decided for the example's
    images, they cannot follow a batch of other images."""
    if proposal.narrower is None:
        return proposal
    return autodims.batch_not_held(proposal.narrower, f"Dynamo stopped at a value read from data ({stopped[:120]}), and "
                                   "the values decided from the example are one set per image")


def limits(request: CaptureRequest, proposal: autodims.Proposal, call: ExampleInputs) -> autodims.Proposal:
    """``proposal`` (captured on ``call``, of ``request``'s model: its capture example as Dynamo was called with it, concrete
    arguments included) with its ``limits``: of the ranges Dynamo bounded the declared dimensions to, those
    a branch of the model's code sets (a trace with the dimensions maybe-dynamic, where each decision
    on them is a guard with the line that made it: :func:`~.dynamo.size_branches.size_branches`),
    which the prepared module must refuse to leave: past a sliding window, say, the graph would
    compute the other branch's attention without a word. A range no branch sets came from a kernel's
    shape logic during the trace (a convolution's backend choice reads the batch size: ``batch <=
    15``); the graph has no such limit. Where the trace fails, every range counts as a limit. No
    trace for the batch retry's proposal: the batch probe found no branch on the batch already."""
    if not proposal.ranges or proposal.source == autodims.BAKED_BATCH:
        return proposal
    model = request.model
    read = proposal.read_here(model)
    if read is not None:
        found = read  # the maybe-dynamic capture's own guards (guard_read.branches): no trace more
    else:
        try:
            length = shortest_length(model, call, proposal.dynamic)
            family_context = request.family.capture_context(model, None, call, dynamic_length=length)
            with quiet_guard_logs(), preserved_state(model), family_context:
                found = size_branches(model, call, proposal.dynamic, fresh_kwargs=request.learned.fresh_kwargs)
        except Exception as err:  # noqa: BLE001 - cannot tell: every range is kept as a limit
            why = f"kept as a limit: whether the model's code branches there could not be checked ({first_line(err)})"
            return dataclasses.replace(proposal, limits={k: r.joined(why) for k, r in proposal.ranges.items()})
    sizes = proposal.sizes(model, proposal.capture_example)
    # a range read off the guards themselves is where the graph holds, whatever set it
    kept = {sym: r for sym, r in proposal.ranges.items() if r.from_guards}
    for sym, bound in proposal.ranges.items():
        if bound.unproven:
            kept[sym] = _where_branches_hold(sym, bound, [b for b in found if b.names(sym)], sizes)
            continue
        if sym in kept:
            continue
        low, high = bound.low, bound.high
        # sizes past the range: a branch that goes the other way at any of them is a limit. Not seen: a branch
        # past a kernel's bound (Dynamo decides it from the range that bound left, without a guard)
        outside = [n for n in (*SIZES, (high or 0) + 1, (low or 3) - 1)
                   if n >= 2 and ((high is not None and n > high) or (low is not None and n < low))]
        for branch in found:
            if branch.names(sym) and any(
                    not branch.holds_with({**sizes, sym: n}) for n in outside):
                kept[sym] = dataclasses.replace(bound, why=f"the model's code branches on it: {branch.describe()}")
                break
    return dataclasses.replace(proposal, limits=kept)


def _where_branches_hold(sym: str, bound: autodims.SizeRange, branches: list[Any], sizes: dict[str, int]
                         ) -> autodims.SizeRange:
    """``bound`` (a range export could not prove, declared ``Dim.AUTO``: Dynamo then keeps every
    guard it makes without a word) narrowed to the sizes of ``sym`` around the example's where
    every branch of the model's code on it (``branches``) goes the way it went in the trace: the
    graph holds one way of each. The guards export printed do not cover them all: SEW-D pools its
    frames and pads them back where their count is odd, a branch export did not print, and the
    graph declared over 1360 samples on computed wrong values at 1800. Where no interval holds,
    the example's size alone."""
    from .shapes.guard_range import interval_where

    size = sizes[sym]
    held = interval_where(lambda n: all(b.holds_with({**sizes, sym: n}) for b in branches), size,
                          lowest=max(2, bound.low or 2)) if branches else (bound.low or 2, bound.high)
    if held is None:
        return dataclasses.replace(bound, low=size, high=size,
                                   why=f"{bound.why}; the model's code branches on it at the sizes around the example's")
    low, high = held
    if bound.high is not None:
        high = bound.high if high is None else min(high, bound.high)
    if (low, high) == (bound.low or 2, bound.high):
        return bound
    return dataclasses.replace(bound, low=low if low > 2 else None, high=high,
                               why=f"{bound.why}; the model's code branches on it outside {low}..{high or ''}")


# Dynamo's fallback routes (failing parts opaque, values decided from the example): a static capture by one of
# them is tried again with the dimensions declared.
FALLBACK_TRACERS = tuple(route for route in Route if route.dynamo and not route.whole)
NOT_TRIED = ("the static capture was not Dynamo's (with parts opaque, or deciding values read from data), so no second "
             "capture with the dimensions declared was tried")


def taken(tracer: str, scans: bool = False) -> str:
    """The report's note on a shape-general capture the static fallback's tracer made (:func:`fallback`;
    ``scans``: per-step loops were kept opaque in it, each said in a note of its own)."""
    how = "deciding values read from data from the example" if Route(tracer).values else "with parts opaque"
    checks = ": every decision is checked in the graph at each call" if Route(tracer).values else ""
    loops = ", but the per-step loops said below" if scans else ""
    return (f"Captured {how} (tracer {tracer}), a second time with the found dimensions declared dynamic (no part "
            f"opaque that the first capture, with static shapes, did not make opaque too{loops}){checks}.")


def fallback(request: CaptureRequest, elsewhere: Elsewhere, attempts: list[CaptureAttempt], tracer: str,
             opaque: list[Any]) -> tuple[CaptureResult | None, autodims.Proposal | None, str]:
    """The static fallback's capture again (``tracer``: Dynamo with the failing parts opaque, or also
    deciding values read from data from the example, :mod:`fxprep.capture.dynamo.values`) with
    ``elsewhere``'s dimensions declared: the prompt's length then stays free. Taken only with no part
    opaque that the static capture (``opaque``: its sites and issues) did not make opaque too: a
    part opaque only under the dimensions would be a graph that hides more (the Qwen family's rope
    index and Llava-NeXT's anyres helpers are opaque either way; their outputs sized like their
    inputs follow the declared sizes in the opaque call's fake outputs, and the verification on a
    second size checks it). A dimension the model's code specialises, or a range it needs, revises
    the dimensions as for the first shape-general capture (:func:`capture`), and as there a per-step
    loop behind the guard that limits it is kept opaque where that frees the dimension (Qwen3.5's VLM:
    its chunked scan, :mod:`.dynamo.scans`; its capture stopped at that guard,
    :mod:`.dynamo.early_limit`, not traced unrolled to the end); the only parts opaque here that the static
    capture did not make opaque. Its attempts are appended to ``attempts``; the capture and the
    proposal it kept, or None and why."""
    from .dynamo import values

    assert request.example is not None, "the shape-general capture needs example inputs"
    allowed = {site.qualname for site, _ in opaque}
    how = "deciding values read from data" if Route(tracer).values else "with the same parts opaque"
    why_not: list[str] = []

    def run(call: ExampleInputs, dims: Any, scans: list[Any], search: ScanStop | None
            ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
        dims_request = request.replace(example=call, dynamic=dims, dims_must_hold=True, records={}, opaque=tuple(scans),
                                       scan_search=search)
        with preserved_state(request.model), restored_attributes(request.model, []):
            # the static capture's opaque parts opaque from the start: not found again one whole trace each
            if Route(tracer).values:
                result, attempt, sites = values.capture_deciding_values(dims_request, known=opaque)
            else:
                result, attempt, sites = capture_dynamo_leaves(dims_request, None, known=opaque)
        attempts.append(attempt)
        more = [site.qualname for site, _ in sites if site.qualname not in allowed]
        if result is not None and more:
            why_not.append(f"capturing {how} with them declared made {more[0]} opaque")
            return None, [attempt]
        return result, [attempt]

    try:
        # scans as for the first shape-general capture: Qwen3.5's VLM keeps its chunked scan opaque here
        result, _, found = capture(request.model, request.example, elsewhere.proposal, run, tracer=tracer,
                                   scans_of=scans_finder(request))
    except NotShapeGeneral as err:
        return None, None, why_not[-1] if why_not else f"capturing {how} with them declared failed too ({err})"
    result.notes.append(taken(tracer, bool(found.scans)))
    return result, found, ""


def not_kept_note(why: str) -> str:
    """The report's note when the shape-general capture (or its verification) failed: ``why``."""
    return (f"Shape-general capture (the dimensions found from the input names declared dynamic) was tried and "
            f"not kept: {why}. "
            f"Captured with static shapes instead.")


def notes(report: Report, proposal: autodims.Proposal, second: str | None) -> None:
    """What the report says of a shape-general capture (``second``: the size it was verified on, None
    when verification was off)."""
    checked = (f"the prepared module matched the original on the example and on {second}" if second is not None else
               "verification was off (verify=False), so this rests on Dynamo's capture alone")
    within = " within the limits below" if proposal.limits else ""
    if not proposal.explicit:  # the user's own dimensions were not found: the caller words their check
        report.note(
            f"Shape-general: the dimensions {proposal.describe()} were found from {proposal.source} and declared "
            f"dynamic to Dynamo; {checked}, so calls at any size of them{within} are accepted (no batch probe "
            f"needed). Pass dynamic=False for a static-shape capture.")
    for scan in proposal.scans:  # checked where each guard fails unless a limit of the graph ends before
        limit = proposal.limits.get(scan.symbol)
        report.note(scan.note(second is not None and (limit is None or limit.high is None or limit.high >= scan.past)))
    for (name, dim), why in sorted(proposal.dropped.items()):
        report.note(f"Shape-general: {name} dim {dim} stays at the example's size: {why}.")
    for sym, bound in sorted(proposal.ranges.items()):
        limit = proposal.limits.get(sym)
        shown, why = _bounds(bound.low, bound.high), bound.why
        if limit is not None:  # its own bounds: narrower than the range where branches end sooner
            report.note(f"Shape-general: '{sym}' is dynamic {_bounds(limit.low, limit.high)}: {limit.why}; a call outside it "
                        f"raises InputMismatch (the graph holds one way of the branch).")
        else:
            guard = why.replace("the model's code requires ", "its guard: ")
            report.note(f"Shape-general: Dynamo bounded '{sym}' to {shown} while capturing ({guard}), a bound from a "
                        f"kernel's shape logic, not a branch of the model's code: the graph has no such limit and "
                        f"calls outside it are accepted, computing what the model computes (past a table of that "
                        f"size, such as learned positions, both fail).")


def second_grow(model: nn.Module, proposal: autodims.Proposal, example: ExampleInputs) -> int:
    """How much larger the second size makes the example's dynamic dimensions: 3, less where a limit
    comes first (a window 2 tokens past the example's length), so that the check is made where the
    graph holds; at least 1 (an example at its limit already: the check fails and static shapes follow)."""
    inputs, grow = autodims.named_inputs(model, example), 3
    for name, dims in proposal.dynamic.items():
        for d, sym in dims.items():
            high = proposal.limits[sym].high if sym in proposal.limits else None
            if high is not None and isinstance(inputs.get(name), torch.Tensor):
                grow = min(grow, high - int(inputs[name].shape[d]))
    return max(grow, 1)


def past_scans(model: nn.Module, proposal: autodims.Proposal, example: ExampleInputs, second: ExampleInputs
               ) -> dict[str, int]:
    """How much larger than ``example`` each symbol a scan loops over must be for the check where
    the scan's guard fails (:attr:`~.dynamo.scans.Scan.past`): empty where ``second`` (the
    second size) reaches it already, or where a limit of the prepared module ends before it."""
    sizes, second_sizes = proposal.sizes(model, example), proposal.sizes(model, second)
    grow: dict[str, int] = {}
    for scan in proposal.scans:
        size, high = sizes.get(scan.symbol), proposal.limits.get(scan.symbol)
        if size is None or second_sizes.get(scan.symbol, 0) >= scan.past:
            continue
        if high is not None and high.high is not None and high.high < scan.past:
            continue
        grow[scan.symbol] = max(grow.get(scan.symbol, 0), scan.past - size)
    return grow


def _bounds(low: int | None, high: int | None) -> str:
    return " and ".join(x for x in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if x)


def limits_by_input(proposal: autodims.Proposal | None) -> dict[str, dict[int, tuple[int | None, int | None, str]]]:
    """``{input: {dim: (min, max, why)}}`` of the limits the prepared module checks (:func:`limits`)."""
    out: dict[str, dict[int, tuple[int | None, int | None, str]]] = {}
    if proposal is None:
        return out
    for name, dims in proposal.dynamic.items():
        for d, sym in dims.items():
            if sym in proposal.limits:
                limit = proposal.limits[sym]
                out.setdefault(name, {})[d] = (limit.low, limit.high, limit.why)
    return out


def specialised_reasons(proposal: autodims.Proposal | None) -> dict[str, dict[int, str]]:
    """``{input: {dim: why}}`` of the dimensions found specialised, for the input check's message."""
    out: dict[str, dict[int, str]] = {}
    for (name, dim), why in (proposal.dropped.items() if proposal is not None else ()):
        out.setdefault(name, {})[dim] = why
    return out


def with_dynamic(opts: Any, dynamic: Any) -> Any:
    """``opts`` (:class:`fxprep.options.PrepareOptions`) declaring ``dynamic`` for one capture."""
    return dataclasses.replace(opts, dynamic=dynamic)
