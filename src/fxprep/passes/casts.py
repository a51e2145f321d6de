"""Conversions that convert nothing, dropped; the ones that do, written as a re-tracer accepts them.

With shapes propagated (:mod:`fxprep.passes.shape_prop`), a ``.to(...)`` whose input and output have
the same dtype and device is the identity and is dropped, as is a concatenation whose other inputs
are all empty; a conversion that changes the dtype stays, written ``x.to(dtype)`` with no device
argument, which re-tracers accept.

See docs/concepts/retraceable.md ("Under the hood").
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops
from .shape_prop import known_value

# no ``contiguous``: a layout change, harmless to every tracer, and views after it may rely on it
_CASTS = {"to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda"}


def _same_tensor_kind(a: object, b: object) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
        and a.device == b.device and [str(d) for d in a.shape] == [str(d) for d in b.shape]
    # sizes compared by their expressions: a symbolic size compared with == asks its shape
    # environment for a guard, which fails on sizes recorded by a shape-general capture


def run(gm: fx.GraphModule) -> tuple[int, int]:
    """Drop identity conversions; rewrite the remaining ``.to`` calls to dtype-only form.
    Needs ``meta['val']`` on the nodes (shape propagation). Returns (dropped, rewritten).
    Edits ``gm.graph`` in place; the caller recompiles."""
    dropped = rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target not in _CASTS or not node.args:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node):
            continue
        before, after = known_value(source), known_value(node)
        if _same_tensor_kind(before, after) and not node.kwargs.get("copy", False):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            dropped += 1
            continue
        if node.target == "to" and isinstance(after, torch.Tensor) and isinstance(before, torch.Tensor) \
                and before.device == after.device and (len(node.args) > 1 or node.kwargs):
            node.args, node.kwargs = (source, after.dtype), {}
            rewritten += 1
    for node in list(gm.graph.nodes):
        if (kept := _identity_concat(gm, node)) is not None:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            dropped += 1
    return dropped, rewritten


def _identity_concat(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The one non-empty input of a concatenation whose other inputs are all empty, else None."""
    is_cat = node.op == "call_function" and node.target in (torch.cat, torch.concat) or \
        node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), ops.Concat)
    if not is_cat:
        return None
    inputs = node.all_input_nodes
    values = [known_value(n) for n in inputs]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    full = [n for n, v in zip(inputs, values) if v.numel() > 0]
    if len(full) != 1 or not _same_tensor_kind(known_value(full[0]), known_value(node)):
        return None
    return full[0]
