"""Dynamo capture, re-lifted to module level.

``torch._dynamo.export`` records a torch-level graph and fails less often than ``torch.fx`` on real
code (shape arithmetic, ``len``, most Python). What it gives back is not what a quantization
toolkit wants, though: modules are inlined or bound to Dynamo's own copies named
``L__self___layer1_0_conv1``, parameters are attributes with mangled names, the call signature is
flattened, ``torch.no_grad`` regions are ``_set_grad_enabled`` calls and devices are baked in as
literals. This package turns that graph back into one that looks like an fx capture of the user's
model:

* every leaf module (``torch.nn``/``torch.ao.nn`` layers, as in fx; user subclasses that keep such a
  layer's ``forward``; plus what the :class:`~fxprep.capture.common.LeafPolicy` names) is ONE
  ``call_module`` bound to the user's own module object under its original qualified name, found by
  identity;
* parameters and buffers are ``get_attr`` nodes reading the user's own tensors under their
  original names, so ``state_dict`` keys and Parameter identity are preserved;
* ``node.meta['nn_module_stack']`` holds fx-style ``(qualified name, class)`` values;
* the prepared module is called exactly like the original (keyword arguments included) and
  returns exactly the original output type (``ModelOutput``, dict, tuple, registered dataclass).

Files, in pipeline order: :mod:`.export` (the Dynamo call and what protects the model and the
process around it), :mod:`.names` (Dynamo's names → the user's objects), :mod:`.flag` and
:mod:`.regroup` (the two routes to ``call_module`` nodes, both tested; :mod:`.record` is the
regroup route's eager recording run), :mod:`.relift` (the module-level GraphModule), and
:mod:`.shapes` (dynamic dimensions). The graph clean-ups are passes in
:mod:`fxprep.passes.dynamo_cleanup`. This file holds the capture loop.

Nothing here raises for a capture failure: :func:`capture_dynamo` returns it in the
:class:`~fxprep.capture.common.CaptureAttempt` so the cascade can fall back to fx.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from ... import progress
from ...inputs import ExampleInputs, split_calls
from ...threads import GLOBAL_LOCK
from .. import huggingface
from ..common import CaptureAttempt, CaptureResult, LeafPolicy
from ..sites import Site
from .export import (
    FLAG,
    MUTATED_INPUT_DICT,
    ROUTES,
    AttributeGuard,
    default_route,
    dynamo_export,
    flag_available,
    requiring_grad,
    tensor_caches,
)
from .names import resolve_source
from .opaque import black_box
from .recording import Recorded
from .relift import ROUTE_META, relift, unreferenced_parameters
from .reuse import REUSE_META, capture_reusing
from .shapes import dynamic_dims, dynamic_shapes_spec, grown_example


def _failure(err: BaseException, start: float, tracer: str = "dynamo") -> tuple[None, CaptureAttempt]:
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


def capture_dynamo(
    model: nn.Module,
    policy: LeafPolicy,
    example: ExampleInputs,
    concrete_args: dict[str, Any] | None = None,
    *,
    route: str = "auto",
    dynamic: Any = None,
    opaque: list[Site] | None = None,
    records: dict[Site, list[Recorded]] | None = None,
    reuse: bool = True,
    block_pass: Any = None,
    real_values: bool = False,
) -> tuple[CaptureResult | None, CaptureAttempt]:
    """Capture ``model`` with Dynamo and re-lift it to module level.

    ``route`` is ``"auto"`` (the flag route when this torch has the flag, else regroup; a flag-route
    failure Dynamo only has on that route is retried with regroup), ``"flag"`` or ``"regroup"``.
    ``dynamic`` marks dimensions dynamic (``"batch"`` or ``{arg: {dim: name}}``). ``opaque`` names
    more parts Dynamo must call without tracing into (the excluded modules always are, see
    :mod:`.opaque`); ``records`` caches their eager recordings across calls. ``reuse``: capture
    each repeated block once and stamp its graph out for the others (:mod:`.reuse`; flag route,
    static or dynamic shapes, no opaque parts); ``block_pass(block_gm, first_instance)`` is then run once on
    each repeated block before it is stamped out (:func:`.reuse.capture_reusing`).
    ``real_values``: values read from data are decided from the example's, each decision checked in
    the graph (:mod:`fxprep.decisions`; tracer "dynamo+values"; callers pass reuse=False). Never raises for a
    capture failure.
    """
    start = time.perf_counter()
    tracer = "dynamo+values" if real_values else "dynamo"
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
    if route == "flag" and not flag_available():
        err = RuntimeError(f"this torch has no torch._dynamo.config.{FLAG}; use route='regroup'")
        return _failure(err, start, tracer)
    current = default_route() if route == "auto" else route
    capture_call, prepared_call = split_calls(model, example, concrete_args)
    notes: list[str] = []
    try:
        spec = dynamic_shapes_spec(model, capture_call, dynamic)
    except Exception as err:  # noqa: BLE001
        return _failure(err, start, tracer)
    try:
        box = black_box(model, policy, opaque or [], capture_call, records)
    except Exception as err:  # noqa: BLE001 - an opaque part the eager run cannot record
        return _failure(err, start, tracer)
    caches = tensor_caches(model)
    grad_inputs = True
    hooks_installed = False
    fresh_kwargs = False
    while True:  # each failure below relaxes one thing and tries again, or gives up
        guard = AttributeGuard(model, caches)
        attempt_notes: list[str] = []
        try:
            with GLOBAL_LOCK, box.installed(), huggingface.capture_context(model, attempt_notes, capture_call), guard:
                call = requiring_grad(capture_call) if grad_inputs else capture_call
                reused = None
                if reuse and current == "flag" and box:
                    attempt_notes.append(
                        f"block reuse: off for this capture: {len(box.sites)} part(s) are called without tracing "
                        f"into them (excluded or opaque modules), which block reuse does not handle yet; every "
                        f"block was captured by the whole-model capture.")
                if reuse and current != "flag" and route == "auto" and not fresh_kwargs:
                    attempt_notes.extend(reuse_unavailable_note(model, policy))
                if reuse and current == "flag" and not box and not fresh_kwargs:
                    reused = capture_reusing(model, policy, call, capture_call, prepared_call, current, guard,
                                             attempt_notes, block_pass, dynamic_spec=spec)
                if reused is not None:
                    gm, extra = reused
                else:
                    result = dynamo_export(model, call, current, spec, real_values=real_values,
                                           fresh_kwargs=fresh_kwargs)
                    guard.reset()  # Dynamo left fake tensors in attributes forward() writes
                    gm, extra = relift(result.graph_module, model, policy, capture_call, prepared_call, current,
                                       attempt_notes, box, decided=real_values)
            notes.extend(attempt_notes)
            break
        except Exception as err:  # noqa: BLE001 - reported, the cascade goes on
            if not hooks_installed and huggingface.stopped_at_hook_installation(err):
                huggingface.install_hooks_by_running(model, capture_call)  # as the user's first call would
                hooks_installed = True
            elif not fresh_kwargs and spec is None and MUTATED_INPUT_DICT in str(err):
                fresh_kwargs = True  # trace from a root whose **kwargs is the trace's own (export.fresh_kwargs_root)
            elif grad_inputs and any(s in str(err) for s in _RETRY_WITHOUT_GRAD):
                grad_inputs = False  # capture the inputs as given instead
            elif caches:
                caches = []  # maybe the model cannot run with its caches emptied: keep them in place
            elif route == "auto" and current == "flag" and any(s in str(err) for s in _RETRY_ON_REGROUP):
                notes.append(f"Dynamo's call_module route failed ({type(err).__name__}); used the regroup route.")
                current = "regroup"
            else:
                return _failure(err, start, tracer)
            progress.step(f"retrying after {type(err).__name__}")
    written = guard.written
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
    if dynamic:
        notes.append(f"dynamic dimensions: {dynamic_dims(model, capture_call, dynamic)}")
    result_ = CaptureResult(gm, tracer, notes=notes, extra_leaves=extra)
    return result_, CaptureAttempt(tracer, True, time.perf_counter() - start)


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
