"""Dynamo capture, re-lifted to module level.

``torch._dynamo.export`` captures more real code than ``torch.fx``, but inlines modules, mangles
parameter names and flattens the signature. This package turns its graph back into one that looks
like an fx capture of the user's model: each leaf layer one ``call_module`` bound to the user's own
module, parameters read under their own names, the original call signature and output type. This
file holds the capture loop; :func:`capture_dynamo` returns a failure in the
:class:`~fxprep.reporting.report.CaptureAttempt` rather than raising, so the cascade can fall back to
fx.

See docs/concepts/capture.md ("Under the hood") for the files in pipeline order and the full story.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...core.inputs import ExampleInputs
from ...core.threads import GLOBAL_LOCK
from ...reporting import progress
from ...reporting.report import CaptureAttempt
from ..common import CaptureResult, LeafPolicy
from ..request import CaptureRequest, ScanStop
from ..routes import Route
from ..shapes.dims import dynamic_dims, dynamic_shapes_spec, grown_example, model_dimensions, model_sources, shortest_length
from ..sites import Site
from . import early_limit, guard_log
from .early_limit import LimitFound
from .export import (
    FLAG,
    MUTATED_INPUT_DICT,
    ROUTES,
    AttributeGuard,
    default_route,
    dynamo_export,
    flag_available,
    tensor_caches,
)
from .names import resolve_source
from .opaque import black_box
from .relift import ROUTE_META, LiftTarget, relift, unreferenced_parameters
from .reuse import REUSE_META, ReuseJob, capture_reusing


def _failure(err: BaseException, start: float, tracer: str = Route.DYNAMO) -> tuple[None, CaptureAttempt]:
    return None, CaptureAttempt.failed(tracer, err, start)


_RETRY_ON_REGROUP = ("neither buffers/parameters/constants", "install_free_tensors")


# Inputs made to require grad cannot be written in place, turned into NumPy, ...: "a leaf Variable
# that requires grad is being used in an in-place operation".
_RETRY_WITHOUT_GRAD = ("requires grad",)


def reuse_unavailable_note(model: nn.Module, policy: LeafPolicy) -> list[str]:
    """Block reuse needs Dynamo's ``install_free_tensors_for_export`` flag (the flag route); an older
    torch captures every block instead, and a model with repeated blocks is told why."""
    import torch

    from .blocks import find_groups

    if not find_groups(model, policy):
        return []
    return [f"block reuse: off: it needs torch._dynamo.config.{FLAG}, which torch {torch.__version__} lacks "
            f"(torch 2.10 and newer have it); every block was captured by the whole-model capture, which gives "
            f"the same graph, only slower on deep models."]


def capture_dynamo(request: CaptureRequest, *, route: str = "auto", opaque: list[Site] | None = None,
                   real_values: bool = False) -> tuple[CaptureResult | None, CaptureAttempt]:
    """Capture ``request.model`` with Dynamo on ``request.example`` and re-lift it to module level.

    ``route`` is ``"auto"`` (the flag route when this torch has the flag, else regroup; a flag-route
    failure Dynamo only has on that route is retried with regroup), ``"flag"`` or ``"regroup"``.
    ``request.dynamic`` marks dimensions dynamic (``"batch"`` or ``{arg: {dim: name}}``). ``opaque`` names
    more parts Dynamo must call without tracing into, after ``request.opaque`` (the excluded modules always are, see
    :mod:`.opaque`); ``request.records`` caches their eager recordings across calls. ``request.reuse``:
    capture each repeated block once and stamp its graph out for the others (:mod:`.reuse`; flag route,
    static or dynamic shapes; opaque parts are kept out of the blocks); ``request.block_pass(block_gm, first_instance)`` is then
    run once on each repeated block before it is stamped out (:func:`.reuse.capture_reusing`).
    ``real_values``: values read from data are decided from the example's, each decision checked in
    the graph (:mod:`fxprep.decisions`; tracer "dynamo+values"; block reuse decides them per block). Never raises for a
    capture failure.
    """
    start = time.perf_counter()
    tracer = Route.DYNAMO_VALUES if real_values else Route.DYNAMO
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
    if route == "flag" and not flag_available():
        err = RuntimeError(f"this torch has no torch._dynamo.config.{FLAG}; use route='regroup'")
        return _failure(err, start, tracer)
    model, policy = request.model, request.policy
    capture_call, prepared_call = request.calls()
    notes: list[str] = []
    try:
        spec = dynamic_shapes_spec(model, capture_call, request.dynamic)
    except Exception as err:  # noqa: BLE001 - any failure to build the spec is this route's failure, diagnosed
        return _failure(err, start, tracer)
    try:
        box = black_box(model, policy, [*request.opaque, *(opaque or [])], capture_call, request.records)
    except Exception as err:  # noqa: BLE001 - an opaque part the eager run cannot record
        return _failure(err, start, tracer)
    # a dimension other than the batch declared dynamic: transformers' length-dependent mask choices (hf_attention)
    lengths = shortest_length(model, capture_call, request.dynamic)
    state = _Relaxed(route, default_route() if route == "auto" else route, tensor_caches(model),
                     fresh_kwargs=request.learned.fresh_kwargs)
    while True:  # each failure below relaxes one thing and tries again, or gives up
        guard = AttributeGuard(model, state.caches)
        target = LiftTarget(model, policy, capture_call, prepared_call, state.current, [])
        try:
            family_context = request.family.capture_context(model, target.notes, capture_call, lengths)
            with GLOBAL_LOCK, box.installed(), family_context, guard:
                call = capture_call.requiring_grad() if state.grad_inputs else capture_call
                reused = None
                if request.reuse:
                    target.notes.extend(_reuse_notes(model, policy, state))
                if request.reuse and state.current == "flag":
                    with _stopping_at_limits(request, call):  # the outer capture's own guards (a block's: its own stop)
                        reused = capture_reusing(ReuseJob(target, call, guard, request.block_pass, spec, box,
                                                          real_values, state.fresh_kwargs, request.scan_search,
                                                          request.learned.computed_blocks))
                if reused is not None:
                    gm, extra = reused
                else:
                    box.rewind()  # a reuse attempt's outer capture may have counted the opaque calls
                    with _stopping_at_limits(request, call):
                        result = dynamo_export(model, call, state.current, spec, real_values=real_values,
                                               fresh_kwargs=state.fresh_kwargs)
                    guard.reset()  # Dynamo left fake tensors in attributes forward() writes
                    gm, extra = relift(result.graph_module, target, box, decided=real_values)
            notes.extend(target.notes)
            break
        except Exception as err:  # noqa: BLE001 - reported, the cascade goes on
            if isinstance(err, LimitFound) or not state.relax(err, request, capture_call, notes):
                return _failure(err, start, tracer)
            request.learned.fresh_kwargs = state.fresh_kwargs  # the later captures of this model start there
            progress.step(f"retrying after {type(err).__name__}")
    notes.extend(_capture_notes(request, gm, state.caches, guard.written, capture_call))
    result_ = CaptureResult(gm, tracer, notes=notes, extra_leaves=extra)
    return result_, CaptureAttempt(tracer, True, time.perf_counter() - start)


@contextlib.contextmanager
def _stopping_at_limits(request: CaptureRequest, call: ExampleInputs) -> Iterator[None]:
    """Under ``request.scan_search``, the model's capture stops at the first guard that limits a
    declared dimension, with :class:`.early_limit.LimitFound` (see :mod:`.early_limit`); under block
    reuse the outer capture's (a stand-in's computation aside), each block's own stopping itself."""
    dims = dynamic_dims(request.model, call, request.dynamic) if request.scan_search else {}
    if not dims:
        yield
        return
    names = model_sources(request.model, call, dims)
    try:
        stop = early_limit.Limit(names, past_bounds=request.scan_search is ScanStop.PAST_BOUNDS,
                                 dimension=model_dimensions(dims))
        with guard_log.stopping(stop):
            yield
    except guard_log.Stopped as stopped:
        raise early_limit.limited("the model", stopped) from None


