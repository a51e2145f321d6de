"""Sequential onloading: a partitioned graph run stage by stage, one stage's weights on the device.

A calibration loop needs the whole model to run, a 70B model fits no single GPU. The loops are
swapped (llm-compressor's sequential pipeline): for each stage of :func:`fxprep.partition`, its
weights are onloaded once, every calibration batch passes through it, ``on_stage`` sees its inputs
and outputs (where a quantizer calibrates, or updates weights GPTQ-style), its weights go back, and
the next stage runs on the cached activations.

The onloading is accelerate's, not fxprep's: each module that holds weights gets accelerate's
``AlignDevicesHook`` with ``offload=True`` (what ``cpu_offload`` / ``disk_offload`` attach: the
module's tensors on ``meta``, their values in a weights map, in memory or in accelerate's
memory-mapped offload folder). A module already hooked that way (``load_weights`` with a
``device_map`` naming ``disk``) keeps its hook and weights map. A stage is onloaded as
``accelerate.utils.align_module_device`` does it (the hook's ``pre_forward``), with the hook's
per-call offloading switched off while its batches run (as llm-compressor's ``disable_offloading``
does) and its ``post_forward`` after. Weights ``on_stage`` changed in place are written back to the
weights map first. The hooks fxprep attached are taken out at the end and every tensor object the
modules held before is put back (identity kept: ties stay ties).

The runner accounts the bytes it puts on the device: the weights attached to the modules (not
``meta``) and the batch being run. :class:`SequentialRun` reports the peak next to each stage's
weights and the total, and (on CUDA) the allocator's own peak.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import InvalidInput
from .partition import Stage, Stages

OFFLOADS = ("cpu", "disk", None)
CACHES = ("cpu", "disk")


@dataclass
class SequentialRun:
    """What :func:`run_sequential` did. ``outputs``: what the partitioned graph returns, one per batch.
    Bytes: ``peak_bytes`` (most bytes the runner had on the device at once: weights attached to the
    modules and the running batch's inputs and outputs), ``peak_weight_bytes``, ``stage_weight_bytes``
    (each stage's, by name), ``total_weight_bytes`` (all stages'), ``pinned_bytes`` (tensors never
    offloaded: non-persistent buffers, graph constants), ``peak_cache_bytes`` (activations cached
    between stages, on the cache's side), ``device_peak_bytes`` (``torch.cuda.max_memory_allocated``
    on a CUDA device, else None), ``seconds`` per stage."""

    outputs: list[Any]
    peak_bytes: int = 0
    peak_weight_bytes: int = 0
    stage_weight_bytes: dict[str, int] = field(default_factory=dict)
    total_weight_bytes: int = 0
    pinned_bytes: int = 0
    peak_batch_bytes: int = 0
    peak_cache_bytes: int = 0
    device_peak_bytes: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"{len(self.stage_weight_bytes)} stages; peak on device {self.peak_bytes / mib:.2f} MiB "
                f"(weights {self.peak_weight_bytes / mib:.2f} MiB, largest stage "
                f"{max(self.stage_weight_bytes.values(), default=0) / mib:.2f} MiB, all weights "
                f"{self.total_weight_bytes / mib:.2f} MiB); cache peak {self.peak_cache_bytes / mib:.2f} MiB")


def run_sequential(stages: Stages, batches: Iterable[Any], *, device: Any, offload: str | None = "cpu",
                   on_stage: Callable[[Stage, list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
                   cache: str = "cpu", offload_dir: str | Path | None = None) -> SequentialRun:
    """Run every batch through ``stages`` (from :func:`fxprep.partition`) one stage at a time.

    ``batches``: the calls of the partitioned graph, each a dict (keyword arguments), a tuple or
    list (positional ones) or a single tensor. ``device``: where each stage runs. ``offload``:
    where weights wait while their stage is not running: ``"cpu"`` (in memory), ``"disk"``
    (accelerate's offload folder, ``offload_dir`` or a temporary one) or ``None`` (they stay where
    they are, nothing is moved). ``on_stage(stage, inputs, outputs)``: called once per stage with
    its weights onloaded, after all batches ran through it; ``inputs`` / ``outputs`` are one
    ``{name: value}`` per batch, as cached. ``cache``: where activations wait between stages
    (``"cpu"`` or ``"disk"``). Runs under ``torch.no_grad()``."""
    if not isinstance(stages, Stages):
        raise InvalidInput("run_sequential takes what fxprep.partition returns.")
    if offload not in OFFLOADS:
        raise InvalidInput(f"offload must be one of {OFFLOADS}, not {offload!r}.")
    if cache not in CACHES:
        raise InvalidInput(f"cache must be one of {CACHES}, not {cache!r}.")
    target = torch.device(device)
    calls = [_as_call(b) for b in batches]
    if not calls:
        raise InvalidInput("run_sequential needs at least one batch.")
    owners = _owners(stages)
    temp = tempfile.mkdtemp(prefix="fxprep-seq-") if (offload == "disk" and offload_dir is None) or cache == "disk" else None
    store = _Cache(Path(temp) / "cache" if cache == "disk" and temp is not None else None)
    hooks = _Hooks(owners, target, offload, Path(offload_dir) if offload_dir is not None else
                   (Path(temp) / "weights" if temp else None))
    run = SequentialRun(outputs=[])
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    try:
        run.stage_weight_bytes = {s.name: _stage_bytes(s) for s in stages}
        run.total_weight_bytes = _total_bytes(owners)
        hooks.attach()
        run.pinned_bytes = hooks.resident_bytes()
        with torch.no_grad():
            for i, call in enumerate(calls):
                store.put(i, _to(stages.bind(*call[0], **call[1]), store.device))
            for stage in stages:
                start = time.perf_counter()
                _run_stage(stage, len(calls), store, hooks, target, on_stage, run)
                for i in range(len(calls)):
                    store.drop(i, stage.frees)
                run.seconds[stage.name] = time.perf_counter() - start
            run.outputs = [stages.result(store.get(i, stages.result_reads)) for i in range(len(calls))]
    finally:
        hooks.detach()
        store.close()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    if target.type == "cuda":
        run.device_peak_bytes = torch.cuda.max_memory_allocated(target)
    return run


def _as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _run_stage(stage: Stage, n: int, store: _Cache, hooks: _Hooks, device: torch.device,
               on_stage: Callable[..., None] | None, run: SequentialRun) -> None:
    modules = list(stage.weight_modules.values())
    hooks.onload(modules)
    try:
        weights = hooks.resident_bytes()
        run.peak_weight_bytes = max(run.peak_weight_bytes, weights)
        seen_in: list[dict[str, Any]] = []
        seen_out: list[dict[str, Any]] = []
        for i in range(n):
            inputs = _to(store.get(i, stage.inputs), device)
            outputs = stage(**inputs)
            batch = _nbytes(inputs, device) + _nbytes(outputs, device)
            run.peak_batch_bytes = max(run.peak_batch_bytes, batch)
            run.peak_bytes = max(run.peak_bytes, weights + batch)
            del inputs
            cached = _to(outputs, store.device)
            del outputs
            store.put(i, cached)
            run.peak_cache_bytes = max(run.peak_cache_bytes, store.nbytes())
            if on_stage is not None:
                seen_in.append(store.get(i, stage.inputs))
                seen_out.append(cached)
        if on_stage is not None:
            on_stage(stage, seen_in, seen_out)
    finally:
        hooks.offload(modules)


# --- accelerate's hooks ----------------------------------------------------------------------------
class _Hooks:
    """accelerate's ``AlignDevicesHook`` on every module that holds weights (a hook the module
    already has is used as it is), onloading and offloading a stage's modules."""

    def __init__(self, owners: dict[int, nn.Module], device: torch.device, offload: str | None,
                 folder: Path | None):
        self.owners = owners
        self.device = device
        self.mode = offload
        self.folder = folder
        self.ours: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}  # module -> {name: (kind, original)}
        self.versions: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        self.saved_devices: dict[int, Any] = {}

    def attach(self) -> None:
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module
        from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, offload_state_dict

        if self.mode is None:
            return
        fresh = [m for m in self.owners.values() if _offload_hook(m) is None]
        empty = [f"{type(m).__name__}.{n}" for m in fresh for n, t in _tensors(m) if t.is_meta]
        if empty:
            raise InvalidInput(f"{len(empty)} weight(s) are on 'meta' and no offload hook holds their values "
                               f"({', '.join(empty[:4])}...): load them first (fxprep.load_weights, with a "
                               f"device_map to keep them on disk).")
        if self.mode == "disk" and fresh:
            assert self.folder is not None
            flat = {f"{id(m)}.{n}": t.detach() for m in fresh for n, t in _tensors(m)}
            offload_state_dict(str(self.folder), flat)
            loader = OffloadedWeightsLoader(save_folder=str(self.folder))
        for module in fresh:
            self.ours[id(module)] = {n: ("param" if n in module._parameters else "buffer", t) for n, t in _tensors(module)}
            weights: Mapping[str, torch.Tensor] = (PrefixedDataset(loader, f"{id(module)}.") if self.mode == "disk"
                                                   else {n: t for n, t in _tensors(module)})
            add_hook_to_module(module, AlignDevicesHook(execution_device=self.device, offload=True,
                                                        weights_map=weights, offload_buffers=True))

    def onload(self, modules: list[nn.Module]) -> None:
        for module in modules:
            hook = _offload_hook(module)
            if hook is None:
                continue
            self.saved_devices[id(module)] = hook.execution_device
            hook.execution_device = self.device
            hook.pre_forward(module)  # as accelerate.utils.align_module_device onloads
            hook.offload = False  # the batches' calls leave the weights where they are
            self.versions[id(module)] = {n: (t, t._version) for n, t in _tensors(module)}

    def offload(self, modules: list[nn.Module]) -> None:
        for module in modules:
            hook = _offload_hook(module, even_paused=True)
            if hook is None or id(module) not in self.versions:
                continue
            self._write_back(module, hook)
            hook.offload = True
            hook.post_forward(module, None)
            hook.execution_device = self.saved_devices.pop(id(module))

    def _write_back(self, module: nn.Module, hook: Any) -> None:
        """Weights changed while onloaded (``on_stage``) go back where they wait: into the module's own
        tensor objects when fxprep attached the hook, else into the hook's weights map."""
        from accelerate.utils import PrefixedDataset

        seen = self.versions.pop(id(module))
        ours = self.ours.get(id(module))
        for name, tensor in _tensors(module):
            before = seen.get(name)
            if before is not None and before[0] is tensor and before[1] == tensor._version:
                continue
            weights = hook.weights_map
            if ours is not None and name in ours:
                original = ours[name][1]
                if original.data_ptr() != tensor.data_ptr():
                    original.data.copy_(tensor.detach())
                value = original.detach()
            else:
                value = tensor.detach().to("cpu").clone()
            if isinstance(weights, PrefixedDataset):
                weights.dataset.state_dict[weights.prefix + name] = value
            elif isinstance(weights, dict):
                weights[name] = value

    def detach(self) -> None:
        from accelerate.hooks import remove_hook_from_module

        for module in self.owners.values():
            originals = self.ours.pop(id(module), None)
            if originals is None:
                continue
            remove_hook_from_module(module)
            for name, (kind, tensor) in originals.items():
                (module._parameters if kind == "param" else module._buffers)[name] = tensor

    def resident_bytes(self) -> int:
        """Bytes of the tensors the modules hold on the device now (each memory counted once)."""
        return _nbytes([t for module in self.owners.values() for _, t in _tensors(module)], self.device)


