"""A prepared graph made for toolkits that re-trace or read it: :func:`retraceable`.

Brevitas and Sony MCT re-trace a graph with their own ``torch.fx`` tracers, and several toolkits
read shapes off its nodes; both refuse or quantize the mask, position and conversion code a prepared
graph carries. :func:`retraceable` returns a new GraphModule for one input size, sharing every
module and tensor, with shapes recorded, shape-only computations folded, identity conversions
dropped, tuple outputs read and the model's positional calling convention. The adapters
(:mod:`.brevitas`, :mod:`.mct`) apply it, not ``prepare_model``.

See docs/concepts/retraceable.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen
from torch.utils import _pytree as pytree

from ..core.inputs import normalize_example_inputs
from ..errors import InvalidInput
from ..passes import casts, fold_constants, shape_prop, tuple_outputs
from .contract import Adapter

__all__ = ["ADAPTER", "retraceable"]

# the graph for any torch.fx re-tracer (Brevitas and MCT use it): torch is all it needs
ADAPTER = Adapter(toolkit="torch.fx re-tracers", module="torch", requires="", entry_points=("retraceable",),
                  page="concepts/retraceable.md")

HOLDER = "fxprep_constants"
INTEGER_INPUTS = "fxprep_integer_inputs"  # the adapters' note, on the graph they return, of its integer inputs


def integer_valued(node: fx.Node) -> bool:
    """Whether ``node``'s recorded value (``meta["val"]``) is an integer or boolean tensor: token ids,
    positions, indices and counts, which the adapters keep away from activation quantizers."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def _copy_graph(gm: fx.GraphModule) -> tuple[fx.Graph, list[str]]:
    """A copy of ``gm``'s graph whose inputs are its placeholders, positional, and whose output is
    the flat list of what the graph returns; the names its placeholders get."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    codegen = gm.graph._codegen
    leaves = pytree.tree_leaves(out) if isinstance(codegen, _PyTreeCodeGen) else [out]
    flat = [leaf for leaf in leaves if isinstance(leaf, fx.Node)]
    graph.output(flat[0] if len(flat) == 1 else tuple(flat))
    names = []
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        orig = [a for a in codegen.pytree_info.orig_args if a != "self"]
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(orig) == len(placeholders):  # one tensor per argument: name the inputs as the model does
            names = orig
    graph._codegen = CodeGen()
    return graph, names


def _root(gm: fx.GraphModule, graph: fx.Graph) -> dict[str, Any]:
    """What a GraphModule of ``graph`` reads, by qualified name: ``gm``'s own objects (nothing copied)."""
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            owner, _, field = str(node.target).rpartition(".")
            root[str(node.target)] = getattr(gm.get_submodule(owner), field)
    return root


def _keep_persistence(gm: fx.GraphModule, new: fx.GraphModule) -> None:
    """Buffers ``gm`` does not save stay unsaved in ``new`` (a dict root registers every tensor
    as a saved buffer)."""
    for path, _ in list(new.named_buffers()):
        owner, _, field = path.rpartition(".")
        try:
            source = gm.get_submodule(owner)
        except AttributeError:
            continue
        if field in source._non_persistent_buffers_set:
            new.get_submodule(owner)._non_persistent_buffers_set.add(field)


def retraceable(gm: fx.GraphModule, example_inputs: Any, *, specialize: bool = False) -> fx.GraphModule:
    """A ``GraphModule`` computing what ``gm`` computes, made for toolkits that re-trace or read the graph.

    Shapes recorded, shape-only code folded, identity casts dropped, positional inputs; every module and
    tensor shared (docs/concepts/retraceable.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        example_inputs: A tensor, a tuple of positional or a dict of keyword arguments, run once to propagate shapes.
        specialize: Make the graph for the example's sizes only, folding the size code over symbolic sizes too (MCT, Brevitas).

    Returns:
        The new ``GraphModule``.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or ``example_inputs`` are missing.
    """
    if not isinstance(gm, fx.GraphModule):
        raise InvalidInput(f"retraceable expects the torch.fx.GraphModule from fxprep.prepare_model, not {type(gm).__name__}.")
    example = normalize_example_inputs(example_inputs)
    if example is None:
        raise InvalidInput("retraceable needs example_inputs: the graph is run once on them to propagate shapes.")
    graph, names = _copy_graph(gm)
    work = fx.GraphModule(_root(gm, graph), graph, "Retraceable")
    _keep_persistence(gm, work)
    flat = shape_prop.flat_inputs(gm, tuple(example.args), dict(example.kwargs))
    placeholders = [n for n in work.graph.nodes if n.op == "placeholder"]
    if specialize:  # forget the symbolic sizes: the run below records every node's value from the example
        for node in work.graph.nodes:
            for key in ("val", "example_value", "tensor_meta"):
                node.meta.pop(key, None)
    for node, value in zip(placeholders, flat):
        if node.meta.get("val") is None and isinstance(value, torch.Tensor):
            node.meta["val"] = value
    keep = fold_constants.foldable(work, static_shapes=specialize)  # decided before the one run of the graph
    values = shape_prop.run(work, tuple(flat), keep=keep)
    fold_constants.run(work, values, holder=HOLDER)
    casts.run(work)
    fold_constants.remove_dead_code(work)
    tuple_outputs.run(work)
    for node, name in zip(placeholders, names):
        node.target = name
        node.name = name if name not in {n.name for n in work.graph.nodes if n is not node} else node.name
    work.graph.lint()
    # the working module holds the prepared graph's objects (shared) and the folded constants:
    # it is the root of the new one, persistence included
    new = fx.GraphModule(_root(work, work.graph), work.graph, "Retraceable")
    _keep_persistence(work, new)
    new.train(gm.training)
    return new
