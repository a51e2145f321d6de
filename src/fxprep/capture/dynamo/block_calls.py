"""What a repeated block is called with where the outer graph calls it (block reuse, :mod:`.reuse`).

A block is captured alone on the inputs it really receives in the captured outer graph, not in an
eager run of the model: code may take another path under Dynamo (transformers builds an explicit
attention mask when compiling, ``None`` eagerly), and the block must be captured on what it gets
there. :func:`record_inputs` runs the outer graph once and keeps each wanted call's inputs;
:func:`block_call` makes them the block's capture example (requiring grad exactly where the outer
capture's values did); :func:`block_spec` says which of their dimensions are dynamic;
:func:`decided_otherwise` runs a block graph whose values read from data were decided from one
instance's inputs on another's, to tell whether it holds there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ... import decisions
from ...core.inputs import ExampleInputs, same_layout
from ...core.runs import SEED, preserved_state
from ...reporting.diagnose import first_line
from .blocks import call_inputs, freeze


@dataclass
class Member:
    """One call of a block instance in the outer graph."""

    node: fx.Node
    name: str
    module: nn.Module
    k: int  # which call of this instance (0 for the first)


class _Recorded(BaseException):
    """Stops the recording run once every wanted input is seen (not an Exception: model code that
    catches those must not swallow it)."""


def record_inputs(outer: fx.GraphModule, model: nn.Module, call: ExampleInputs,
                   wanted: list[Member], share: bool = False) -> dict[tuple[int, int], Any]:
    """The ``(args, kwargs)`` each wanted call really receives, from one run of the outer graph
    (which calls the blocks as modules) that stops as soon as the last of them is seen. ``share``:
    a tensor several calls receive unchanged is copied once (every member is recorded when values
    are decided: one copy of the mask, not one per layer); their users then copy before running.

    Why the captured graph and not the model: code may take another path under Dynamo than
    eagerly (transformers builds an explicit attention mask when compiling, ``None`` eagerly), and
    the block must be captured on what it receives in the graph."""
    want = {(id(m.module), m.k) for m in wanted}
    counts: dict[int, int] = {}
    got: dict[tuple[int, int], Any] = {}
    # one copy of a tensor several wanted calls receive unchanged (a mask, rotary tables: every
    # layer's, when values are decided); the original is held so that its id is not reused
    kept: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen = kept.get(id(t)) if share else None
        if seen is not None and seen[1] == t._version:
            return seen[2]
        copy = same_layout(t)
        if share:
            kept[id(t)] = (t, t._version, copy)
        return copy

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        k = counts.get(id(module), 0)
        counts[id(module)] = k + 1
        if (id(module), k) in want:
            got[(id(module), k)] = pytree.tree_map_only(torch.Tensor, keep, (tuple(args), dict(kwargs)))
            if len(got) == len(want):
                raise _Recorded

    handles = [m.module.register_forward_pre_hook(pre, with_kwargs=True) for m in wanted]
    fresh = call.fresh_copy()
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            outer(*fresh.args, **fresh.kwargs)
    except _Recorded:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = [m.name for m in wanted if (id(m.module), m.k) not in got]
    if missing:
        raise RuntimeError(f"the captured graph did not call {', '.join(missing[:3])}")
    return got


def block_call(member: Member, recorded: Any) -> ExampleInputs:
    """The recorded inputs, requiring grad exactly where the outer capture's values did."""
    flat, spec = call_inputs(member.node)
    rec_flat, rec_spec = pytree.tree_flatten(recorded)
    if str(spec) != str(rec_spec) or len(flat) != len(rec_flat):
        raise RuntimeError(f"the inputs of '{member.name}' recorded eagerly do not match the captured call")
    out = []
    for node, value in zip(flat, rec_flat):
        if isinstance(node, fx.Node) != isinstance(value, torch.Tensor) or (
                not isinstance(node, fx.Node) and freeze(node) != freeze(value)):
            raise RuntimeError(f"the inputs of '{member.name}' recorded eagerly do not match the captured call")
        if isinstance(value, torch.Tensor) and isinstance(node, fx.Node):
            ev = node.meta.get("example_value")
            grad = bool(getattr(ev, "requires_grad", False)) and (value.is_floating_point() or value.is_complex())
            if grad != value.requires_grad:
                value = value.detach().requires_grad_(grad)
        out.append(value)
    args, kwargs = pytree.tree_unflatten(out, rec_spec)
    return ExampleInputs(tuple(args), dict(kwargs))


def block_spec(member: Member, call: ExampleInputs, *, declared_only: bool = False) -> dict[str, Any] | None:
    """Dynamo's ``dynamic_shapes`` for capturing ``member`` alone on ``call`` (its recorded inputs):
    every dimension that is symbolic where the outer graph calls it is ``Dim.DYNAMIC`` (relations
    between them, such as a mask's last size being the sequence length, Dynamo finds itself; a
    dimension the block's code specialises fails the capture, and reuse falls back). None when
    every size there is static. Not only under declared dimensions: where values read from data are
    decided (:mod:`.values`), a size computed from them stays symbolic in the outer graph (the number
    of Pixtral's patches, from the image sizes), and a block captured static on the example's size
    would return another shape than its stand-in did there (reuse then gave up). ``declared_only``:
    only the dimensions whose sizes follow the declared ones (a backed symbol in them), not those
    made from values read from data alone."""
    from torch.export import Dim
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def wanted(size: Any) -> bool:
        if type(size) is int:
            return False
        return not declared_only or bool(size.node.expr.free_symbols - free_unbacked_symbols(size))

    flat, _ = call_inputs(member.node)
    dims: list[Any] = []
    for leaf in flat:
        ev = leaf.meta.get("example_value") if isinstance(leaf, fx.Node) else None
        if isinstance(ev, torch.Tensor):
            symbolic = {d: Dim.DYNAMIC for d, s in enumerate(ev.shape) if wanted(s)}
            dims.append(symbolic or None)
        else:
            dims.append(None)
    if not any(dims):
        return None
    _, rec_spec = pytree.tree_flatten((call.args, call.kwargs))
    args, kwargs = pytree.tree_unflatten(dims, rec_spec)
    bound = inspect.signature(member.module.forward).bind(*args, **kwargs)
    return dict(bound.arguments)


def decided_otherwise(gm: fx.GraphModule, first: Member, member: Member, recorded: dict[tuple[int, int], Any]) -> str | None:
    """Why the graph captured from ``first``, whose values read from data were decided from its
    inputs, does not hold for ``member``: the check that fails on ``member``'s recorded inputs
    (Qwen2.5-VL's vision blocks split by window in most layers and by image in the full-attention
    ones), or None when it runs. The weights are ``first``'s; the checks follow the inputs."""
    call = block_call(member, recorded[(id(member.module), member.k)]).fresh_copy(keep_strides=True)  # shared
    with preserved_state(first.module), torch.no_grad():
        try:
            gm(*call.args, **call.kwargs)
        except Exception as err:  # noqa: BLE001 - any failure keeps the member apart
            node = decisions.failed_node(gm, err)
            if node is None:
                return f"{type(err).__name__}: {first_line(err)}"
            where = decisions.location(node) or "the model's code"
            return f"'{decisions.expression(node)}' fails, decided at {where}"
    return None


__all__ = ["Member", "block_call", "block_spec", "decided_otherwise", "record_inputs"]
