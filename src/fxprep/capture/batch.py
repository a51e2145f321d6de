"""Whether a static-shape Dynamo graph depends on the example's batch size: a probe.

A static capture may bake in the example's batch, so the input check (:mod:`fxprep.runtime.guard`)
starts out refusing any other size. The probe runs the example with its batch one smaller and one
larger through the original and the prepared module, and asks Dynamo for the branches on the batch
(:mod:`fxprep.capture.dynamo.size_branches`); when both agree and no branch would go the other way,
dimension 0 is left unchecked, and the report says which evidence decided it.

See docs/shapes.md ("Under the hood").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..core.inputs import ExampleInputs
from ..core.runs import quiet_fx_errors
from ..reporting.diagnose import first_line
from ..reporting.report import Report
from ..runtime.guard import InputSpec
from ..runtime.prepared import INPUT_SPEC
from .dynamo.size_branches import Branch, batch_branches


def example_batch(example: ExampleInputs) -> int | None:
    """The example's batch size: dimension 0 of its first tensor of at least one dimension."""
    for leaf in pytree.tree_leaves((example.args, example.kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def with_batch(example: ExampleInputs, batch: int, size: int) -> ExampleInputs:
    """``example`` with dimension 0 of every tensor of batch ``batch`` resized to ``size`` (rows
    repeat the example's, so token ids and masks stay valid)."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != batch:
            return t
        if size <= batch:
            return t.narrow(0, 0, size)
        reps = -(-size // batch)
        return torch.cat([t] * reps, dim=0).narrow(0, 0, size)

    args, kwargs = pytree.tree_map_only(torch.Tensor, resize, (example.args, example.kwargs))
    return ExampleInputs(tuple(args), dict(kwargs))


@contextlib.contextmanager
def unchecked(gm: fx.GraphModule) -> Iterator[None]:
    """``gm`` without its input check for a while (the probe calls it at other sizes on purpose)."""
    spec = gm.__dict__.pop(INPUT_SPEC, None)
    try:
        yield
    finally:
        if spec is not None:
            gm.__dict__[INPUT_SPEC] = spec


def _free_batch(spec: InputSpec, batch: int) -> None:
    def free(node: dict[str, Any]) -> None:
        kind = node["kind"]
        if kind == "tensor" and node.get("shape") and node["shape"][0] == batch:
            node["shape"][0] = None
        elif kind == "seq":
            for item in node["items"]:
                free(item)
        elif kind == "dict":
            for item in node["items"].values():
                free(item)

    for node in spec.params.values():
        free(node)


def _branches(model: nn.Module, example: ExampleInputs, batch: int, trace: BranchTrace) -> tuple[list[Branch], str | None]:
    """The branches on the batch size that restrict it (Dynamo's guards, :mod:`fxprep.capture.dynamo.size_branches`),
    and why they could not be listed (None when they were). Traced at batch 2 when the example's is 1."""
    traced = max(batch, 2)
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in pytree.tree_leaves((example.args, example.kwargs))):
        # an LLM-size model prepared on meta with block reuse captures in seconds; a second,
        # whole-model Dynamo trace would cost several times that
        return [], "the inputs are on meta, where listing them would cost a second whole-model Dynamo trace"
    try:
        found = batch_branches(model, trace.captured(with_batch(example, batch, traced)), traced,
                               fresh_kwargs=trace.fresh_kwargs)
    except Exception as err:  # noqa: BLE001 - a model Dynamo cannot trace with a symbolic batch: say so
        return [], f"{type(err).__name__}: {first_line(err)}"
    return [b for b in found if b.restricts()], None


@dataclass(frozen=True)
class BranchTrace:
    """How :func:`probe` traces the model with a symbolic batch to list its branches on it: as the
    capture did. ``captured(example)`` splits an example as prepare_model does for the capture (with
    the arguments it adds, such as ``use_cache=False``); ``fresh_kwargs``: from a fresh-kwargs root,
    as the capture learned (:class:`~fxprep.capture.request.Learned`)."""

    captured: Callable[[ExampleInputs], ExampleInputs]
    fresh_kwargs: bool = False


def probe(model: nn.Module, gm: fx.GraphModule, example: ExampleInputs, report: Report, *,
          check: Callable[[ExampleInputs, str], Any], trace: BranchTrace | None) -> bool:
    """Probe the batch dimension of ``gm``'s static-shape capture (see the module docstring).

    ``check(example, what)`` verifies ``gm`` against ``model`` on an example as prepare_model does
    (its calls, tolerances and absent outputs), raising where they differ. ``gm``'s input spec loses
    its batch dimension when the probe frees it. True when the graph baked the example's batch in
    (another batch failed) although Dynamo, traced with a symbolic batch (``trace``), found no branch
    on it: worth capturing again with the batch declared. ``trace`` is None where the capture did not
    trace the whole model (:attr:`~fxprep.capture.routes.Route.whole`): that trace would stop where
    the capture could not go, and is not made."""
    spec = gm.__dict__[INPUT_SPEC]
    batch = example_batch(example)
    if batch is None:
        return False
    branches, unlisted = (_branches(model, example, batch, trace) if trace is not None else
                          ([], "as the capture itself could not: parts of it are called without tracing into them "
                               "or decided from the example"))
    named = (", from Dynamo's guards (traced with a symbolic batch): " + "; ".join(b.describe() for b in branches)
             if branches else "")
    sizes = [s for s in (batch - 1, batch + 1) if s >= 1]
    for size in sizes:
        try:
            with unchecked(gm), quiet_fx_errors():  # a failure here is a finding, said in the report
                check(with_batch(example, batch, size), f"the example at batch {size}")
        except Exception as err:  # noqa: BLE001 - any failure (FxprepError or not) keeps the check
            # at another size a static-shape graph failing is what this probe looks for, not a bug
            reason = str(err).strip().splitlines()[0].replace(" This is an fxprep bug; please report it with the model.", "")
            reason = reason[:300].rstrip(".")
            report.note(
                f"The graph is specialised to batch {batch}: at batch {size}, {reason[:1].lower()}{reason[1:]} (a shape-dependent branch or "
                f"a size Dynamo baked in){named}. Calls at another batch size raise InputMismatch; prepare with "
                f"dynamic='batch' if the model supports it."
            )
            return not branches and unlisted is None
    if branches:
        report.note(
            f"The graph is specialised to batch {batch}: it matched the original at batch {' and '.join(map(str, sizes))}, but "
            f"the model's code branches on the batch size{named}. Calls at another batch size raise InputMismatch; "
            f"prepare with dynamic='batch' if the model supports it."
        )
        return False
    _free_batch(spec, batch)
    seen = ("and Dynamo's guards, traced with a symbolic batch, show no branch on it" if unlisted is None else
            f"(a branch on the batch size that neither size reaches would not be seen: Dynamo could not trace the model "
            f"with a symbolic batch to list them, {unlisted})")
    report.note(
        f"Batch size: the prepared module matched the original at batch {' and '.join(map(str, sizes))} as well as "
        f"{batch}, {seen}, so dimension 0 of the inputs is not checked (other dimensions are)."
    )
    return False
