"""Hand-off to Brevitas' graph mode: :func:`preprocess_for_quantize` and :func:`quantize`.

Brevitas' graph-mode PTQ is ``preprocess_for_quantize(model)`` (its own fx trace, BatchNorm merge,
functional ops to modules), ``quantize(graph_model)`` (quantized layers and activations), then a
forward pass under ``calibration_mode``. On transformers models Brevitas' tracer fails on the model
itself (``co_varnames is too small``); on a prepared graph it re-traces the fx code, which works once
the graph is :func:`fxprep.compat.retrace.retraceable` (masks and rotary tables folded, device
conversions gone, every element of a tuple output read). These two functions are Brevitas' own,
called on that graph, plus one fix of the hand-off:

* Brevitas puts an input quantizer on every placeholder of the graph, integer ones included; a
  quantized ``input_ids`` tensor sent to a quantized embedding makes Brevitas' embedding handler
  recurse without end. :func:`quantize` takes the quantizer off the inputs that are integer in
  the example (token ids are indices, not activations); float inputs keep theirs.
* A quantized layer returns Brevitas' ``QuantTensor``, which handles torch *functions* (falling back
  to its dequantized value) but has few Tensor *methods*: ``x.pow(2)``, ``x.mean(-1)``, ``x.rsqrt()`` (RMSNorm's code, inside
  fxprep's op modules, which Brevitas' tracer traces into) fail on it. :func:`quantize` hands each
  such method call, and each index (``x[..., :4]`` in rotary code: a QuantTensor is a tuple, indexed
  as one), and each ``torch.pow`` (GPT-2's ``torch.pow(x, 3.0)``: Brevitas' QuantTensor ``pow`` takes
  integer exponents only), and each ``number * x`` (GPT-2's ``0.5 * x``: a QuantTensor is a tuple,
  which Python repeats), the dequantized value of a QuantTensor (``QuantTensor.value``: what Brevitas' own fallback
  computes with), so it computes as Brevitas computes an op it does not quantize.

Brevitas is imported only when these are called. Brevitas' BatchNorm merge writes into the Conv
modules it merges into, which a prepared graph shares with the user's model: hand Brevitas a model
you do not need unchanged (as with Brevitas on the original model, which it changes the same way).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .retrace import INTEGER_INPUTS, integer_valued, retraceable

__all__ = ["preprocess_for_quantize", "quantize"]

_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.truediv)


def preprocess_for_quantize(gm: fx.GraphModule, example_inputs: Any, **brevitas_options: Any) -> fx.GraphModule:
    """``brevitas.graph.quantize.preprocess_for_quantize`` on :func:`retraceable` (``gm``,
    ``example_inputs``); ``brevitas_options`` are passed on (``equalize_iters``, ``merge_bn``...)."""
    from brevitas.graph.quantize import preprocess_for_quantize as brevitas_preprocess

    ready = retraceable(gm, example_inputs, specialize=True)  # Brevitas traces it again: one size
    integer = [n.target for n in ready.graph.nodes if n.op == "placeholder" and integer_valued(n)]
    graph_model = brevitas_preprocess(ready, **brevitas_options)
    setattr(graph_model, INTEGER_INPUTS, tuple(integer))
    return graph_model


def quantize(graph_model: fx.GraphModule, **brevitas_options: Any) -> fx.GraphModule:
    """``brevitas.graph.quantize.quantize``, with no input quantizer on integer inputs (token ids)."""
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
