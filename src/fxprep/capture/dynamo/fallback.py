"""The opaque-leaf fallback on the Dynamo path: make the smallest failing part opaque, capture again.

:func:`capture_dynamo_leaves` locates each Dynamo failure in the live model (:mod:`.locate`), makes
the smallest enclosing function, method or module ``forward`` opaque (:mod:`fxprep.capture.sites`,
:mod:`.opaque`), and captures again until Dynamo succeeds; the other instances reaching the same
code are made opaque in the same round. Every opaque part is reported with the failure that made it
opaque.

See docs/concepts/opaque-parts.md ("Under the hood").
"""

from __future__ import annotations

import dataclasses
import linecache
import time
from collections.abc import Sequence

from torch import nn

from ...core.inputs import ExampleInputs
from ...reporting import progress
from ...reporting.diagnose import DATA_DEPENDENT_VALUE, FIXES, Issue, diagnose
from ...reporting.report import CaptureAttempt
from ..common import CaptureResult
from ..request import CaptureRequest
from ..routes import Route
from ..shapes.violation import specialises
from ..sites import Site
from . import capture_dynamo
from .early_limit import LimitFound
from .locate import Located, locate, origin_stack, resolve, user_stack
from .opaque import excluded_sites, inside
from .recording import Recorded, record_sites

MAX_ROUNDS = 40
TRACER = Route.DYNAMO_LEAVES
VALUES_TRACER = Route.DYNAMO_VALUES


def _usable(records: dict[Site, list[Recorded]], site: Site) -> bool:
    calls = records.get(site)
    if not calls:
        return False
    return not any(rec.unsupported for rec in calls)


def _group(located: Located, model: nn.Module, call: ExampleInputs, taken: list[Site],
           records: dict[Site, list[Recorded]]) -> list[Site] | None:
    """The innermost site of ``located`` that can be made opaque, with the same site in the other
    instances, recorded into ``records``; ``[]`` when only the root's own ``forward`` is left, None
    when no site on this path was called in the eager run."""
    for site, same in located.sites(model):
        if site.is_module and not site.path:
            return []  # the root's own forward: nothing smaller is left
        if site in taken or inside(site, taken):
            continue
        group = [site] + [s for s in same if s not in taken and not inside(s, taken)]
        missing = [s for s in group if s not in records]
        if missing:
            try:
                records.update(record_sites(model, call, missing))
            except Exception:  # noqa: BLE001 - a part the eager run cannot record: try the next outer one
                continue
        if _usable(records, site):
            return [s for s in group if _usable(records, s)]
    return None


def next_sites(err: BaseException, model: nn.Module, call: ExampleInputs, taken: list[Site],
               records: dict[Site, list[Recorded]]) -> tuple[list[Site], tuple[str, str, int] | None]:
    """The smallest part to make opaque for ``err`` (and the same part in the other instances that
    reach it the same way), recorded into ``records``; empty when nothing smaller than the root's
    own ``forward`` can be made opaque. A guard on a data-dependent size is located where the size
    was made (unless it came out of an opaque part), then where it failed; the second value is the
    frame where the size was made, when that located it.

    The stack is resolved without running the model where it names its objects unambiguously
    (:func:`~.locate.resolve`), else by an eager replay (:func:`~.locate.locate`); a resolved path
    the recording run never took is replayed as well."""
    for origin, stack in ((True, origin_stack(err)), (False, user_stack(err))):
        static = resolve(stack, model)
        located = static if static is not None else locate(stack, model, call)
        group = _group(located, model, call, taken, records) if located is not None else None
        if group is None and static is not None:
            located = locate(stack, model, call)
            group = _group(located, model, call, taken, records) if located is not None else None
        if group is not None:
            return group, (stack[-1] if origin and group else None)
    return [], None


def _made_at(issue: Issue, frame: tuple[str, str, int] | None) -> Issue:
    """``issue`` moved to where the data-dependent size it guards on was made."""
    if frame is None:
        return issue
    file, _, line = frame
    code = linecache.getline(file, line).strip()
    return dataclasses.replace(issue, category=DATA_DEPENDENT_VALUE, file=file, line=line, code=code,
                               message=f"{issue.message} (the size is made from tensor values here)",
                               fix=FIXES[DATA_DEPENDENT_VALUE])


