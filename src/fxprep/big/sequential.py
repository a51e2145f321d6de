"""Sequential onloading: a partitioned graph run stage by stage, one stage's weights on the device.

For each stage of :func:`fxprep.partition`, its weights are onloaded once, every calibration batch
passes through it, ``on_stage`` runs, changed weights are written where they live, and the next
stage runs on cached activations. Each stage is a transaction. This module checks the user's
arguments and runs the stages; the pieces are :mod:`fxprep.big.onload`,
:mod:`fxprep.big.weight_store`, :mod:`fxprep.big.activation_cache` and :mod:`fxprep.big.ranks`.
:class:`SequentialRun` reports the bytes held.

See docs/guides/big-models.md.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import FxprepWarning, InvalidInput
from .activation_cache import ActivationCache, to_device, value_bytes
from .devices import existing
from .onload import Onloader, StageWeights
from .partition import Stage, Stages
from .ranks import Ranks

OFFLOADS = ("cpu", "disk", None)
CACHES = ("cpu", "disk")
OWN_FOLDER = "fxprep-sequential"  # the subfolder of offload_dir run_sequential writes its own offload into


@dataclass
class SequentialRun:
    """What :func:`run_sequential` did. ``outputs``: what the partitioned graph returns, one per batch
    this process ran (``batches``: their positions among the batches given; all of them without ranks).

    Bytes: ``peak_bytes`` (most bytes on the device at once: weights attached to the modules and the
    running batch's inputs and outputs), ``peak_weight_bytes``, ``stage_weight_bytes`` (each stage's, by
    name), ``total_weight_bytes`` (all stages'), ``pinned_bytes`` (tensors never offloaded:
    non-persistent buffers, graph constants), ``peak_batch_bytes``, ``peak_cache_bytes`` (activations
    cached between stages, on the cache's side), ``peak_before_bytes`` (the before-images: a stage's
    weights as they were before it, kept while ``on_stage`` may change them, for write-back and undo;
    those already in memory where the weights live are not counted), ``peak_held_bytes`` (the most the
    runner held at once: weights on the device, before-images, the running batch, the activation
    cache in memory and ``kept_bytes``), ``kept_bytes`` (written-back values kept in memory because
    their weights have no folder to go to; 0 when every weight lives in memory or in a folder),
    ``device_peak_bytes`` (``torch.cuda.max_memory_allocated`` on a CUDA device, else None).
    ``written``: the weights ``on_stage`` changed, written back (names), ``written_bytes`` their size;
    ``seconds`` per stage."""

    outputs: list[Any]
    batches: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_weight_bytes: int = 0
    stage_weight_bytes: dict[str, int] = field(default_factory=dict)
    total_weight_bytes: int = 0
    pinned_bytes: int = 0
    peak_batch_bytes: int = 0
    peak_cache_bytes: int = 0
    peak_before_bytes: int = 0
    peak_held_bytes: int = 0
    kept_bytes: int = 0
    device_peak_bytes: int | None = None
    written: list[str] = field(default_factory=list)
    written_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"{len(self.stage_weight_bytes)} stages; peak on device {self.peak_bytes / mib:.2f} MiB "
                f"(weights {self.peak_weight_bytes / mib:.2f} MiB, largest stage "
                f"{max(self.stage_weight_bytes.values(), default=0) / mib:.2f} MiB, all weights "
                f"{self.total_weight_bytes / mib:.2f} MiB); cache peak {self.peak_cache_bytes / mib:.2f} MiB; "
                f"held at most {self.peak_held_bytes / mib:.2f} MiB (before-images {self.peak_before_bytes / mib:.2f}); "
                f"{len(self.written)} weight(s) written back ({self.written_bytes / mib:.2f} MiB)")


OnStage = Callable[[Stage, list[dict[str, Any]], list[dict[str, Any]]], None]


def run_sequential(stages: Stages, batches: Iterable[Any], *, device: Any, offload: str | None = "cpu",
                   on_stage: OnStage | None = None, cache: str = "cpu", offload_dir: str | Path | None = None,
                   ranks: Ranks | None = None) -> SequentialRun:
    """Run every batch through ``stages`` one stage at a time, under ``torch.no_grad()``.

    Each stage is a transaction: if a batch or ``on_stage`` raises (Ctrl-C included), the stage's weights,
    tensor objects and hooks are as before it and the exception propagates unchanged; earlier stages keep
    what they wrote (docs/guides/big-models.md).

    Args:
        stages: What :func:`fxprep.partition` returned.
        batches: The calls, each a dict (keyword arguments), a tuple or list (positional) or a tensor.
        device: Where each stage runs (it must exist here).
        offload: Where weights wait while their stage is not running: ``"cpu"``, ``"disk"`` or ``None`` (they stay).
        on_stage: ``on_stage(stage, inputs, outputs)`` (one ``{name: value}`` per batch), once per stage, weights onloaded; what it changes is written back.
        cache: Where activations wait between stages, ``"cpu"`` or ``"disk"``.
        offload_dir: The folder for ``offload="disk"`` (default: a temporary one).
        ranks: Run data-parallel (:class:`fxprep.Ranks`); every rank ends with the single-process result.

    Returns:
        A :class:`SequentialRun`: the outputs, per-stage seconds and the bytes held.

    Raises:
        InvalidInput: What a user can get wrong (device, batches' keys and shapes, ``on_stage``'s signature, options), before any stage runs.
        RankFailed: With ``ranks``, another rank failed in a stage; this rank undid it too.
    """
    target, calls = _checked(stages, batches, device, offload, cache, on_stage, ranks)
    if ranks is None:
        _warn_if_distributed()
    temp = tempfile.mkdtemp(prefix="fxprep-seq-") if (offload == "disk" and offload_dir is None) or cache == "disk" else None
    folder = None
    if offload == "disk":
        folder = Path(offload_dir) / OWN_FOLDER if offload_dir is not None else Path(temp or ".") / "weights"
        shutil.rmtree(folder, ignore_errors=True)  # what a killed run left: replaced, not added to
    run = _Run(stages, calls, ActivationCache(Path(temp) / "cache" if cache == "disk" and temp else None),
               Onloader(_owners(stages), target, offload, folder, watch=on_stage is not None), target, on_stage,
               ranks, SequentialRun(outputs=[]))
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    try:
        run.report.stage_weight_bytes = {s.name: _total_bytes(s.weight_modules.values()) for s in stages}
        run.report.total_weight_bytes = _total_bytes(run.onloader.owners.values())
        run.onloader.attach()
        if ranks is not None:
            ranks.start(run.onloader.folders())
        run.indices = ranks.share(len(calls)) if ranks is not None else list(range(len(calls)))
        run.report.pinned_bytes = run.onloader.device_bytes()
        with torch.no_grad():
            for i in run.indices:
                run.store.put(i, to_device(calls[i], run.store.device))
            for stage in stages:
                start = time.perf_counter()
                _run_stage(run, stage)
                for i in run.indices:
                    run.store.drop(i, stage.frees)
                run.report.seconds[stage.name] = time.perf_counter() - start
            run.report.outputs = [stages.result(run.store.get(i, stages.result_reads)) for i in run.indices]
            run.report.batches = list(run.indices)
    finally:
        run.onloader.detach()
        run.store.close()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    if target.type == "cuda":
        run.report.device_peak_bytes = torch.cuda.max_memory_allocated(target)
    return run.report


@dataclass
class _Run:
    """What every step of a run reads: the stages, the bound batches, the activation cache, the
    onloader, the device, ``on_stage``, the ranks and the report being filled in."""

    stages: Stages
    calls: list[dict[str, Any]]
    store: ActivationCache
    onloader: Onloader
    device: torch.device
    on_stage: OnStage | None
    ranks: Ranks | None
    report: SequentialRun
    indices: list[int] = field(default_factory=list)


# --- checked before anything runs ----------------------------------------------------------------------
def _checked(stages: Any, batches: Iterable[Any], device: Any, offload: Any, cache: Any, on_stage: Any,
             ranks: Any) -> tuple[torch.device, list[dict[str, Any]]]:
    """The device and every batch bound to the graph's inputs, or the first thing to change."""
    if not isinstance(stages, Stages):
        raise InvalidInput("run_sequential takes what fxprep.partition returns.")
    if offload not in OFFLOADS:
        raise InvalidInput(f"offload must be one of {OFFLOADS}, not {offload!r}.")
    if cache not in CACHES:
        raise InvalidInput(f"cache must be one of {CACHES}, not {cache!r}.")
    if ranks is not None and not isinstance(ranks, Ranks):
        raise InvalidInput(f"ranks must be a fxprep.Ranks, not {type(ranks).__name__}.")
    target = existing(device, "device")
    if on_stage is not None:
        _check_on_stage(on_stage)
    calls = []
    for i, batch in enumerate(batches):
        args, kwargs = _as_call(batch)
        try:
            calls.append(stages.bind(*args, **kwargs))
        except InvalidInput as err:
            raise type(err)(f"batch {i} does not fit the prepared graph: {err}") from err
    if not calls:
        raise InvalidInput("run_sequential needs at least one batch.")
    return target, calls


