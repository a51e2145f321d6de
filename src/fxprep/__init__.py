"""fxprep: turn any PyTorch model into a clean, verified, module-level ``torch.fx.GraphModule``.

Public API::

    gm = fxprep.prepare_model(model, example_inputs=(x,))
    print(gm.fxprep_report)

    # an LLM prepared on the meta device, real weights loaded afterwards
    gm = fxprep.prepare_model(meta_model, example_inputs={"input_ids": ids_on_meta}, verify=False)
    fxprep.load_weights(gm, "path/to/checkpoint_dir")   # sharded safetensors + index
    fxprep.verify_prepared(gm, {"input_ids": ids})
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
    RankFailed,
    SerializationError,
    TraceFailure,
    UnknownOption,
)
from .export import export_onnx, export_program
from .io import load, save
from .opaque import opaque
from .partition import Stage, Stages, partition
from .ranks import Ranks
from .report import Report
from .sequential import SequentialRun, run_sequential
from .version import __version__
from .view import show
from .weights import WeightsError, load_weights, verify_prepared

__all__ = [
    "__version__",
    "prepare_model",
    "load_weights",
    "verify_prepared",
    "partition",
    "Stage",
    "Stages",
    "run_sequential",
    "SequentialRun",
    "Ranks",
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
    "RankFailed",
    "EquivalenceError",
    "SerializationError",
    "ExportError",
    "WeightsError",
    "FxprepWarning",
]
