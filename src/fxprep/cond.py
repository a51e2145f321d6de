"""``cond``: the ``torch.cond`` a prepared graph calls.

A prepared graph keeps a data-dependent branch as ``cond(pred, true_branch, false_branch,
operands)``, the branches being GraphModules whose leaf layers are the user's own modules (so a
quantization toolkit finds and replaces them like any other layer). Run eagerly it is a Python
``if``: gradients flow through the taken branch into the user's parameters exactly as in the
original model (``torch.ops.higher_order.cond`` cannot do that eagerly while its branches read
parameters they are not passed). Under ``torch.compile`` and ``torch.export`` it is ``torch.cond``,
so exporters see both branches. A ``torch.fx`` re-trace of the prepared module keeps it one call
(its node is marked ``is_wrapped``). It depends on torch only, so every layer of fxprep may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx


def cond(pred: Any, true_branch: Callable[..., Any], false_branch: Callable[..., Any], operands: Any) -> Any:
    """``true_branch(*operands)`` if ``pred`` else ``false_branch(*operands)`` (``torch.cond`` when
    compiling or exporting). Branches return a tuple of tensors."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_branch, false_branch, tuple(operands))
    return true_branch(*operands) if pred else false_branch(*operands)


def is_cond(node: fx.Node) -> bool:
    """Whether ``node`` calls :func:`cond`."""
    return node.op == "call_function" and node.target is cond


def branch_modules(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, fx.GraphModule]]:
    """``[(path, GraphModule)]`` of the two branches a :func:`cond` node calls."""
    out = []
    for arg in node.args[1:3]:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            module = gm.get_submodule(str(arg.target))
            if isinstance(module, fx.GraphModule):
                out.append((str(arg.target), module))
    return out
