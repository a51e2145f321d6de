"""Shape propagation: ``node.meta["val"]`` and ``node.meta["tensor_meta"]`` on every node.

Graphs from ``torch.export`` carry a fake value on every node, and toolkits built on them read it
(NNCF's backend for ``torch.fx.GraphModule``, PT2E quantizers, MCT's reader runs torch's
``ShapeProp`` itself). A prepared graph has Dynamo's ``example_value`` on the nodes Dynamo made,
but none on the modules the passes added or on graphs from the fx tracer. This pass runs the graph
once on example inputs (real values, so opaque parts and user modules run as they do) and records
what each node produced as fake tensors (shape, dtype, device, strides: no data is kept).

A node that already has a ``val`` with symbolic sizes keeps it: a graph made dynamic in some
dimension must not be re-specialised to the example's sizes by this pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree


def has_symbolic_size(value: Any) -> bool:
    """Whether ``value`` (a tensor, SymInt, or a container of them) has a size decided at run time."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.SymInt | torch.SymFloat | torch.SymBool):
            return True
        if isinstance(leaf, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in leaf.shape):
            return True
    return False


def known_value(node: fx.Node) -> Any:
    """What the capture recorded for ``node`` (a fake tensor, a Python value), or None."""
    for key in ("val", "example_value"):
        if key in node.meta:
            return node.meta[key]
    return None


def flat_inputs(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)``: keywords bound to the
    forward's signature (defaults filled in), then flattened by the graph's own code generator."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, param in bound.signature.parameters.items():
        if param.kind is param.VAR_POSITIONAL:
            values.extend(bound.arguments.get(name, ()))
        elif param.kind is param.VAR_KEYWORD:
            values.extend(bound.arguments.get(name, {}).values())
        else:
            values.append(bound.arguments[name])
    return list(gm.graph.process_inputs(*values))


class _Recorder(fx.Interpreter):
    """Runs the graph, writing each node's fake value and tensor metadata; keeps the real values of
    the nodes in ``keep`` (everything else is freed as soon as its last user has run)."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node]):
        super().__init__(gm, garbage_collect_values=True)
        self.keep = keep
        self.kept: dict[fx.Node, Any] = {}
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def _fake(self, value: Any) -> Any:
        def one(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor):
                return self.fake_mode.from_tensor(leaf.detach() if leaf.requires_grad else leaf)
            return leaf

        return pytree.tree_map(one, value)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.keep:
            self.kept[n] = result
        if not has_symbolic_size(known_value(n)):
            n.meta["val"] = self._fake(result)
            if isinstance(result, torch.Tensor):
                n.meta["tensor_meta"] = _extract_tensor_metadata(result)
            elif isinstance(result, tuple | list) and all(isinstance(t, torch.Tensor) for t in result):
                n.meta["tensor_meta"] = type(result)(_extract_tensor_metadata(t) for t in result)
        return result


def run(gm: fx.GraphModule, example_args: tuple[Any, ...] = (), example_kwargs: dict[str, Any] | None = None, *,
        keep: Iterable[fx.Node] = ()) -> dict[fx.Node, Any]:
    """Give every node of ``gm`` its ``meta['val']`` / ``meta['tensor_meta']`` from one run on the
    example inputs (under ``torch.no_grad``); return the real values of the nodes in ``keep``."""
    recorder = _Recorder(gm, set(keep))
    with torch.no_grad():
        recorder.run(*flat_inputs(gm, tuple(example_args), dict(example_kwargs or {})), enable_io_processing=False)
    return recorder.kept
