"""fxprep: turn any PyTorch model into a clean, verified, module-level ``torch.fx.GraphModule``.

Public API::

    gm = fxprep.prepare_model(model, example_inputs=(x,))
    print(gm.fxprep_report)
"""

from .api import get_report, prepare_model
from .check import TraceReport, check_traceability
from .errors import (
    EquivalenceError,
    ExportError,
    FxprepError,
    FxprepWarning,
    InputMismatch,
    InvalidInput,
    ModelError,
    PassFailure,
    SerializationError,
    TraceFailure,
    UnknownOption,
)
from .export import export_onnx, export_program
from .io import load, save
from .opaque import opaque
from .report import Report
from .version import __version__
from .view import show

__all__ = [
    "__version__",
    "prepare_model",
    "check_traceability",
    "TraceReport",
    "save",
    "load",
    "export_onnx",
    "export_program",
    "show",
    "get_report",
    "opaque",
    "Report",
    "FxprepError",
    "InvalidInput",
    "InputMismatch",
    "UnknownOption",
    "ModelError",
    "TraceFailure",
    "PassFailure",
    "EquivalenceError",
    "SerializationError",
    "ExportError",
    "FxprepWarning",
]
