"""fxprep: turn any PyTorch model into a clean, verified, module-level ``torch.fx.GraphModule``.

Public API::

    gm = fxprep.prepare_model(model, example_inputs=(x,))
    print(gm.fxprep_report)

    # an LLM prepared on the meta device, real weights loaded afterwards
    gm = fxprep.prepare_model(meta_model, example_inputs={"input_ids": ids_on_meta}, verify=False)
    fxprep.load_weights(gm, "path/to/checkpoint_dir")   # sharded safetensors + index
    fxprep.verify_prepared(gm, {"input_ids": ids})

The names below torch is needed for are imported on first use (``fxprep.prepare_model`` imports
:mod:`fxprep.api`, and torch with it), not by ``import fxprep``: the ``fxprep`` command's
``--help`` and ``--version``, and its argument checks, answer in a fraction of a second instead of
the seconds importing torch takes (issue 61). The exceptions and the version need no torch and are
imported at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

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
from .version import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers and the API reference
    from .api import get_report, prepare_model
    from .big.partition import Stage, Stages, partition
    from .big.ranks import Ranks
    from .big.sequential import SequentialRun, run_sequential
    from .big.weights import WeightsError, load_weights, verify_prepared
    from .io import load, save
    from .io.export import export_onnx, export_program
    from .pipeline.traceability import TraceReport, check_traceability
    from .reporting.report import Report
    from .runtime.opaque import opaque
    from .view import show

#: public name -> the submodule that defines it (imported on first use)
_LAZY = {
    "prepare_model": "api", "get_report": "api",
    "check_traceability": "pipeline.traceability", "TraceReport": "pipeline.traceability",
    "export_onnx": "io.export", "export_program": "io.export",
    "load": "io", "save": "io",
    "opaque": "runtime.opaque",
    "partition": "big.partition", "Stage": "big.partition", "Stages": "big.partition",
    "Ranks": "big.ranks",
    "Report": "reporting.report",
    "run_sequential": "big.sequential", "SequentialRun": "big.sequential",
    "show": "view",
    "load_weights": "big.weights", "verify_prepared": "big.weights", "WeightsError": "big.weights",
}

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


def __getattr__(name: str) -> Any:
    """A public name's object (its submodule imported now), else a submodule (``fxprep.api``)."""
    owner = _LAZY.get(name)
    if owner is not None:
        value = getattr(importlib.import_module(f"{__name__}.{owner}"), name)
        globals()[name] = value  # next time found without this function
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``fxprep``'s module type: ``fxprep.partition`` and ``fxprep.opaque`` are the functions (as
    ``from .partition import partition`` made them when everything was imported at once), not the
    submodules of the same names, which the import system sets on the package when it loads them."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            return  # the submodule stays reachable as sys.modules["fxprep.<name>"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
