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
from ..contract import Adapter

try:
    import llmcompressor.pipelines.sequential.pipeline as _sequential
    from llmcompressor.pipelines.registry import CalibrationPipeline
except ImportError as _err:  # one line, naming the extra
    raise MissingDependency(f'fxprep.compat.llmcompressor needs llmcompressor ({_err.name or _err} is missing): '
                            'pip install "fxprep[llmcompressor]"') from None

from .subgraphs import Capture, FxprepSubgraph, fxprep_subgraphs, last_capture

__all__ = ["ADAPTER", "FxprepPipeline", "FxprepSubgraph", "fxprep_subgraphs", "last_capture", "Capture", "PIPELINE"]

ADAPTER = Adapter(toolkit="llm-compressor", module="llmcompressor", requires="llmcompressor>=0.14",
                  entry_points=("FxprepPipeline", "fxprep_subgraphs", "last_capture"), page="handoff/llm-compressor.md")

PIPELINE = "fxprep"
_LOCK = threading.Lock()  # the sequential pipeline's module global is swapped for the run


class _SynchronizedCallbacks(_sequential.LifecycleCallbacks):  # type: ignore[misc, valid-type]
    """llm-compressor's lifecycle callbacks, with every rank waiting for the others after a
    subgraph's compression, before its propagation pass.

    Why: on ranks whose weights live in CPU memory (compressed-tensors' shared-memory cache, the
    gloo backend) GPTQ's owner rank writes each compressed weight into that memory and nothing waits
    for it (the broadcast is skipped for CPU modules): a rank may propagate the next subgraph's
    inputs through weights still being written, and two runs differ (measured: all 7 Linear weights
    of the second layer of a 2-layer Llama, run to run). A barrier there makes every rank read the
    finished weights. Nothing changes without ``torch.distributed``."""

    @classmethod
    def sequential_epoch_end(cls, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        result = super().sequential_epoch_end(*args, **kwargs)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return result


@CalibrationPipeline.register(PIPELINE)
class FxprepPipeline(CalibrationPipeline):
    """llm-compressor's ``SequentialPipeline`` with fxprep's subgraphs.

    Its ``__call__`` runs ``SequentialPipeline.__call__`` with two names of that pipeline's module
    bound for the duration of the call: ``trace_subgraphs`` to :func:`fxprep_subgraphs` and
    ``LifecycleCallbacks`` to one that synchronises ranks after each subgraph's compression
    (:class:`_SynchronizedCallbacks`). The registry takes a class, and reusing llm-compressor's loop
    (rather than a copy of it) keeps every option of ``oneshot`` that the loop reads meaning what it
    means there."""

    @staticmethod
    def __call__(model: Any, dataloader: Any, dataset_args: Any) -> None:
        with _LOCK:
            bound = {"trace_subgraphs": fxprep_subgraphs, "LifecycleCallbacks": _SynchronizedCallbacks}
            original = {name: getattr(_sequential, name) for name in bound}
            for name, value in bound.items():
                setattr(_sequential, name, value)
            try:
                _sequential.SequentialPipeline.__call__(model, dataloader, dataset_args)
            finally:
                for name, value in original.items():
                    setattr(_sequential, name, value)
