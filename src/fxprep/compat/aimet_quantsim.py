"""fxprep's module classes registered with AIMET's QuantSim (``aimet_torch`` 2.x).

QuantSim needs a quantized twin for every leaf class. Each :mod:`fxprep.ops` class gets one here, as
AIMET defines its own element-wise ops (an input quantizer per tensor input, one output quantizer,
only floating-point tensors quantized), plus the op-type table entries of the AIMET class it stands
for; opaque parts stay float. Importing this module imports ``aimet_torch`` (seconds): fxprep does
so only when asked or when ``aimet_torch`` is already imported.

See docs/handoff/aimet.md ("Under the hood").
"""

from __future__ import annotations

from typing import Any

import torch
from aimet_torch.nn import QuantizationMixin
from aimet_torch.nn.modules import custom
from aimet_torch.onnx_utils import map_torch_types_to_onnx
from aimet_torch.translation_mapping import aimet_op_to_backend_op_name_map
from torch import nn

try:
    from aimet_torch.quantization.tensor import QuantizedTensorBase
except ImportError:  # aimet-torch before its v2 API moved up a level (2.20 has it under aimet_torch.v2)
    from aimet_torch.v2.quantization.tensor import QuantizedTensorBase  # type: ignore[no-redef]

from .. import ops
from ..capture.leaves import OpaqueFunction, OpaqueMethod
from .contract import Adapter

__all__ = ["ADAPTER", "register"]

# fxprep class name → the AIMET class it stands for (same op, hence the same op-type entries).
TWINS: dict[str, str] = {
    "Add": "Add", "Sub": "Subtract", "Mul": "Multiply", "Div": "Divide", "FloorDiv": "FloorDivide",
    "Remainder": "Remainder", "Pow": "Pow", "Neg": "Neg", "Abs": "Abs", "Exp": "Exponential", "Log": "Log",
    "Sqrt": "Sqrt", "Rsqrt": "RSqrt", "Square": "Square", "Maximum": "Maximum", "Minimum": "Minimum",
    "MatMul": "MatMul", "Bmm": "Bmm", "Baddbmm": "Baddbmm", "Addmm": "Addmm", "Concat": "Concat", "Sum": "Sum",
    "Mean": "Mean", "Norm": "Norm", "CumSum": "CumSum", "Amax": "AMax", "Amin": "AMin", "Where": "Where",
    "MaskedFill": "MaskedFill", "Interpolate": "Interpolate", "Pad": "Pad",
    "ScaledDotProductAttention": "ScaledDotProductAttention",
}
OPAQUE = (OpaqueMethod, OpaqueFunction)
_REGISTERED: dict[type, type] = {}


def _qdq(value: Any, quantizer: Any) -> Any:
    """``value`` quantize-dequantized when it is a floating-point tensor, always as a plain tensor."""
    if isinstance(value, QuantizedTensorBase):
        value = value.dequantize()
    if quantizer is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        value = quantizer(value)
        if isinstance(value, QuantizedTensorBase):
            value = value.dequantize()
    return value


class QuantizedBoundOpMixin:
    """The quantized behaviour shared by every fxprep op class (placed before ``QuantizationMixin``)."""

    input_quantizers: nn.ModuleList
    output_quantizers: nn.ModuleList

    def __quant_init__(self) -> None:
        super().__quant_init__()  # type: ignore[misc]
        self.input_quantizers = nn.ModuleList([None] * max(getattr(self, "num_inputs", 1), 0))
        self.output_quantizers = nn.ModuleList([None])

    def forward(self, *inputs: Any) -> Any:
        quantizers = list(self.input_quantizers)
        inputs = tuple(_qdq(x, quantizers[i] if i < len(quantizers) else None) for i, x in enumerate(inputs))
        with self._patch_quantized_parameters():  # type: ignore[attr-defined]
            out = super().forward(*inputs)  # type: ignore[misc]
        if isinstance(out, torch.Tensor):
            return _qdq(out, self.output_quantizers[0])
        return out

    @classmethod
    def _supports_dynamic_input_count(cls) -> bool:
        return True  # Concat and friends take as many tensors as the call passes


def _op_classes() -> list[type[ops.BoundOp]]:
    """The op classes of :mod:`fxprep.ops` (not their quantized subclasses made here)."""
    return [c for c in vars(ops).values() if isinstance(c, type) and issubclass(c, ops.BoundOp)]


def _copy_op_type(cls: type, twin_name: str | None) -> None:
    twin = getattr(custom, twin_name, None) if twin_name else None
    if twin is None:
        return
    if twin in map_torch_types_to_onnx:
        map_torch_types_to_onnx.setdefault(cls, map_torch_types_to_onnx[twin])
    if twin in aimet_op_to_backend_op_name_map:
        aimet_op_to_backend_op_name_map.setdefault(cls, aimet_op_to_backend_op_name_map[twin])


def register() -> dict[type, type]:
    """Give every fxprep op class a QuantSim definition (idempotent); opaque parts stay float.

    Returns:
        ``{fxprep class: its quantized class}``.
    """
    for cls in _op_classes():
        if cls in _REGISTERED or cls in QuantizationMixin.cls_to_qcls:
            continue
        _copy_op_type(cls, TWINS.get(cls.__name__))  # before implements(), which copies the entries
        quantized = type(f"Quantized{cls.__name__}", (QuantizedBoundOpMixin, QuantizationMixin, cls),
                         {"__module__": __name__, "__qualname__": f"Quantized{cls.__name__}"})
        QuantizationMixin.implements(cls)(quantized)
        _REGISTERED[cls] = quantized
        globals()[quantized.__name__] = quantized  # importable by name, so a simulated model pickles
    for cls in OPAQUE:
        QuantizationMixin.ignore(cls)
    return dict(_REGISTERED)


ADAPTER = Adapter(toolkit="AIMET QuantSim", module="aimet_torch", requires="aimet-torch>=2.20",
                  entry_points=("register",), page="handoff/aimet.md", hook=register)
register()