def _check_on_stage(on_stage: Any) -> None:
    if not callable(on_stage):
        raise InvalidInput(f"on_stage must be a function on_stage(stage, inputs, outputs), not {type(on_stage).__name__}.")
    try:
        signature = inspect.signature(on_stage)
    except (TypeError, ValueError):
        return  # a builtin or extension callable: nothing to check before calling it
    try:
        signature.bind(None, [], [])
    except TypeError as err:
        name = getattr(on_stage, "__qualname__", type(on_stage).__name__)
        raise InvalidInput(f"on_stage is called as on_stage(stage, inputs, outputs); {name}{signature} cannot be "
                           f"({err}): give it those three parameters.") from err


def _as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _warn_if_distributed() -> None:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        warnings.warn(f"torch.distributed is initialised ({distributed.get_world_size()} ranks) but run_sequential "
                      f"got no ranks=: every rank runs every batch. Pass ranks=fxprep.Ranks(...) to split them.",
                      FxprepWarning, stacklevel=3)


# --- one stage: a transaction ------------------------------------------------------------------------------
def _run_stage(run: _Run, stage: Stage) -> None:
    """The stage's batches, then ``on_stage``, then its changes written back; on any exception the
    stage's weights are put back as they were and the exception goes on."""
    weights = run.onloader.onload(list(stage.weight_modules.values()))
    try:
        seen = _agreed(run, stage, "in its batches", lambda: _batches(run, stage, weights))
        if run.ranks is not None:
            run.ranks.replay()
        if run.on_stage is None:
            return
        on_stage = run.on_stage
        _agreed(run, stage, "in on_stage", lambda: on_stage(stage, *seen))
        if run.ranks is not None:
            ranks = run.ranks
            found = _agreed(run, stage, "writing back", lambda: run.onloader.changes(weights)
                            if ranks.rank == ranks.source else None)
            ranks.share_changes(run.onloader, weights, found)
        changes = run.onloader.changes(weights)
        run.report.kept_bytes += run.onloader.commit(changes)
        run.report.written += [item.slot.name for item, _ in changes]
        run.report.written_bytes += sum(v.numel() * v.element_size() for _, v in changes)
    except BaseException:
        run.onloader.undo(weights)
        raise
    finally:
        run.onloader.release(weights)