def capture_dynamo_leaves(request: CaptureRequest, first_error: BaseException | None, *, real_values: bool = False,
                          known: Sequence[tuple[Site, Issue]] = ()
                          ) -> tuple[CaptureResult | None, CaptureAttempt, list[tuple[Site, Issue]]]:
    """Capture ``request`` with Dynamo, making the smallest failing parts opaque until it succeeds.

    ``first_error`` is the whole-model Dynamo failure to start from (None: capture first, with
    nothing opaque but ``known``). ``known``: parts made opaque from the first capture on, with the
    issues that made them opaque in an earlier capture of the same model (as this returns them): a
    capture again with other shapes declared then need not trace up to each in turn (Qwen2-VL: two
    whole-model traces of its 60 layers). Returns the result (or None), the attempt for the report,
    and each opaque site with the issue that made it opaque. ``request.handled`` is asked first
    about each failure (``control_flow="rewrite"`` rewrote the ``if``): True means capture is
    simply tried again.
    ``real_values``: each capture decides values read from data from the example
    (:mod:`.values`), so only what Dynamo cannot trace for other reasons is made opaque.
    ``request.records``: the opaque parts' eager recordings, filled here; a request sharing the same
    dict on the same model and example records a part both make opaque once.
    """
    start = time.perf_counter()
    tracer = VALUES_TRACER if real_values else TRACER
    model, handled = request.model, request.handled
    records = {} if request.records is None else request.records
    # block reuse keeps the opaque parts out of the blocks (blocks.groups_apart_from), and each block decides
    # its own values read from data (block_calls.decided_otherwise); the block pass belongs to the whole-model capture
    request = request.replace(records=records, block_pass=None)
    capture_call, _ = request.calls()
    sites: list[Site] = [site for site, _ in known]
    found: list[tuple[Site, Issue, Site | None]] = []
    firsts: dict[int, Site] = {}  # the sites one failure made opaque share its issue: the first names the others
    for site, issue in known:
        head = firsts.setdefault(id(issue), site)
        found.append((site, issue, None if head is site else head))
    err = first_error
    excluded = excluded_sites(model, request.policy) + list(request.opaque)  # opaque from the start: not found again
    for _ in range(MAX_ROUNDS):
        if err is not None and (isinstance(err, LimitFound) or request.dims_must_hold and specialises(err)):
            break  # a declared dimension is specialised or bounded: no opaque part changes that (CaptureRequest)
        if err is not None and (handled is None or not handled(err)):
            new, made_at = next_sites(err, model, capture_call, sites + excluded, records)
            if not new:
                break
            issue = _made_at(diagnose(err, Route.DYNAMO, model)[0], made_at)
            sites.extend(new)
            found.extend((site, issue, new[0] if k else None) for k, site in enumerate(new))
            more = f" and {len(new) - 1} more like it" if len(new) > 1 else ""
            progress.step(f"{new[0].qualname} made opaque{more} ({issue.category})")
        result, attempt = capture_dynamo(request, opaque=sites, real_values=real_values)
        if result is not None:
            result.tracer = tracer
            for site, issue, first in found:
                if inside(site, sites):
                    continue  # a later, enclosing part took it in
                like = f" (like '{first.qualname}')" if first is not None else ""
                result.extra_leaves[site.qualname] = f"opaque: {issue.category} at {issue.location}{like}"
            elapsed = time.perf_counter() - start
            return result, CaptureAttempt(tracer, True, elapsed), [(s, i) for s, i, _ in found if not inside(s, sites)]
        assert attempt.exception is not None
        err = attempt.exception
    assert err is not None
    failed = CaptureAttempt.failed(tracer, err, start)
    return None, failed, [(s, i) for s, i, _ in found]


__all__ = ["MAX_ROUNDS", "TRACER", "VALUES_TRACER", "capture_dynamo_leaves", "next_sites"]
