"""dynamo+values: capture again deciding values read from data from the example, when that is sound.

Where Dynamo stops at a data-dependent expression (Pixtral's ``image_sizes``, Qwen2-VL's
``cu_seqlens``), it can instead answer from the example's real values and keep each answer as a
runtime check (:mod:`fxprep.decisions`). This module decides whether that is worth it and sound: the
fallback's opaque parts must hide layers (:func:`hidden_layers`), and the decisions must survive
shuffled floating-point inputs (:func:`broken_on_perturbed`).

See docs/concepts/control-flow.md ("Under the hood").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from ... import decisions
from ...core.inputs import ExampleInputs
from ...core.runs import preserved_state
from ...errors import InputMismatch
from ...reporting.diagnose import Issue
from ...reporting.report import CaptureAttempt
from ..common import CaptureResult, LeafPolicy
from ..request import CaptureRequest
from ..routes import Route
from ..sites import Site
from .fallback import VALUES_TRACER as TRACER
from .fallback import capture_dynamo_leaves
from .names import default_leaf
from .recording import perturbed

PERTURBED_RUNS = 3  # each with other shuffles; a decision that follows activations rarely survives all


def decidable(err: BaseException, model: nn.Module) -> bool:
    """Whether Dynamo's failure ``err`` is a value read from data (a size from ``.item()`` or
    ``.tolist()``, a slice bound from a tensor, or a question about such a size: torch's
    ``GuardOnDataDependentSymNode``), which real values could get past."""
    from ...reporting.diagnose import DATA_DEPENDENT_VALUE, diagnose, stopped_at_data_guard

    if stopped_at_data_guard(err):
        return True
    return any(issue.category == DATA_DEPENDENT_VALUE for issue in diagnose(err, Route.DYNAMO, model))


def worth_deciding(err: BaseException, sites: list[tuple[Site, Issue]], model: nn.Module) -> bool:
    """Whether real values could get further than the fallback did: Dynamo's whole-model failure
    ``err`` was a value read from data (:func:`decidable`), or one of the fallback's opaque parts
    was made opaque for one. The second matters where the first stop is something else entirely
    (Qwen-style ``itertools.groupby`` in a helper) and the value read comes after it, from what
    that helper computed."""
    from ...reporting.diagnose import DATA_DEPENDENT_VALUE

    if decidable(err, model):
        return True
    return any(issue.category == DATA_DEPENDENT_VALUE or "data-dependent expression" in issue.message
               for _, issue in sites)


def hidden_layers(model: nn.Module, result: CaptureResult, sites: list[Site], policy: LeafPolicy | None = None) -> list[str]:
    """The layers (leaf modules holding weights: Linear, Conv, Embedding, norms) inside the opaque
    parts of ``result`` (a module made opaque, or the module whose method or helper function was)
    that are not ``call_module`` nodes of its graph: a quantizer cannot see them. Layers inside a
    module ``policy`` excludes (``modules_to_exclude``) are not counted: the user asked for that
    module as one call, and no capture would show its layers."""
    from .opaque import excluded_sites

    called = {str(n.target) for n in result.gm.graph.nodes if n.op == "call_module"}
    prefixes = [site.path for site in sites]
    excluded = [site.path for site in excluded_sites(model, policy)] if policy is not None else []
    hidden = []
    for name, module in model.named_modules():
        if not name or name in called or not default_leaf(module) or next(module.parameters(recurse=False), None) is None:
            continue
        if any(name.startswith(f"{p}.") for p in excluded):
            continue
        if any(not p or name == p or name.startswith(f"{p}.") for p in prefixes):
            hidden.append(name)
    return hidden


def why_taken(hidden: list[str] | None, still: list[str]) -> str:
    """The report's note on a ``dynamo+values`` capture taken over the fallback's, which hid
    ``hidden`` (None: the fallback failed); ``still``: the layers its own opaque parts hide."""
    if hidden is None:
        instead = "with opaque parts (that fallback failed)"
    else:
        shown = ", ".join(hidden[:4]) + (f" and {len(hidden) - 4} more" if len(hidden) > 4 else "")
        instead = f"with opaque parts hiding {len(hidden)} layer(s) ({shown})"
    left = f", {len(still)} of them still inside parts it cannot trace for other reasons" if still else ""
    return (f"Captured deciding values read from data from the example (tracer {TRACER}) rather than {instead}{left}: "
            f"the decisions held on inputs with other floating-point values, so they follow the inputs' structure "
            f"(sizes, grids, token ids), not the data.")


def broken_on_perturbed(gm: torch.fx.GraphModule, model: nn.Module, call: ExampleInputs) -> Exception | None:
    """Run ``gm`` (called as the prepared module is) on ``call`` itself, then on inputs whose
    floating-point values are shuffled, :data:`PERTURBED_RUNS` times; the first failure, as the
    error to report (an :class:`InputMismatch` naming the decision when one of its checks failed),
    or None.

    The example's own run comes first because an opaque part inside this capture whose eager run
    failed on the propagated values (:func:`.opaque._propagate_real`) gives Dynamo outputs of the
    recorded shapes but no real values (``torch.empty``): a decision taken on those is checked
    against the part's real outputs here, and the capture refused if it does not hold."""
    with preserved_state(model), torch.no_grad():
        for k in range(-1, PERTURBED_RUNS):
            other = call if k < 0 else perturbed(call, seed=k)
            try:
                gm(*other.args, **other.kwargs)
            except Exception as err:  # noqa: BLE001 - any failure on other data rejects the capture
                mismatch = decisions.failed_check(gm, err)
                if mismatch is not None:
                    what = "not on the example itself" if k < 0 else "decided from activations, not from the inputs' structure"
                    return InputMismatch(f"{what}: {mismatch}")
                return err
    return None


def capture_deciding_values(request: CaptureRequest, known: Sequence[tuple[Site, Issue]] = ()
                            ) -> tuple[CaptureResult | None, CaptureAttempt, list[tuple[Site, Issue]]]:
    """Dynamo with values read from data decided from the example, and the parts it still cannot
    trace for other reasons opaque (:func:`.fallback.capture_dynamo_leaves`: Qwen2-VL's rope index
    groups tokens with ``itertools.groupby``). The result only when its decisions hold on perturbed
    inputs (:func:`broken_on_perturbed`), else the attempt says why. ``request.records``: the eager
    recordings the fallback already made (a part both make opaque is not run again). ``known``: parts
    opaque from the first capture on (:func:`.fallback.capture_dynamo_leaves`). The caller
    protects the model (``capture.fx.restored_attributes``), as around any capture."""
    start = time.perf_counter()
    # every failure is made opaque here: the rewrite's handler belongs to the first fallback capture
    result, attempt, sites = capture_dynamo_leaves(request.replace(handled=None), None, real_values=True,
                                                   known=known)
    if result is None:
        return None, attempt, sites
    broken = broken_on_perturbed(result.gm, request.model, request.calls()[1])
    if broken is not None:
        return None, CaptureAttempt.failed(TRACER, broken, start), sites
    return result, CaptureAttempt(TRACER, True, time.perf_counter() - start), sites


__all__ = ["TRACER", "broken_on_perturbed", "capture_deciding_values", "decidable", "hidden_layers", "why_taken",
           "worth_deciding"]