def _agreed(run: _Run, stage: Stage, where: str, step: Callable[[], Any]) -> Any:
    """``step()``; with ranks, every rank learns whether any failed (no rank is left in a collective)."""
    if run.ranks is None:
        return step()
    error: BaseException | None = None
    result = None
    try:
        result = step()
    except BaseException as err:  # noqa: BLE001 - told to every rank, then raised again
        error = err
    run.ranks.raise_for(run.ranks.failed(error), error, stage.name, where)
    return result


def _batches(run: _Run, stage: Stage, weights: StageWeights) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every batch of this process through ``stage``; the bytes it holds, counted."""
    report = run.report
    on_device = run.onloader.device_bytes()
    report.peak_weight_bytes = max(report.peak_weight_bytes, on_device)
    report.peak_before_bytes = max(report.peak_before_bytes, weights.held)
    seen_in: list[dict[str, Any]] = []
    seen_out: list[dict[str, Any]] = []
    recording = run.ranks.recording() if run.ranks is not None else contextlib.nullcontext()
    with recording:
        for i in run.indices:
            inputs = to_device(run.store.get(i, stage.inputs), run.device)
            with run.ranks.batch(i) if run.ranks is not None else contextlib.nullcontext():
                outputs = stage(**inputs)
            batch = value_bytes(inputs, run.device) + value_bytes(outputs, run.device)
            report.peak_batch_bytes = max(report.peak_batch_bytes, batch)
            report.peak_bytes = max(report.peak_bytes, on_device + batch)
            del inputs
            cached = to_device(outputs, run.store.device)
            del outputs
            run.store.put(i, cached)
            cache_bytes = run.store.nbytes()
            report.peak_cache_bytes = max(report.peak_cache_bytes, cache_bytes)
            in_memory = cache_bytes if run.store.folder is None else 0
            report.peak_held_bytes = max(report.peak_held_bytes, on_device + weights.held + batch + in_memory
                                         + report.kept_bytes)
            if run.on_stage is not None:
                seen_in.append(run.store.get(i, stage.inputs))
                seen_out.append(cached)
    return seen_in, seen_out


# --- sizes -------------------------------------------------------------------------------------------------
def _owners(stages: Stages) -> dict[str, nn.Module]:
    """``{path: module}`` of every module whose tensors a stage reads (a module once, at its first path)."""
    out: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for stage in stages:
        for path, module in stage.weight_modules.items():
            if id(module) not in seen:
                seen.add(id(module))
                out[path] = module
    return out


def _total_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the weights (parameters and persistent buffers), by their shapes (offloaded ones too)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        skip: set[str] = module._non_persistent_buffers_set
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is None or name in skip or id(t) in seen:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
