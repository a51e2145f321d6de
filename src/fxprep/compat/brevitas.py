"""Hand-off to Brevitas' graph mode: :func:`preprocess_for_quantize` and :func:`quantize`.

Brevitas' own functions, called on a :func:`fxprep.compat.retrace.retraceable` graph, plus fixes of
the hand-off: :func:`quantize` takes the input quantizer off integer inputs, and hands Tensor
methods, indexing, ``torch.pow`` and ``number * x`` the dequantized value of a ``QuantTensor``.
Brevitas is imported only when these are called; its BatchNorm merge writes into the Conv modules
the prepared graph shares with the user's model.

See docs/handoff/brevitas.md.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .contract import Adapter
from .retrace import INTEGER_INPUTS, integer_valued, retraceable

__all__ = ["ADAPTER", "preprocess_for_quantize", "quantize"]

ADAPTER = Adapter(toolkit="Brevitas", module="brevitas", requires="brevitas>=0.13",
                  entry_points=("preprocess_for_quantize", "quantize"), page="handoff/brevitas.md")

_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.truediv)


def preprocess_for_quantize(gm: fx.GraphModule, example_inputs: Any, **brevitas_options: Any) -> fx.GraphModule:
    """``brevitas.graph.quantize.preprocess_for_quantize`` on :func:`retraceable` (``gm``, ``example_inputs``).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        example_inputs: The inputs the graph is made for (one size), as for ``prepare_model``.
        **brevitas_options: Brevitas' options (``equalize_iters``, ``merge_bn``, ...).

    Returns:
        Brevitas' graph model, its integer inputs noted for :func:`quantize`.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or ``example_inputs`` are missing.
    """
    from brevitas.graph.quantize import preprocess_for_quantize as brevitas_preprocess

    ready = retraceable(gm, example_inputs, specialize=True)  # Brevitas traces it again: one size
    integer = [n.target for n in ready.graph.nodes if n.op == "placeholder" and integer_valued(n)]
    graph_model = brevitas_preprocess(ready, **brevitas_options)
    setattr(graph_model, INTEGER_INPUTS, tuple(integer))
    return graph_model


def quantize(graph_model: fx.GraphModule, **brevitas_options: Any) -> fx.GraphModule:
    """``brevitas.graph.quantize.quantize``, with no input quantizer on integer inputs (token ids).

    Args:
        graph_model: What :func:`preprocess_for_quantize` returned.
        **brevitas_options: Brevitas' options.

    Returns:
        The quantized graph model.
    """
    from brevitas.graph.quantize import quantize as brevitas_quantize
    from brevitas.quant_tensor import IntQuantTensor

    integer = set(getattr(graph_model, INTEGER_INPUTS, ()))
    quantized = brevitas_quantize(graph_model, **brevitas_options)
    graph = quantized.graph
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.target not in integer:
            continue
        for user in list(node.users):
            if user.op == "call_module" and user.target == f"{node.name}_quant":
                user.replace_all_uses_with(node)
                graph.erase_node(user)
                quantized.delete_submodule(str(user.target))
    for node in list(graph.nodes):  # Brevitas' trace went into the op modules: their methods are here
        method = node.op == "call_method" and not hasattr(IntQuantTensor, str(node.target))
        index = node.op == "call_function" and node.target is operator.getitem  # a QuantTensor is a tuple
        power = node.op == "call_function" and node.target is torch.pow  # its QuantTensor handler wants an int
        if (method or index or power) and isinstance(node.args[0], type(node)):  # Brevitas' fx backport has its own Node
            with graph.inserting_before(node):
                plain = graph.call_function(dequantized, (node.args[0],))
            node.update_arg(0, plain)
        elif node.op == "call_function" and node.target in _ARITHMETIC and len(node.args) == 2 \
                and isinstance(node.args[0], int | float) and isinstance(node.args[1], type(node)):
            with graph.inserting_before(node):  # 0.5 * q: a number times a tuple is a repetition
                plain = graph.call_function(dequantized, (node.args[1],))
            node.update_arg(1, plain)
    graph.lint()
    quantized.recompile()
    return quantized


def dequantized(value: Any) -> Any:
    """A Brevitas QuantTensor's float value (its fake-quantized tensor); anything else as it is."""
    from brevitas.quant_tensor import QuantTensor

    return value.value if isinstance(value, QuantTensor) else value