def _offload_hook(module: nn.Module, even_paused: bool = False) -> Any:
    from accelerate.hooks import AlignDevicesHook

    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and (hook.offload or even_paused) and hook.weights_map is not None:
        return hook
    return None


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def _owners(stages: Stages) -> dict[int, nn.Module]:
    out: dict[int, nn.Module] = {}
    for stage in stages:
        for module in stage.weight_modules.values():
            out.setdefault(id(module), module)
    return out


def _stage_bytes(stage: Stage) -> int:
    return _total_bytes({id(m): m for m in stage.weight_modules.values()})


def _total_bytes(owners: dict[int, nn.Module]) -> int:
    """Bytes of the weights (parameters and persistent buffers), by their shapes (offloaded ones too)."""
    seen: set[int] = set()
    total = 0
    for module in owners.values():
        skip: set[str] = module._non_persistent_buffers_set
        for name, t in _tensors(module):
            if name in skip or id(t) in seen:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# --- the activation cache --------------------------------------------------------------------------
class _Cache:
    """Per batch, the named values later stages read: in memory, or one file per batch and value."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.device = torch.device("cpu")
        self.memory: dict[int, dict[str, Any]] = {}
        self.files: dict[int, dict[str, Path]] = {}
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def put(self, i: int, values: Mapping[str, Any]) -> None:
        if self.folder is None:
            self.memory.setdefault(i, {}).update(values)
            return
        for name, value in values.items():
            self.count += 1
            path = self.folder / f"{i}-{self.count}.pt"
            torch.save(value, path)
            self.files.setdefault(i, {})[name] = path

    def get(self, i: int, names: Iterable[str]) -> dict[str, Any]:
        if self.folder is None:
            return {n: self.memory[i][n] for n in names}
        return {n: torch.load(self.files[i][n], weights_only=False) for n in names}

    def drop(self, i: int, names: Iterable[str]) -> None:
        for name in names:
            self.memory.get(i, {}).pop(name, None)
            path = self.files.get(i, {}).pop(name, None)
            if path is not None:
                path.unlink(missing_ok=True)

    def nbytes(self) -> int:
        if self.folder is None:
            return sum(_nbytes(v, None) for values in self.memory.values() for v in values.values())
        return sum(p.stat().st_size for paths in self.files.values() for p in paths.values())

    def close(self) -> None:
        self.memory.clear()
        self.files.clear()


def _to(value: Any, device: torch.device) -> Any:
    from accelerate.utils import send_to_device

    return send_to_device(value, device)


def _nbytes(value: Any, device: torch.device | None) -> int:
    seen: set[int] = set()
    total = 0
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor) and not t.is_meta and (device is None or t.device == device):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total
