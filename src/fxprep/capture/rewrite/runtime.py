"""What rewritten code calls at each site, and the recorder of fxprep's eager checking runs.

A rewritten ``if`` calls :func:`branch` with its two arms as functions of their operands. What
``branch`` does depends on who runs it:

* eager Python (the user's model outside capture, fxprep's checking runs) or a predicate that is
  a plain Python bool: exactly the original ``if`` (a :class:`Recorder`, when one is active, notes
  which arm ran and, for a ``where`` site, computes the other arm on the side to learn its shape
  and whether it raises or gives NaN/inf there);
* Dynamo: ``torch.where(pred, a, b)`` with both arms computed, or ``torch.cond(pred, true_fn,
  false_fn, operands)``;
* ``torch.fx``: the same, the ``cond`` arms traced into two subgraphs (:mod:`.fx_branch`) called
  through :func:`fxprep.cond.cond`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .fx_branch import fx_branch
from .join import Probe, compare_arms, where


def _as_bool(pred: torch.Tensor) -> torch.Tensor:
    """The truth value Python's ``if`` takes of a one-element tensor, as a bool tensor."""
    return pred if pred.dtype == torch.bool else pred != 0


def _traced(value: Any) -> bool:
    return isinstance(value, fx.Proxy) or (isinstance(value, torch.Tensor) and torch.compiler.is_compiling())


def branch(route: str, key: str, pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
           operands: tuple[Any, ...]) -> Any:
    """One rewritten ``if``: see the module docstring. ``route`` is ``"where"`` or ``"cond"``."""
    if isinstance(pred, fx.Proxy):
        return fx_branch(route, key, pred, true_fn, false_fn, operands)
    if isinstance(pred, torch.Tensor) and torch.compiler.is_compiling():
        pred = _as_bool(pred)
        if route == "where":
            return where(pred, true_fn(*operands), false_fn(*operands))
        slots = [i for i, v in enumerate(operands) if isinstance(v, torch.Tensor)]
        tensors = tuple(operands[i] for i in slots)
        return torch.cond(pred, _with_constants(true_fn, operands, slots),
                          _with_constants(false_fn, operands, slots), tensors)
    if RECORDER is not None:
        return RECORDER.run(route, key, pred, true_fn, false_fn, operands)
    return true_fn(*operands) if pred else false_fn(*operands)


def _with_constants(fn: Callable[..., Any], operands: tuple[Any, ...], slots: list[int]) -> Callable[..., Any]:
    """``fn`` taking only the tensor operands (at ``slots``); the others are fixed to their values.
    An output that *is* an input is returned as a copy (``torch.cond`` forbids the aliasing)."""

    def arm(*tensors: Any) -> Any:
        args = list(operands)
        for i, t in zip(slots, tensors):
            args[i] = t
        # torch.cond refuses a branch returning one of its inputs (aliasing): hand back a copy.
        return pytree.tree_map_only(
            torch.Tensor, lambda out: out.clone() if any(out is t for t in tensors) else out, fn(*args))

    arm.__name__ = getattr(fn, "__name__", "arm")
    return arm


def _join(op: Callable[..., Any], a: Any, right: Any, absorbing: bool) -> Any:
    """``op(a, right)`` on a traced ``a``; a plain ``right`` either decides (``absorbing``) or drops out.
    ``logical_*`` take any dtype's truth value (nonzero), as Python's ``if`` does."""
    if _traced(right) or isinstance(right, torch.Tensor):
        return op(a, right)
    if bool(right) == absorbing:
        return torch.full_like(a, absorbing, dtype=torch.bool)
    return a


def and_(a: Any, b: Callable[[], Any]) -> Any:
    """``a and b()`` for a site's test. On traced tensors ``logical_and`` (``b`` then always
    runs); otherwise Python's short circuit."""
    if _traced(a):
        return _join(torch.logical_and, a, b(), absorbing=False)
    return a and b()


def or_(a: Any, b: Callable[[], Any]) -> Any:
    """``a or b()`` for a site's test. On traced tensors ``logical_or`` (``b`` then always runs);
    otherwise Python's short circuit."""
    if _traced(a):
        return _join(torch.logical_or, a, b(), absorbing=True)
    return a or b()


def not_(a: Any) -> Any:
    """``not a`` for a site's test: on a tensor (traced or not) ``logical_not``, whose truth value
    is Python's, so fxprep's eager runs still see that the site's condition is a tensor."""
    if isinstance(a, (torch.Tensor, fx.Proxy)):
        return torch.logical_not(a)
    return not a


HELPERS: dict[str, Any] = {
    "__fxprep_branch__": branch,
    "__fxprep_and__": and_,
    "__fxprep_or__": or_,
    "__fxprep_not__": not_,
}


# --- recording eager runs --------------------------------------------------------------------
@dataclass
class Recorder:
    """Active during fxprep's eager runs of the rewritten model (:data:`RECORDER`)."""

    model: nn.Module
    taken: dict[str, set[bool]] = field(default_factory=dict)
    tensor_pred: set[str] = field(default_factory=set)
    probes: dict[str, Probe] = field(default_factory=dict)
    speculative: int = 0

    def run(self, route: str, key: str, pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
            operands: tuple[Any, ...]) -> Any:
        is_tensor = isinstance(pred, torch.Tensor)
        taken = bool(pred)
        if is_tensor:
            self.tensor_pred.add(key)
        if not self.speculative:
            self.taken.setdefault(key, set()).add(taken)
        out = true_fn(*operands) if taken else false_fn(*operands)
        if route == "where" and is_tensor and pred.dtype != torch.bool:
            problem = f"the condition is a {pred.dtype} tensor; torch.where needs a bool one"
            probe = self.probes.setdefault(key, Probe())
            if problem not in probe.problems:
                probe.problems.append(problem)
        elif route == "where" and is_tensor:
            self._probe(key, taken, out, false_fn if taken else true_fn, operands)
        return out

    def _probe(self, key: str, taken: bool, out: Any, other_fn: Callable[..., Any], operands: tuple[Any, ...]) -> None:
        from ...core.runs import preserved_state

        probe = self.probes.setdefault(key, Probe())
        self.speculative += 1
        try:
            with torch.no_grad(), preserved_state(self.model):
                other = other_fn(*operands)
        except Exception as err:  # noqa: BLE001 - what the untaken side does is the finding
            problem = f"the untaken branch raises {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if problem not in probe.problems:
                probe.problems.append(problem)
            return
        finally:
            self.speculative -= 1
        true_out, false_out = (out, other) if taken else (other, out)
        for problem in compare_arms(true_out, false_out, probe):
            if problem not in probe.problems:
                probe.problems.append(problem)


RECORDER: Recorder | None = None
