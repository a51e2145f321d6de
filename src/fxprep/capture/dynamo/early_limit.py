"""A capture that specialises or bounds a declared dimension, stopped and said in the model's terms.

Where the shape-general capture asks for it (``CaptureRequest.scan_search``), a capture stops at the
first guard that fails above the example's size of a declared dimension (:class:`Limit`), or at the
violation that ends it, and raises :class:`LimitFound`, so the scan search (:mod:`.scans`) starts
there instead of after a whole failed trace. Both the whole model's capture (:func:`..shapes.dims.model_sources`)
and a reused block's own capture (:func:`input_sizes`, :func:`sources`) stop so.

See docs/shapes.md ("Under the hood").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...reporting.diagnose import first_line
from ..shapes.dims import positional_names, self_in_args
from .blocks import call_inputs
from .guard_log import AddedGuard, Stopped, example_values
from .guard_read import bound
from .scans import failing_size

_VIOLATED = re.compile(r"Constraints violated \((.*?)\)!")


class LimitFound(RuntimeError):
    """A capture (of the model, or of a repeated block alone) specialised or bounded declared
    dimensions of the model's inputs: ``sources``, as the model's capture names them
    (``L['input_ids'].size()[1]``). ``guard``: the guard the capture was stopped at (:class:`Limit`),
    already found limiting, where there is one (not for a capture ended by a constraint violation)."""

    def __init__(self, where: str, sources: list[str], why: str, guard: AddedGuard | None = None):
        super().__init__(f"the capture of {where} limits {', '.join(sources)} ({why})")
        self.sources = sources
        self.guard = guard


def input_sizes(outer: fx.GraphModule, model: nn.Module, prepared_call: ExampleInputs) -> dict[Any, str]:
    """Each symbol that is the size of a model input's dimension in the outer graph (whose inputs
    are ``prepared_call``'s, flattened), with that size's name (``L['input_ids'].size()[1]``)."""
    flat = pytree.tree_flatten_with_path((prepared_call.args, prepared_call.kwargs))[0]
    placeholders = [n for n in outer.graph.nodes if n.op == "placeholder"]
    positional = positional_names(model, len(prepared_call.args))
    out: dict[Any, str] = {}
    for node, (path, _) in zip(placeholders, flat):
        value = node.meta.get("example_value")
        if len(path) != 2 or not isinstance(value, torch.Tensor):
            continue
        top = path[1]
        name = positional[top.idx] if path[0] == pytree.SequenceKey(0) else getattr(top, "key", None)
        for d, size in enumerate(value.shape if name is not None else ()):
            for symbol in _symbols(size):
                out.setdefault(symbol, f"L['{name}'].size()[{d}]")
    return out


def _symbols(size: Any) -> list[Any]:
    """The symbols a size of the outer graph is: as made, and as the shape environment now reads it.
    Both, because a guard the outer capture met later may have replaced the symbol: xLSTM's stand-in
    for its reused block computed its output on the outer capture's fake tensors and fixed ``seq``
    there (a guard set aside: the block's own capture records its guards), so every size made of
    ``seq`` reads 8 afterwards, and the block's own guards on its length were not read as ``seq``'s."""
    if not isinstance(size, torch.SymInt):
        return []
    made, now = getattr(size.node, "_expr", None), size.node.expr
    return [e for e in dict.fromkeys((made, now)) if e is not None and e.is_Symbol]


# a size of a block's input made of model input sizes by arithmetic (``3*seq``): the expression over
# one symbol per model input size, and that symbol's source (``L['input_ids'].size()[1]``) and example value
Derived = tuple[Any, dict[Any, tuple[str, int]]]


@dataclass(frozen=True)
class BlockSizes:
    """A reused block's input sizes in the model's terms (:func:`sources`), by the name its own capture
    gives each (``L['args'][0].size()[1]``): ``names``, those that are a model input's size exactly;
    ``derived``, those made of such sizes by arithmetic (ProphetNet's main and two predicted streams
    side by side: ``3*seq``), whose guards are read in the model's sizes too (:func:`.guard_log.renamed`)."""

    names: dict[str, str] = field(default_factory=dict)
    derived: dict[str, Derived] = field(default_factory=dict)

    def recorded(self) -> dict[str, str]:
        """Each source a guard of the block's capture is recorded under that names a model input's
        size, to that size (for :class:`Limit`)."""
        parts = {source: source for _, made in self.derived.values() for source, _ in made.values()}
        return {**parts, **self.names}


def sources(node: fx.Node, block: nn.Module, call: ExampleInputs, by_symbol: dict[Any, str]) -> BlockSizes:
    """For ``block``, called at ``node`` in the outer graph and captured alone on ``call``: each size
    of a tensor it is passed, by the name its capture gives it, mapped to the model input's size it
    is exactly (``by_symbol``: :func:`input_sizes`), or made of (:class:`BlockSizes`)."""
    out = BlockSizes()
    passed = pytree.tree_flatten_with_path((call.args, call.kwargs))[0]
    nodes = call_inputs(node)[0]
    if not by_symbol or len(nodes) != len(passed):
        return out
    positional = positional_names(block, len(call.args))
    shift = 1 if self_in_args(block) is not None else 0  # a decorated forward: ``self`` is args[0]
    for (path, value), outer in zip(passed, nodes):
        value_at_call = outer.meta.get("example_value") if isinstance(outer, fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(value_at_call, torch.Tensor):
            continue
        names = _source_names(path, positional, shift)
        for d, size in enumerate(value_at_call.shape):
            model_name = next((by_symbol[e] for e in _symbols(size) if e in by_symbol), None)
            if model_name is not None:
                out.names.update({f"{name}.size()[{d}]": model_name for name in names})
                continue
            made = _derived(size, by_symbol)
            if made is not None:
                out.derived.update({f"{name}.size()[{d}]": made for name in names})
    return out


def _derived(size: Any, by_symbol: dict[Any, str]) -> Derived | None:
    """``size`` (of the outer graph) as an expression over model input sizes alone, each a symbol
    named after its source, with its example value; None where it is one of them, or names another."""
    if not isinstance(size, torch.SymInt):
        return None
    expr = size.node.expr
    free: set[Any] = getattr(expr, "free_symbols", set())
    if not free or expr.is_Symbol or not all(s in by_symbol for s in free):
        return None
    values = example_values(size.node.shape_env)
    if not all(s in values for s in free):
        return None
    named = {s: sympy.Symbol(by_symbol[s], integer=True, positive=True) for s in free}
    return expr.xreplace(named), {named[s]: (by_symbol[s], int(values[s])) for s in free}


def _source_names(path: tuple[Any, ...], positional: list[str], shift: int = 0) -> list[str]:
    """How Dynamo may name the tensor at ``path`` in ``(args, kwargs)``: after the frame's local
    holding it, ``L['x']`` for a parameter of ``forward`` (``positional``: their names),
    ``L['args'][0]`` or ``L['kwargs']['x']`` where ``forward`` takes ``*args, **kwargs`` (a
    checkpointing layer's ``__call__``; ``L['args'][1]`` with ``shift`` 1, where a decorator's
    wrapper holds ``self`` first: :func:`..shapes.dims.self_in_args`); ``[0]`` on for a tensor in a tuple."""
    inner = "".join(f"[{k.idx}]" if isinstance(k, pytree.SequenceKey) else f"['{getattr(k, 'key', k)}']"
                    for k in path[2:])
    if len(path) < 2:
        return []
    top = path[1]
    if path[0] == pytree.SequenceKey(0) and isinstance(top, pytree.SequenceKey):
        named = [f"L['{positional[top.idx]}']{inner}"] if top.idx < len(positional) else []
        return [f"L['args'][{top.idx + shift}]{inner}", *named]
    key = getattr(top, "key", None)
    return [f"L['kwargs']['{key}']{inner}", f"L['{key}']{inner}"] if key is not None else []


def raise_if_specialised(err: BaseException, block: str, names: dict[str, str]) -> None:
    """Raise :class:`LimitFound` when ``err`` (the failure of ``block``'s own capture) is a
    constraint violation of sizes that are all declared dimensions of the model's inputs (``names``:
    :func:`sources`); else return, and the caller goes on as before."""
    found = _VIOLATED.search(str(err)) if names else None
    if found is None:
        return
    violated = [s.strip() for s in found.group(1).split(", ") if s.strip()]
    if violated and all(s in names for s in violated):
        why = f"{type(err).__name__}: {first_line(err)}"
        raise LimitFound(f"'{block}' alone", list(dict.fromkeys(names[s] for s in violated)), why) from err


class Limit:
    """Whether a guard a block's own capture adds (recorded under the model inputs' names,
    :func:`.guard_log.renamed`) fails at a size above the example's of a declared dimension (a
    chunked scan's ``(padded // 64) == 1`` bounds the length to one chunk without failing the block's
    capture; the whole-model capture would find it so): the ``stop`` of that capture, which ends it
    there (:class:`.guard_log.Stopped`), returning ``(source, size where it fails, guard)``.
    ``past_bounds``: a guard that only bounds the dimension by a constant (``seq < 512``) is passed
    (:func:`bound`), the capture stopped at the first that does more. ``dimension``: each
    model input's size (``L['input_ids'].size()[1]``) to the declared dimension it is (``seq``):
    with ``Dim.AUTO`` each input has its own symbol, and a guard relating two inputs' lengths
    (Qwen3.5's ``mm_token_type_ids`` against ``input_ids``) is evaluated with both at each size,
    as :mod:`.guard_read` reads it, not one grown past the other."""

    def __init__(self, names: dict[str, str], past_bounds: bool = False, dimension: dict[str, str] | None = None):
        self.names = {**{v: v for v in names.values()}, **names}  # a source as recorded -> the model input's
        self.seen: set[str] = set()
        self.past_bounds = past_bounds
        self.dimension = dimension or {}

    def __call__(self, guard: AddedGuard) -> tuple[str, int, AddedGuard] | None:
        text = str(guard.expr)
        if not guard.stack or guard.aside or text in self.seen:  # a stand-in's computation: no graph holds it
            return None
        self.seen.add(text)
        by_dimension: dict[str, tuple[str, set[Any]]] = {}  # declared dimension -> (first source, its symbols)
        for symbol, named in guard.sources.items():
            for source in named:
                if source in self.names:
                    canonical = self.names[source]
                    by_dimension.setdefault(self.dimension.get(canonical, canonical), (canonical, set()))[1].add(symbol)
        for source, symbols in by_dimension.values():
            size = next((guard.hints[s] for s in symbols if s in guard.hints), None)
            past = failing_size(guard, symbols, size) if size is not None else None
            if past is not None and not (self.past_bounds and _over(guard, symbols) and bound(guard, "size")):
                return source, past, guard
        return None


def _over(guard: AddedGuard, symbols: set[Any]) -> bool:
    return bool(getattr(guard.expr, "free_symbols", set()) <= symbols)


def limited(where: str, stopped: Stopped) -> LimitFound:
    """The failure of a capture (``where``: of the model, or of a block alone) ended by :class:`Limit`."""
    source, past, guard = stopped.found
    return LimitFound(where, [source], f"a guard it adds fails at {past}: {str(guard.expr)[:120]}", guard)


__all__ = ["BlockSizes", "LimitFound", "input_sizes", "Limit", "limited", "raise_if_specialised", "sources"]
