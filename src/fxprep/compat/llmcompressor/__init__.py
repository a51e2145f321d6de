"""llm-compressor on fxprep's stages: ``oneshot(..., pipeline="fxprep")``.

Importing this module registers a calibration pipeline named ``"fxprep"`` in llm-compressor's
pipeline registry. It is llm-compressor's own sequential pipeline (its activation cache, calibration
and propagation passes, ``propagate_error``, prefetching, data-parallel ranks) with the subgraphs
made by fxprep instead of its torch.fx tracer (:func:`.subgraphs.fxprep_subgraphs`). See
``docs/handoff/llm-compressor.md``.

Nothing here is imported by ``import fxprep``. Without llmcompressor installed, importing it raises
:class:`fxprep.errors.MissingDependency` naming the extra (``pip install "fxprep[llmcompressor]"``).
"""

from __future__ import annotations

import threading
from typing import Any

from ...errors import MissingDependency

try:
    import llmcompressor.pipelines.sequential.pipeline as _sequential
    from llmcompressor.pipelines.registry import CalibrationPipeline
except ImportError as _err:  # one line, naming the extra
    raise MissingDependency(f'fxprep.compat.llmcompressor needs llmcompressor ({_err.name or _err} is missing): '
                            'pip install "fxprep[llmcompressor]"') from None

from .subgraphs import Capture, FxprepSubgraph, fxprep_subgraphs, last_capture

__all__ = ["FxprepPipeline", "FxprepSubgraph", "fxprep_subgraphs", "last_capture", "Capture", "PIPELINE"]

PIPELINE = "fxprep"
_LOCK = threading.Lock()  # the sequential pipeline's module global is swapped for the run


@CalibrationPipeline.register(PIPELINE)
class FxprepPipeline(CalibrationPipeline):
    """llm-compressor's ``SequentialPipeline`` with fxprep's subgraphs.

    Its ``__call__`` runs ``SequentialPipeline.__call__`` with the name that pipeline calls to make
    its subgraphs (``trace_subgraphs`` in its module) bound to :func:`fxprep_subgraphs` for the
    duration of the call: the registry takes a class, and reusing llm-compressor's loop (rather than a
    copy of it) keeps every option of ``oneshot`` that the loop reads meaning what it means there."""

    @staticmethod
    def __call__(model: Any, dataloader: Any, dataset_args: Any) -> None:
        with _LOCK:
            original = _sequential.trace_subgraphs
            _sequential.trace_subgraphs = fxprep_subgraphs
            try:
                _sequential.SequentialPipeline.__call__(model, dataloader, dataset_args)
            finally:
                _sequential.trace_subgraphs = original