@dataclass
class _Relaxed:
    """What :func:`capture_dynamo`'s loop has relaxed so far: each failure relaxes one more thing
    (:meth:`relax`), in this order, until the capture succeeds or nothing is left to relax."""

    route: str  # the route asked for
    current: str  # the route tried now
    caches: list[Any]  # tensor caches emptied during the capture (:func:`.export.tensor_caches`)
    grad_inputs: bool = True
    family_recovered: bool = False  # the model's family put right what a failure needed (once)
    fresh_kwargs: bool = False

    def relax(self, err: BaseException, request: CaptureRequest, capture_call: ExampleInputs, notes: list[str]) -> bool:
        """Relax what ``err`` calls for; False when nothing is left (the capture failed)."""
        if not self.family_recovered and request.family.recover(err, request.model, capture_call):
            self.family_recovered = True  # transformers: its hooks installed by a run, as the user's first call would
        elif not self.fresh_kwargs and MUTATED_INPUT_DICT in str(err):
            self.fresh_kwargs = True  # trace from a root whose **kwargs is the trace's own (export.fresh_kwargs_root)
        elif self.grad_inputs and any(s in str(err) for s in _RETRY_WITHOUT_GRAD):
            self.grad_inputs = False  # capture the inputs as given instead
        elif self.caches:
            self.caches = []  # maybe the model cannot run with its caches emptied: keep them in place
        elif self.route == "auto" and self.current == "flag" and any(s in str(err) for s in _RETRY_ON_REGROUP):
            notes.append(f"Dynamo's call_module route failed ({type(err).__name__}); used the regroup route.")
            self.current = "regroup"
        else:
            return False
        return True


