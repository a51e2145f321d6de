"""Do subgraphs reproduce the model? Every sequential target's inputs and outputs, eager against
the subgraphs run in order.

A subgraph split that runs is not one that computes what the model computes: llm-compressor's own
tracer hands several families' decoder layers ``attention_mask=None`` where the model passes a mask,
and GPTQ then calibrates a model that is not causal, with no error. :func:`compare_subgraphs` runs
the model once as it is and once as its subgraphs, records what each target module receives (every
argument, the mask included) and returns, and says where they first differ. It takes any object with
llm-compressor's subgraph interface (``input_names``, ``forward(model, **inputs)``), llm-compressor's
own or fxprep's, so the same check measures both.

See docs/handoff/llm-compressor.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


@dataclass
class Difference:
    """How the subgraphs' run differs from eager's at the targets. ``max_abs_diff``: over every
    tensor a target received or returned (``inf`` where one side has a tensor and the other
    ``None`` or another shape); ``first``: the first place that differs, in words; ``calls``: target
    calls compared (eager's and the subgraphs' counts must agree)."""

    max_abs_diff: float = 0.0
    first: str | None = None
    calls: int = 0
    notes: list[str] = field(default_factory=list)
    output_max_abs_diff: float = 0.0  # over the targets' outputs alone (finite where a mask went missing)

    @property
    def equal(self) -> bool:
        return self.max_abs_diff == 0.0 and self.first is None

    def __str__(self) -> str:
        said = "".join(f"; {n}" for n in self.notes[:1]) + (f" (+{len(self.notes) - 1} more)" if len(self.notes) > 1 else "")
        if self.equal:
            return f"equal ({self.calls} target calls){said}"
        return f"max |diff| {self.max_abs_diff:.3g}; first: {self.first}{said}"


@contextlib.contextmanager
def _recording(targets: Sequence[tuple[str, nn.Module]], into: list[tuple[str, Any, Any]]) -> Iterator[None]:
    """Every call of a target: ``(name, (args, kwargs), output)``, detached (hooks of our own,
    removed on exit; the modifiers' hooks are not involved)."""
    handles = []
    pending: dict[int, Any] = {}
    for name, module in targets:
        def pre(mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            pending[id(mod)] = _detached((args, kwargs))

        def post(mod: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            into.append((name, pending.pop(id(mod), None), _detached(output)))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, tree)


def run_subgraphs(model: nn.Module, subgraphs: Sequence[Any], batch: Mapping[str, Any]) -> dict[str, Any]:
    """The subgraphs run in order on ``batch`` as llm-compressor's pipeline runs them (each reads its
    ``input_names`` from what the batch and the earlier ones gave)."""
    values = dict(batch)
    for subgraph in subgraphs:
        values.update(subgraph.forward(model, **{n: values[n] for n in subgraph.input_names if n in values}))
    return values


def compare_subgraphs(model: nn.Module, subgraphs: Sequence[Any], batch: Mapping[str, Any],
                      targets: Sequence[tuple[str, nn.Module]]) -> Difference:
    """Compare what every target module receives and returns in ``model(**batch)`` and in the subgraphs run in order.

    Call it in the context calibration runs in (llm-compressor's ``calibration_forward_context``).

    Args:
        model: The model the subgraphs were made for.
        subgraphs: Any objects with llm-compressor's subgraph interface (``input_names``, ``forward(model, **inputs)``).
        batch: A calibration batch (the model's keyword arguments).
        targets: ``(name, module)`` of the modules whose calls are compared.

    Returns:
        The :class:`Difference` (largest difference, where it first appears, the calls compared).
    """
    eager: list[tuple[str, Any, Any]] = []
    staged: list[tuple[str, Any, Any]] = []
    with torch.no_grad():
        with _recording(targets, eager):
            model(**batch)
        with _recording(targets, staged):
            run_subgraphs(model, subgraphs, batch)
    diff = Difference(calls=len(eager))
    if [n for n, _, _ in eager] != [n for n, _, _ in staged]:
        diff.max_abs_diff = math.inf
        diff.first = (f"the targets were called {len(eager)} times in eager, {len(staged)} times by the subgraphs "
                      f"(first in eager: {eager[0][0] if eager else None})")
        return diff
    for (name, e_in, e_out), (_, s_in, s_out) in zip(eager, staged):
        for where in _none_for_mask(e_in, s_in):
            note = f"{name} input {where}: None in eager, a mask that masks nothing from the subgraphs (same result)"
            if not any(n.split(" input ")[1] == note.split(" input ")[1] for n in diff.notes):
                diff.notes.append(note)
        for what, e, s in (("input", e_in, s_in), ("output", e_out, s_out)):
            worst, where = _tree_diff(e, s)
            if worst > diff.max_abs_diff:
                diff.max_abs_diff = worst
            if what == "output":
                diff.output_max_abs_diff = max(diff.output_max_abs_diff, worst)
            if worst > 0 and diff.first is None:
                diff.first = f"{name} {what} {where}"
    return diff


def _tree_diff(a: Any, b: Any, path: str = "") -> tuple[float, str]:
    """The largest difference between two pytrees of call values, and where (``inf`` where a tensor
    meets ``None``, another type or another shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a is None and allows_everything(b):
                return 0.0, ""  # said in Difference.notes by compare_subgraphs
            return math.inf, f"{path or 'value'}: {_kind(a)} in eager, {_kind(b)} from the subgraphs"
        if a.shape != b.shape:
            return math.inf, f"{path or 'value'}: shape {tuple(a.shape)} in eager, {tuple(b.shape)} from the subgraphs"
        if a.is_meta or b.is_meta or a.numel() == 0:
            return 0.0, ""
        if a.dtype == torch.bool or not a.is_floating_point():
            worst = float((a != b).any())
        else:
            worst = float((a.double() - b.double()).abs().max())
        return (worst, f"{path or 'value'}: max |diff| {worst:.3g}") if worst else (0.0, "")
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return math.inf, f"{path or 'value'}: {len(a)} items in eager, {len(b)} from the subgraphs"
        return _worst(_tree_diff(x, y, f"{path}[{k}]") for k, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # a key on one side only counts as None on the other
        keys = list(dict.fromkeys([*a, *b]))
        return _worst(_tree_diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k)) for k in keys)
    return 0.0, ""


def allows_everything(mask: Any) -> bool:
    """An attention or padding mask that masks nothing: boolean all true, integer all one (a padding
    mask without padding), floating all zero (an additive mask). Where eager passes ``None`` (it read
    the mask's values and found no padding) such a mask gives the same result: a graph cannot read
    values to skip it."""
    if not isinstance(mask, torch.Tensor) or mask.is_meta or mask.numel() == 0 or mask.dim() not in (2, 4):
        return False
    if mask.dtype == torch.bool:
        return bool(mask.all())
    if mask.is_floating_point():
        return not bool(mask.any())
    return bool((mask == 1).all())


def _none_for_mask(a: Any, b: Any, path: str = "") -> list[str]:
    """Where eager passed ``None`` and the subgraphs a mask that masks nothing (see allows_everything)."""
    if a is None and isinstance(b, torch.Tensor) and allows_everything(b):
        return [path or "value"]
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return [p for k, (x, y) in enumerate(zip(a, b)) for p in _none_for_mask(x, y, f"{path}[{k}]")]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [p for k in dict.fromkeys([*a, *b]) for p in _none_for_mask(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))]
    return []


def _worst(found: Any) -> tuple[float, str]:
    best = (0.0, "")
    for worst, where in found:
        if worst > best[0]:
            best = (worst, where)
    return best


def _kind(value: Any) -> str:
    return f"Tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:40]
