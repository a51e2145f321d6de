"""Joining a rewritten site's two branch results with ``torch.where``, and checking they may be.

``torch.where(pred, a, b)`` computes both branches; it gives each branch's own result only when
the two results have the same structure, dtypes and shapes (or shapes that differ by size-1
dimensions alone, which the report then states), the same plain Python values, and finite values
on both sides (an untaken side with NaN/inf turns the gradient into NaN). :func:`compare_arms`
checks this on real results (fxprep's eager run computes the untaken side on the side);
:func:`where` joins them while tracing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


class RewriteError(RuntimeError):
    """A rewritten site cannot be captured as planned (its branches do not agree)."""


def where(pred: Any, a: Any, b: Any) -> Any:
    """``torch.where`` leaf by leaf over the two arms' results (a tensor, or a tuple of locals)."""
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        raise RewriteError(f"the branches return different structures ({spec_a} vs {spec_b})")
    out = []
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, (torch.Tensor, fx.Proxy)) or isinstance(y, (torch.Tensor, fx.Proxy)):
            out.append(torch.where(pred, x, y))
        elif x is y or x == y:
            out.append(x)
        else:
            raise RewriteError(f"the branches give different Python values ({x!r} vs {y!r})")
    return pytree.tree_unflatten(out, spec_a)


@dataclass
class Probe:
    """What computing a ``where`` site's untaken arm on the side showed."""

    problems: list[str] = field(default_factory=list)
    broadcast: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


def compare_arms(true_out: Any, false_out: Any, probe: Probe) -> list[str]:
    """Why ``torch.where`` over these two results would not give what each branch gives."""
    flat_t, spec_t = pytree.tree_flatten(true_out)
    flat_f, spec_f = pytree.tree_flatten(false_out)
    if spec_t != spec_f:
        return [f"the branches return different structures ({spec_t} vs {spec_f})"]
    problems = []
    for a, b in zip(flat_t, flat_f):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype:
                problems.append(f"the branches give different dtypes ({a.dtype} vs {b.dtype})")
            if a.shape != b.shape:
                try:
                    joint = torch.broadcast_shapes(a.shape, b.shape)
                except RuntimeError:
                    joint = None
                if joint is not None and a.numel() == b.numel() == math.prod(joint):
                    probe.broadcast.append((tuple(a.shape), tuple(b.shape)))
                else:
                    problems.append(f"the branches give shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                                    f"which torch.where cannot join without repeating values")
            for side, t in (("true", a), ("false", b)):
                if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
                    problems.append(f"the {side} branch gives NaN/inf on these inputs; computed on the untaken "
                                    f"side by torch.where it would turn gradients into NaN")
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            problems.append("one branch gives a tensor, the other a Python value")
        elif not (a is b or a == b):
            problems.append(f"the branches give different Python values ({a!r} vs {b!r})")
    return problems
