"""A stage's weights onto the device and back, as one transaction (the weights of
:func:`fxprep.run_sequential`).

Every tensor the stages read is a slot, offloaded (the value in a
:class:`~fxprep.big.weight_store.Home`) or resident. :class:`Onloader` puts a stage's slots on the
device, keeps before-images when watching, finds changes bit for bit (:meth:`Onloader.changes`),
then commits them to every home (:meth:`Onloader.commit`) or undoes them (:meth:`Onloader.undo`),
and puts every original tensor object back (:meth:`Onloader.release`).

See docs/guides/big-models.md ("Each stage is a transaction", "Under the hood").
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInput
from .weight_store import Home, LoaderHome, Pending, TensorHome, home_of, save_index


@dataclass(eq=False)
class Slot:
    """One tensor of the model. ``places``: ``(module, name, object it held when the run began)``;
    ``homes``: where its value lives (written back to every one); ``resident``: the real tensor some
    place holds, computed with as it is (None: offloaded, read from ``homes[0]``); ``name``: its first path."""

    name: str
    places: list[tuple[nn.Module, str, torch.Tensor]]
    homes: list[Home] = field(default_factory=list)
    keys: set[Any] = field(default_factory=set)  # identities that make two places one tensor
    resident: torch.Tensor | None = None

    @property
    def like(self) -> torch.Tensor:
        return self.resident if self.resident is not None else self.places[0][2]


@dataclass(eq=False)
class Loaded:
    """A slot while its stage runs: its places in the stage, the tensor put there, its before-image."""

    slot: Slot
    places: list[tuple[nn.Module, str, torch.Tensor]]
    value: torch.Tensor
    before: torch.Tensor | None
    owned: int  # bytes the runner allocated for it (a copy on the device, a before-image read from disk)


@dataclass(eq=False)
class StageWeights:
    loaded: list[Loaded]
    hooks: list[tuple[Any, Any]]  # (an offload hook the modules had, its execution device before)

    @property
    def held(self) -> int:
        return sum(item.owned for item in self.loaded)


class Onloader:
    """The slots of ``owners`` (``{path: module}``: every module whose tensors a stage reads), onloaded
    stage by stage on ``device``; ``mode`` is run_sequential's ``offload`` for modules no offload hook
    holds; ``watch``: keep before-images (changes are looked for, and undone on failure)."""

    def __init__(self, owners: dict[str, nn.Module], device: torch.device, mode: str | None,
                 folder: Path | None, watch: bool):
        self.owners = owners
        self.device = device
        self.mode = mode
        self.folder = folder
        self.watch = watch
        self.slots: dict[tuple[int, str], Slot] = {}  # (id(module), name) -> slot
        self._ours: list[tuple[nn.Module, str, torch.Tensor]] = []  # places fxprep offloaded itself
        self._loader: Any = None

    # --- the run's beginning and end ---------------------------------------------------------------
    def attach(self) -> None:
        """Slots found; tensors of modules without an offload hook offloaded by fxprep (``mode``)."""
        managed = {}  # every tensor an offload hook keeps in its weights map (on meta, or tied to a real one)
        for module in self.owners.values():
            hook = _offload_hook(module)
            if hook is not None:
                for name in _managed(module, hook):
                    managed[(id(module), name)] = home_of(hook.weights_map, name)
        by_key: dict[Any, Slot] = {}
        for path, module in self.owners.items():
            for name, tensor in _tensors(module):
                home = managed.get((id(module), name))
                keys: set[Any] = {("object", id(tensor))}
                if home is not None:
                    keys.add(home.identity())
                elif not _non_persistent(module, name):
                    keys.add(("tie", f"{path}.{name}" if path else name))
                slot = Slot(f"{path}.{name}" if path else name, [(module, name, tensor)],
                            [home] if home is not None else [], keys)
                for other in {id(by_key[k]): by_key[k] for k in keys if k in by_key}.values():
                    slot = _merged(other, slot)
                for k in slot.keys:
                    by_key[k] = slot
        empty = []
        for slot in {id(s): s for s in by_key.values()}.values():
            real = list({id(t): t for _, _, t in slot.places if not t.is_meta}.values())
            if real:  # computed with where it is; a copy a hook keeps (tied weights) is written too
                slot.resident = real[0]
                slot.homes = [TensorHome(t) for t in real] + slot.homes
            elif not slot.homes:
                empty.append(slot.name)
            for module, name, _ in slot.places:
                self.slots[(id(module), name)] = slot
        if empty:
            raise InvalidInput(f"{len(empty)} weight(s) are on 'meta' and no offload hook holds their values "
                               f"({', '.join(empty[:4])}{'...' if len(empty) > 4 else ''}): load them first "
                               f"(fxprep.load_weights, with a device_map to keep them on disk).")
        if self.mode is not None:
            self._offload_own()

    def _offload_own(self) -> None:
        """Resident persistent tensors of modules without an offload hook wait in memory (their own
        object) or in ``.dat`` files named by their path; their places hold ``meta`` while not running."""
        from accelerate.utils import OffloadedWeightsLoader, offload_weight

        own = {id(s): s for s in self.slots.values()
               if s.resident is not None and len(s.homes) == 1
               and not any(_offload_hook(m) is not None or _non_persistent(m, n) for m, n, _ in s.places)}
        if self.mode == "disk" and own:
            assert self.folder is not None
            self.folder.mkdir(parents=True, exist_ok=True)
            index: dict[str, Any] = {}
            for slot in own.values():
                offload_weight(slot.like.detach().cpu(), slot.name, str(self.folder), index=index)
            self._loader = OffloadedWeightsLoader(save_folder=str(self.folder), index=index)
        for slot in own.values():
            if self._loader is not None:
                slot.homes.insert(0, LoaderHome(self._loader, slot.name))
            slot.resident = None
            for module, name, tensor in slot.places:
                _registry(module, name)[name] = _like(tensor, tensor.detach().to("meta"))
                self._ours.append((module, name, tensor))
            slot.places = [(m, n, _registry(m, n)[n]) for m, n, _ in slot.places]

    def detach(self) -> None:
        """Every tensor object fxprep offloaded put back; its own ``.dat`` files removed."""
        for module, name, tensor in reversed(self._ours):
            _registry(module, name)[name] = tensor
        self._ours.clear()
        if self._loader is not None and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self._loader = None

    # --- one stage -----------------------------------------------------------------------------------
    def onload(self, modules: list[nn.Module]) -> StageWeights:
        """The slots of ``modules`` on the device (and their before-images when watching); the offload
        hooks these modules had are paused (they move inputs, not weights)."""
        ids = {id(m) for m in modules}
        stage: dict[int, Loaded] = {}
        weights = StageWeights([], [])
        try:
            for module in modules:
                hook = _offload_hook(module)
                if hook is not None:
                    weights.hooks.append((hook, hook.execution_device))
                    hook.execution_device = self.device
                    hook.offload = False
                for name, _ in _tensors(module):
                    slot = self.slots.get((id(module), name))
                    if slot is None or id(slot) in stage:
                        continue
                    loaded = self._load(slot, [p for p in slot.places if id(p[0]) in ids])
                    stage[id(slot)] = loaded
                    weights.loaded.append(loaded)
        except BaseException:
            self.release(weights)
            raise
        return weights

    def _load(self, slot: Slot, places: list[tuple[nn.Module, str, torch.Tensor]]) -> Loaded:
        like = slot.like
        if slot.resident is not None:  # computed with as it is (at a place of the tie on meta too)
            before = like.detach().clone() if self.watch else None
            owned = before.untyped_storage().nbytes() if before is not None else 0
            for module, name, tensor in places:
                if tensor is not like:
                    _registry(module, name)[name] = like
            return Loaded(slot, places, like, before, owned)
        home = slot.homes[0]
        source = home.read()
        value = source.to(device=self.device, dtype=like.dtype, copy=self.watch)
        before = source if self.watch else None
        # the copy computed with is on the modules (device_bytes); a before-image read from disk is the runner's own
        owned = before.untyped_storage().nbytes() if before is not None and not home.in_memory else 0
        placed = _like(like, value)
        for module, name, _ in places:
            _registry(module, name)[name] = placed
        return Loaded(slot, places, placed, before, owned)

    def changes(self, weights: StageWeights) -> list[tuple[Loaded, torch.Tensor]]:
        """Each slot whose places hold other bits than its before-image, with the value they hold;
        :class:`InvalidInput` for a change no home can hold (another shape or dtype), or a tie whose
        places were changed to different values."""
        found = []
        for item in weights.loaded:
            if item.before is None:
                continue
            held = {id(t): t for m, n, _ in item.places if (t := _registry(m, n).get(n)) is not None}
            new = [t for t in held.values() if not same_bits(t, item.before)]
            if not new:
                continue
            like = item.slot.like
            for t in new:
                if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype:
                    raise InvalidInput(f"on_stage made {item.slot.name} a {t.dtype} tensor of shape {list(t.shape)}; "
                                       f"the weight is {like.dtype} {list(like.shape)} where it waits: change its "
                                       f"values, not its shape or dtype (keep quantized values in the weight's dtype).")
            if any(not same_bits(t, new[0]) for t in new[1:]):
                raise InvalidInput(f"on_stage changed {item.slot.name}, which several modules share (tied), to "
                                   f"different values through different modules: change it through one of them.")
            found.append((item, new[0]))
        return found

    def commit(self, changes: list[tuple[Loaded, torch.Tensor]]) -> int:
        """Each change written to every home of its slot (a resident slot: into its own object):
        all prepared first (a failure discards them all and changes nothing), then all applied.
        Returns the bytes the written values keep in memory beyond the homes' own storage."""
        pending: list[Pending] = []
        loaders: dict[int, Any] = {}
        try:
            for item, value in changes:
                homes = item.slot.homes
                tie = _tie(item.slot)
                for home in homes:
                    if isinstance(home, LoaderHome):
                        pending.append(home.prepare(value, tie=tie))
                        loaders[id(home.loader)] = home.loader
                    else:
                        pending.append(home.prepare(value))
        except BaseException:
            for p in pending:
                p.discard()
            raise
        with _interrupts_held():
            for p in pending:
                p.apply()
            for loader in loaders.values():
                save_index(loader)
        return sum(p.held for p in pending)

    def undo(self, weights: StageWeights) -> None:
        """Resident slots' before-images put back (offloaded homes were not written)."""
        with torch.no_grad():
            for item in weights.loaded:
                if item.slot.resident is None or item.before is None:
                    continue
                like = item.slot.like
                if not same_bits(like, item.before):
                    if like.shape == item.before.shape and like.dtype == item.before.dtype and like.device == item.before.device:
                        like.copy_(item.before)
                    else:
                        like.data = item.before

    def release(self, weights: StageWeights) -> None:
        """Each place's own tensor object back (``meta`` for offloaded slots); hooks as they were."""
        for item in weights.loaded:
            for module, name, tensor in item.places:
                _registry(module, name)[name] = tensor
        for hook, device in weights.hooks:
            hook.execution_device = device
            hook.offload = True
        weights.loaded.clear()
        weights.hooks.clear()

    def set_value(self, item: Loaded, value: torch.Tensor) -> None:
        """``value`` at every place of ``item`` in the stage (a weight update another rank made): a
        copy placed there, or for a resident slot copied into its own object, put back there."""
        like = item.slot.like
        if item.slot.resident is not None:
            with torch.no_grad():
                like.copy_(value)
            placed = like
        else:
            placed = _like(like, value.to(device=self.device, dtype=like.dtype, copy=True))
        for module, name, _ in item.places:
            _registry(module, name)[name] = placed

    def differs(self, item: Loaded) -> bool:
        """Whether a place of ``item`` holds other bits than its before-image."""
        return item.before is not None and any(
            not same_bits(t, item.before) for m, n, _ in item.places if (t := _registry(m, n).get(n)) is not None)

    def folders(self) -> set[str]:
        """The offload folders write-back may write into."""
        found = {f for slot in self.slots.values() for h in slot.homes if (f := h.folder()) is not None}
        return found | ({str(self.folder.resolve())} if self.folder is not None and self._loader is not None else set())

    def device_bytes(self) -> int:
        """Bytes of the tensors the modules hold on the device now (each storage counted once)."""
        seen: dict[int, int] = {}
        for module in self.owners.values():
            for _, t in _tensors(module):
                if not t.is_meta and t.device == self.device:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


