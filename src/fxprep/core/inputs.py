"""Normalising and copying example inputs.

Users hand us a tensor, a tuple/list of positional arguments, or a dict of keyword arguments. Every
other stage works on one form, :class:`ExampleInputs` (``args`` tuple + ``kwargs`` dict), so the
calling convention is decided once, here.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ..errors import InvalidInput

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ExampleInputs:
    """Positional and keyword arguments for one call of the model."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def fresh_copy(self, *, keep_strides: bool = False) -> ExampleInputs:
        """A copy whose tensors are new objects, so a model that mutates its inputs cannot leak
        that mutation into the next run we compare against. ``keep_strides``: a tensor a copy
        cannot lay out as it is (an expanded mask) stays itself, detached (see :func:`same_layout`),
        for code captured on these inputs, which may depend on their layout."""
        def new(t: torch.Tensor) -> torch.Tensor:
            out = same_layout(t) if keep_strides else t.detach().clone()
            return out.requires_grad_(t.requires_grad)

        args, kwargs = pytree.tree_map_only(torch.Tensor, new, (self.args, self.kwargs))
        return ExampleInputs(tuple(args), dict(kwargs))

    def requiring_grad(self) -> ExampleInputs:
        """These inputs with their floating-point tensors requiring grad (``detach()`` views: no copy).

        Why: with inputs that do not require grad, Dynamo runs a custom ``autograd.Function`` as its
        forward alone and inlines it (``STE.apply(x)`` becomes ``torch.round(x)``), silently dropping
        the backward a quantization-aware user relies on. With a grad-requiring input it records the
        Function as one call, which the re-lifting keeps as a module (:mod:`fxprep.capture.dynamo`).
        """
        args, kwargs = pytree.tree_map_only(torch.Tensor, _mark_grad, (self.args, self.kwargs))
        return ExampleInputs(tuple(args), dict(kwargs))

    def describe(self) -> str:
        parts = [_describe(a) for a in self.args]
        parts += [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


def same_layout(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` with its strides, or ``t`` detached where no copy can have them
    (an expanded tensor's zero strides): a graph captured with a layout may rely on it."""
    copy = t.detach().clone()
    return copy if copy.stride() == t.stride() else t.detach()


def _mark_grad(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and not t.requires_grad and t.is_leaf:
        return t.detach().requires_grad_(True)
    return t


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        return f"Tensor[{shape}, {str(value.dtype).removeprefix('torch.')}]"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


def normalize_example_inputs(example_inputs: Any) -> ExampleInputs | None:
    """Turn what the user passed as ``example_inputs`` into :class:`ExampleInputs`.

    A single tensor is one positional argument; a tuple or list is the positional arguments; a dict
    is keyword arguments; an :class:`ExampleInputs` passes through. Anything else is refused rather
    than guessed at, because guessing the calling convention wrong gives confusing errors later.
    """
    if example_inputs is None:
        return None
    if isinstance(example_inputs, ExampleInputs):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return ExampleInputs((example_inputs,), {})
    if isinstance(example_inputs, (tuple, list)):
        return ExampleInputs(tuple(example_inputs), {})
    if isinstance(example_inputs, dict):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise InvalidInput(
                f"example_inputs is a dict, so its keys must be the forward() argument names (str); "
                f"got key(s) {bad!r}."
            )
        return ExampleInputs((), dict(example_inputs))
    raise InvalidInput(
        f"example_inputs must be a tensor, a tuple/list of positional arguments or a dict of keyword "
        f"arguments, not {type(example_inputs).__name__}. For a model called as model(x, y) pass "
        f"example_inputs=(x, y); for model(input_ids=...) pass example_inputs={{'input_ids': ...}}."
    )


def deepcopy_non_tensors(value: Any) -> Any:
    """Deep-copy a structure but share its tensors (used for concrete args and option values)."""
    memo = {id(t): t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}
    return copy.deepcopy(value, memo)


def split_calls(model: nn.Module, example: ExampleInputs,
                concrete_args: dict[str, Any] | None) -> tuple[ExampleInputs, ExampleInputs]:
    """How the original and the prepared module are called on ``example``.

    ``concrete_args`` are fixed into the graph: the original (and a tracer that runs it) needs them
    as arguments, the prepared module is called without them. Returns ``(original call, prepared call)``.
    """
    if not concrete_args:
        return example, example
    try:
        given = set(inspect.signature(model.forward).bind_partial(*example.args, **example.kwargs).arguments)
    except TypeError:
        given = set(example.kwargs)
    extra = {k: v for k, v in concrete_args.items() if k not in given}
    original = ExampleInputs(example.args, {**example.kwargs, **extra})
    prepared = ExampleInputs(example.args, {k: v for k, v in example.kwargs.items() if k not in concrete_args})
    return original, prepared
