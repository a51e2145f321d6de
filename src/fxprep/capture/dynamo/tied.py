"""Tied outputs: a stand-in's output under dynamic shapes taken from a static run, then proven.

Under dynamic shapes a block stand-in (:mod:`.stubs`) needs a symbolic fake output. Rather than
running the block on symbols (slow), it runs once on static fake tensors and ties each output to the
input whose shape it has (:func:`guess`); after the block's own capture, :func:`disproof` checks the
tie and the block's shape guards, and a failed tie redoes the capture with the block run on the
symbols. Only used where the outer capture has symbolic sizes and does not decide values read from
data.

See docs/concepts/block-reuse.md ("Under the hood") for the measured cost that motivated it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..shapes.dims import hints
from .blocks import call_inputs, size_key

Tie = tuple[tuple[int, int], ...]  # (output leaf, input leaf) pairs


def symbolic(flat: list[Any]) -> bool:
    """Whether any input of the call has a symbolic size (the outer capture's dynamic dimensions)."""
    return any(isinstance(x, torch.Tensor) and any(type(s) is not int for s in x.shape) for x in flat)


def alike(flat: list[Any]) -> bool:
    """Whether two of the call's input sizes are different symbols at the same size in the example
    (Llava-NeXT's merged text length and its mask's, the one after an opaque part): the block's
    own capture then often finds them equal and uses one symbol for both, which a guessed output
    cannot be proven against (:func:`disproof`), and the outer capture was made again, one whole
    trace more. Run on the symbols instead, the block adds that equality to the outer capture."""
    seen: dict[int, Any] = {}
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            continue
        for size in leaf.shape:
            if type(size) is int:
                continue
            expr, hint = size.node.expr, hints([size])
            if not isinstance(expr, sympy.Symbol) or hint is None:
                continue
            if seen.setdefault(hint[0], expr) != expr:
                return True
    return False


def guess(copy_in: Callable[[Any], nn.Module], flat: list[Any], spec: Any) -> tuple[Any, list[Any]] | None:
    """The block's output described from one run (of ``copy_in(fake_mode)``, the block copied to a
    fake mode's tensors) on static fake tensors at the hints of the
    symbolic sizes in ``flat`` (the call's flattened ``(args, kwargs)``, ``spec`` their structure):
    ``(output spec, leaves)``, each leaf ``("in", i)`` (input ``i`` itself), ``("tie", i, dtype,
    device, requires_grad)`` (a fresh contiguous tensor shaped like input ``i``) or ``("c", value)``.
    None when any output is none of these or the run fails: the symbolic run decides then."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    statics: list[Any] = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            sizes, strides = hints(leaf.shape), hints(leaf.stride())
            if sizes is None or strides is None:
                return None
            statics.append((sizes, strides, leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, (torch.SymFloat, torch.SymBool)):
            return None
        elif isinstance(leaf, torch.SymInt):
            hint = hints([leaf])
            if hint is None:
                return None
            statics.append(("int", hint[0]))
        else:
            statics.append(("value", leaf))
    try:
        with unset_fake_temporarily():
            mode = FakeTensorMode()
            copy = copy_in(mode)
            with mode:
                inputs = [_static(s) for s in statics]
                args, kwargs = pytree.tree_unflatten(inputs, spec)
                out = copy(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a guess only: the symbolic run decides what a failure means
        return None
    leaves, out_spec = pytree.tree_flatten(out)
    described: list[Any] = []
    storages = {_storage(x) for x in inputs if isinstance(x, torch.Tensor)}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            same = next((i for i, x in enumerate(inputs) if x is leaf), None)
            if same is not None:
                described.append(("in", same))
                continue
            if _storage(leaf) in storages or not leaf.is_contiguous():
                return None  # a view of an input, or strides a fresh tensor would not have
            shaped = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.shape == leaf.shape]
            if not shaped or len({size_key(flat[i].shape) for i in shaped}) != 1:
                return None  # shaped like no input, or like inputs whose symbolic sizes differ
            described.append(("tie", shaped[0], leaf.dtype, flat[shaped[0]].device, leaf.requires_grad))
        elif isinstance(leaf, (type(None), bool, int, float, str)):
            described.append(("c", leaf))
        else:
            return None
    return out_spec, described


class Guesses:
    """The guesses of one outer capture: which outputs were guessed (by cache key), which keys no
    guess could be made for (not tried again), and, per block instance, the ties its outputs were
    given with, each to be proven by :func:`disproof` at every call before anything is stamped."""

    def __init__(self, on: bool):
        self.on = on  # dynamic shapes, values not read from data: a guess may be tried
        self.guessed: set[Any] = set()
        self.refused: set[Any] = set()
        self.ties: dict[int, set[Tie]] = {}  # id(instance) -> the ties its guessed outputs were made with

    def describe(self, key: Any, copy_in: Callable[[Any], nn.Module], flat: list[Any],
                 spec: Any) -> tuple[Any, list[Any]] | None:
        """A guessed description of the output of the call keyed ``key`` (:func:`guess`), or None
        where none is tried or it was refused."""
        if not self.on or key in self.refused or not symbolic(flat):
            return None
        described = None if alike(flat) else guess(copy_in, flat, spec)
        (self.refused if described is None else self.guessed).add(key)
        return described

    def given(self, key: Any, instance: nn.Module, leaves: list[Any]) -> None:
        """The description keyed ``key`` was given as ``instance``'s output: a guessed one's tie
        is recorded for the proof."""
        if key in self.guessed:
            self.ties.setdefault(id(instance), set()).add(tie_of(leaves))

    def of(self, instance: nn.Module) -> set[Tie]:
        """The ties ``instance``'s outputs were given with (none when no output was guessed)."""
        return self.ties.get(id(instance), set())


def tie_of(described: list[Any]) -> Tie:
    """The (output leaf, input leaf) pairs of a guess's ``("tie", ...)`` leaves."""
    return tuple((k, leaf[1]) for k, leaf in enumerate(described) if leaf[0] == "tie")


def made(leaf: Any, inputs: list[Any]) -> torch.Tensor:
    """A ``("tie", ...)`` leaf at one call: fresh, contiguous, shaped like the tied input there
    (made under the outer capture's fake mode, so its sizes are that capture's symbols)."""
    _, i, dtype, device, grad = leaf
    t = torch.empty(inputs[i].shape, dtype=dtype, device=device)
    return t.requires_grad_(grad) if grad else t


def disproof(block: fx.GraphModule, node: fx.Node, tie: Tie) -> str | None:
    """Why the tie a stand-in's output was guessed with does not hold at the outer graph's call
    ``node``, by ``block``, the graph captured from the block on its own; None when it holds.

    The block graph's placeholders are the call's inputs in order. Each symbol of the block's
    capture is a size of one of them, so it stands for that size's expression at ``node`` in the
    outer capture. Mapped so: every shape guard of the block's capture must hold at ``node`` (the
    outer capture's shape environment proves it without adding a guard), and each tied output's
    sizes must be the tied input's, with contiguous strides."""
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    flat, _ = call_inputs(node)
    if len(placeholders) != len(flat):
        return "the block graph's inputs are not the call's"
    mapping: dict[sympy.Symbol, sympy.Expr] = {}
    inner_env = outer_env = None
    outer_values: list[Any] = []
    for ph, leaf in zip(placeholders, flat):
        inner = ph.meta.get("example_value")
        outer = leaf.meta.get("example_value") if isinstance(leaf, fx.Node) else leaf
        outer_values.append(outer)
        if not isinstance(inner, torch.Tensor):
            if isinstance(outer, torch.Tensor) and (inner is not None or ph.users):
                return "the block graph's inputs are not the call's"
            continue  # a value, or an input the block never reads (Dynamo keeps no example of it)
        if not isinstance(outer, torch.Tensor):
            return "the block graph's inputs are not the call's"
        inner_env = inner_env or _env(inner)
        outer_env = outer_env or _env(outer)
        if inner.dim() != outer.dim():
            return "the block graph's inputs are not the call's"
        for a, b in zip(inner.shape, outer.shape):
            ea, eb = _expr(a), _expr(b)
            if isinstance(ea, sympy.Symbol):
                if mapping.setdefault(ea, eb) != eb:
                    return f"the block's size {ea} stands for both {mapping[ea]} and {eb}"
            elif ea != eb:
                return f"the block's capture has size {ea} where the call has {eb}"
    if inner_env is None or outer_env is None:
        return "no symbolic sizes to check"
    why = _guards_hold(inner_env, outer_env, mapping)
    if why is not None:
        return why
    output = next(n for n in reversed(block.graph.nodes) if n.op == "output")
    outs = [v.meta.get("example_value") if isinstance(v, fx.Node) else v for v in pytree.tree_leaves(output.args[0])]
    for k, i in tie:
        if k >= len(outs) or not isinstance(outs[k], torch.Tensor) or not isinstance(outer_values[i], torch.Tensor):
            return f"output {k} is not a tensor in the block's graph"
        got = [_mapped(_expr(s), mapping) for s in outs[k].shape]
        want = [_expr(s) for s in outer_values[i].shape]
        if None in got or len(got) != len(want) or any(sympy.expand(g - w) != 0 for g, w in zip(got, want)):
            return f"output {k} has sizes {list(outs[k].shape)} in the block's graph, not input {i}'s"
        stride = sympy.Integer(1)
        for d in reversed(range(len(want))):
            actual = _mapped(_expr(outs[k].stride()[d]), mapping)
            if want[d] != 1 and (actual is None or sympy.expand(actual - stride) != 0):
                return f"output {k} is not contiguous in the block's graph"
            stride = stride * want[d]
    return None


def _guards_hold(inner_env: Any, outer_env: Any, mapping: dict[sympy.Symbol, sympy.Expr]) -> str | None:
    """Every guard the block's capture made on its sizes, and every range it narrowed, holds in the
    outer capture at the call (``mapping``: the block's symbols as the call's sizes)."""
    replace = getattr(inner_env, "replace", lambda e: e)  # sizes are read with the symbols it found equal replaced
    for guard in getattr(inner_env, "guards", []):
        expr = _mapped(replace(guard.expr), mapping)
        if expr is None:
            return f"the block's capture guards on {guard.expr}, a size not among its inputs'"
        if expr is not sympy.true and outer_env._maybe_evaluate_static(expr) is not sympy.true:
            return f"the block's capture guards on {guard.expr}, which the call does not prove ({expr})"
    if getattr(inner_env, "deferred_runtime_asserts", None) and any(inner_env.deferred_runtime_asserts.values()):
        return "the block's capture asserts on its sizes at run time"
    for symbol, vr in getattr(inner_env, "var_to_range", {}).items():
        if symbol not in mapping:
            continue
        lower, upper = vr.lower, vr.upper
        if lower <= 2 and upper.is_infinite:
            continue
        target = mapping[symbol]
        if not isinstance(target, sympy.Symbol) or target not in outer_env.var_to_range:
            return f"the block's capture narrows {symbol} to {vr}"
        outer = outer_env.var_to_range[target]
        if outer.lower < lower or outer.upper > upper:
            return f"the block's capture narrows {symbol} to {vr}, the call's range is {outer}"
    return None


def _mapped(expr: Any, mapping: dict[sympy.Symbol, sympy.Expr]) -> sympy.Expr | None:
    """``expr`` of the block's capture in the outer capture's symbols; None when it has a symbol
    the mapping lacks (block and outer symbols share names, so an unmapped one must not slip by)."""
    expr = sympy.sympify(expr)
    if not expr.free_symbols <= set(mapping):
        return None
    return expr.xreplace(mapping)


def _expr(size: Any) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _env(value: Any) -> Any:
    mode = getattr(value, "fake_mode", None)
    return getattr(mode, "shape_env", None)


def _static(described: Any) -> Any:
    if described[0] == "int":
        return described[1]
    if described[0] == "value":
        return described[1]
    sizes, strides, dtype, device, grad = described
    t = torch.empty_strided(sizes, strides, dtype=dtype, device=device)
    return t.requires_grad_(grad) if grad else t


def _storage(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())