# --- helpers -----------------------------------------------------------------------------------------
def _merged(first: Slot, second: Slot) -> Slot:
    """Two slots found to be one tensor (a shared object, or one home): ``first`` with ``second``'s
    places, homes and identities."""
    first.places += [p for p in second.places if all(p[0] is not q[0] or p[1] != q[1] for q in first.places)]
    first.homes += [h for h in second.homes if all(h.location() != g.location() for g in first.homes)]
    first.keys |= second.keys
    return first


def _tie(slot: Slot) -> str | None:
    """The key every ``.dat`` entry of ``slot`` names as the tensor it shares (see weight_store.TIE)."""
    ties = sorted(k[1] for k in slot.keys if k[0] == "tie")
    return ties[0] if ties else min((h.key for h in slot.homes if isinstance(h, LoaderHome)), default=None)


def _offload_hook(module: nn.Module) -> Any:
    """The accelerate offload hook of ``module`` (its ``_hf_hook``, or one inside a ``SequentialHook``)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    for h in hooks:
        if isinstance(h, AlignDevicesHook) and h.weights_map is not None and h.offload:
            return h
    return None


def _managed(module: nn.Module, hook: Any) -> list[str]:
    """The names of ``module``'s own tensors that ``hook`` keeps in its weights map."""
    from accelerate.utils import named_module_tensors

    names = [n for n, _ in named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=False,
                                                 remove_non_persistent=True)]
    return [n for n in names if _registry(module, n).get(n) is not None and n in _map_keys(hook.weights_map, n)]