def _reuse_notes(model: nn.Module, policy: LeafPolicy, state: _Relaxed) -> list[str]:
    """Why block reuse is off for this capture, when it was asked for and cannot run."""
    if state.current != "flag" and state.route == "auto":
        return reuse_unavailable_note(model, policy)
    return []


def _capture_notes(request: CaptureRequest, gm: Any, caches: list[Any], written: Any,
                   capture_call: ExampleInputs) -> list[str]:
    """What the report says about a successful capture: caches emptied, attributes forward() wrote,
    parameters the graph does not read while it reads constants, the dynamic dimensions."""
    model = request.model
    notes = []
    if caches:
        notes.append(
            f"{len(caches)} tensor cache(s) ({', '.join(sorted({k for _, k, _ in caches}))}) were emptied during "
            f"capture so the graph computes them from the parameters instead of baking in cached values."
        )
    if written:
        notes.append(
            f"forward() writes module attributes ({', '.join(sorted(written)[:6])}); they were restored after "
            f"capture, and values kept this way are not part of the graph."
        )
    unused = unreferenced_parameters(gm, model)
    consts = gm.meta.get("fxprep_constants", [])
    if consts and unused:
        notes.append(
            f"WARNING: parameter(s) {', '.join(unused[:8])}{'...' if len(unused) > 8 else ''} are not referenced by "
            f"the prepared graph while it reads constant tensors {', '.join(consts[:5])}: if the forward derives "
            f"those constants from the parameters (a cache), changing the parameters will NOT change the prepared "
            f"module. Clear the cache or use tracer='fx'."
        )
    if request.dynamic:
        notes.append(f"dynamic dimensions: {dynamic_dims(model, capture_call, request.dynamic)}")
    return notes


__all__ = [
    "ROUTES",
    "REUSE_META",
    "ROUTE_META",
    "capture_dynamo",
    "default_route",
    "dynamic_shapes_spec",
    "flag_available",
    "grown_example",
    "relift",
    "resolve_source",
    "tensor_caches",
    "unreferenced_parameters",
]