def _map_keys(weights_map: Any, name: str) -> set[str]:
    """``{name}`` if ``weights_map`` holds ``name`` (accelerate's maps are lazy: asked, not listed)."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    key, inner = name, weights_map
    while isinstance(inner, PrefixedDataset):
        key, inner = inner.prefix + key, inner.dataset
    if isinstance(inner, OffloadedWeightsLoader):
        return {name} if key in inner.state_dict or key in inner.index else set()
    try:
        return {name} if key in inner else set()
    except TypeError:
        return set()


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def _registry(module: nn.Module, name: str) -> dict[str, Any]:
    return module._parameters if name in module._parameters else module._buffers


def _non_persistent(module: nn.Module, name: str) -> bool:
    return name in module._non_persistent_buffers_set


def _like(original: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the kind of tensor ``original`` is (a ``Parameter`` of its class, or a plain tensor)."""
    if not isinstance(original, nn.Parameter):
        return value
    cls = type(original)
    try:
        return cls(value, requires_grad=original.requires_grad)
    except TypeError:
        return nn.Parameter(value, requires_grad=original.requires_grad)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaNs and signed zeros included), on ``b``'s device."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta
    x = a.detach().to(b.device).contiguous().reshape(-1)
    y = b.detach().contiguous().reshape(-1)
    if x.dtype == torch.bool or x.element_size() == 1:
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(x.element_size())
    if view is None or x.is_complex():
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    return torch.equal(x.view(view), y.view(view))


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C held off while a write-back is applied (renames and in-memory copies: short), then
    raised: a stage's write-back is applied whole or not at all. Off the main thread, nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt
