"""Where a weight waits while its stage is not running, and how a changed value is written there.

A :class:`Home` is one such place: a :class:`TensorHome` (a tensor object in memory, written into in
place) or a :class:`LoaderHome` (a file of accelerate's offload folder, never the checkpoint
itself). Writing is two-phase (:meth:`Home.prepare`, then ``apply`` or ``discard``) so a stage's
write-back is all or nothing; homes with the same :meth:`Home.identity` are one storage, so ties are
kept.

See docs/guides/big-models.md ("Offload folders do not grow", "Under the hood").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from ..errors import InvalidInput

TIE = "fxprep_tensor"  # an index entry's field: the key of the entry whose tensor it shares (written with ties)
PARTIAL = ".fxprep-partial"  # a prepared, not yet applied .dat file: {key}.fxprep-partial.dat


class Pending:
    """A prepared write: ``apply`` makes it current, ``discard`` drops it. ``held``: bytes it keeps in
    memory (a value that could not go where its weight waits)."""

    def __init__(self, apply: Callable[[], None], discard: Callable[[], None] = lambda: None, held: int = 0):
        self.apply = apply
        self.discard = discard
        self.held = held


class Home:
    """Where one weight's value lives (see the module docstring)."""

    in_memory = False  # read() returns the stored object itself, no copy

    def read(self) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, value: torch.Tensor) -> Pending:
        raise NotImplementedError

    def identity(self) -> Hashable:
        raise NotImplementedError

    def location(self) -> Hashable:
        """Where a write goes: two homes of one tensor (same identity) may be two keys, each written."""
        return self.identity()

    def folder(self) -> str | None:
        """The offload folder this home writes to, if any (two ranks must not share one)."""
        return None


class TensorHome(Home):
    in_memory = True

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def read(self) -> torch.Tensor:
        return self.tensor

    def identity(self) -> Hashable:
        return ("tensor", id(self.tensor))

    def prepare(self, value: torch.Tensor) -> Pending:
        target = self.tensor
        if value is target:
            return Pending(lambda: None)

        def apply() -> None:
            with torch.no_grad():
                target.copy_(value.detach())

        return Pending(apply)


class LoaderHome(Home):
    """``key`` of an accelerate ``OffloadedWeightsLoader`` that reads it from a file (a safetensors
    file named by its index, or ``{save_folder}/{key}.dat``)."""

    def __init__(self, loader: Any, key: str):
        self.loader = loader
        self.key = key

    def read(self) -> torch.Tensor:
        return self.loader[self.key]

    def identity(self) -> Hashable:
        entry = self.loader.index.get(self.key, {})
        if entry.get("safetensors_file") is not None:
            return ("safetensors", os.path.realpath(entry["safetensors_file"]), entry.get("weight_name", self.key))
        return ("tie", entry.get(TIE, self.key))

    def location(self) -> Hashable:
        return ("key", id(self.loader), self.key)

    def folder(self) -> str | None:
        return os.path.realpath(self.loader.save_folder) if self.loader.save_folder is not None else None

    def prepare(self, value: torch.Tensor, tie: str | None = None) -> Pending:
        loader, key = self.loader, self.key
        if loader.save_folder is None:  # no folder to write to: the loader's in-memory part holds it
            kept = value.detach().to("cpu", copy=True)

            def keep() -> None:
                loader.state_dict[key] = kept

            return Pending(keep, held=kept.untyped_storage().nbytes())
        from accelerate.utils import offload_weight

        folder = str(loader.save_folder)
        partial = os.path.join(folder, f"{key}{PARTIAL}.dat")
        entries: dict[str, Any] = {}
        try:
            offload_weight(value.detach().to("cpu"), f"{key}{PARTIAL}", folder, index=entries)
        except (OSError, ValueError) as err:
            _unlink(partial)
            raise InvalidInput(f"writing {key} back to the offload folder {folder} failed: {err}") from err
        entry = entries[f"{key}{PARTIAL}"]
        if tie is not None and tie != key:
            entry[TIE] = tie

        def apply() -> None:
            os.replace(partial, os.path.join(folder, f"{key}.dat"))
            loader.index[key] = entry

        return Pending(apply, lambda: _discard(partial))


class Unwritable(Home):
    """A weights map of a kind fxprep does not know how to write to: read as the hook reads it; a
    write is refused (before anything is applied) with what to do instead."""

    def __init__(self, weights_map: Mapping[str, Any], key: str):
        self.weights_map = weights_map
        self.key = key

    def read(self) -> torch.Tensor:
        return self.weights_map[self.key]

    def identity(self) -> Hashable:
        return ("map", id(self.weights_map), self.key)

    def prepare(self, value: torch.Tensor) -> Pending:
        raise InvalidInput(f"on_stage changed {self.key}, whose offload hook reads it from a "
                           f"{type(self.weights_map).__name__}, which fxprep cannot write to: load the weights with "
                           f"fxprep.load_weights(device_map=...), or offload them with run_sequential(offload=...).")


def home_of(weights_map: Mapping[str, Any], key: str) -> Home:
    """The home of ``key`` in an offload hook's ``weights_map`` (through accelerate's ``PrefixedDataset``)."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    while isinstance(weights_map, PrefixedDataset):
        key, weights_map = weights_map.prefix + key, weights_map.dataset
    if isinstance(weights_map, OffloadedWeightsLoader):
        if key in weights_map.state_dict:
            return TensorHome(weights_map.state_dict[key])
        return LoaderHome(weights_map, key)
    if isinstance(weights_map, dict) and isinstance(weights_map.get(key), torch.Tensor):
        return TensorHome(weights_map[key])
    return Unwritable(weights_map, key)


def save_index(loader: Any) -> None:
    """The loader's index written as its folder's ``index.json`` (replaced whole, so a reader never
    sees half of it), after write-back changed entries."""
    folder = loader.save_folder
    if folder is None:
        return
    path = os.path.join(str(folder), "index.json")
    partial = path + PARTIAL
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(loader.index, f, indent=2)
    os.replace(partial, path)


def clear_folder(folder: str) -> int:
    """An offload folder emptied of what accelerate's format put there: the ``.dat`` files its
    ``index.json`` names, interrupted write-backs (``*.fxprep-partial.dat``) and the index itself.
    Other files are the user's and stay. Returns how many files were removed."""
    removed = 0
    path = os.path.join(folder, "index.json")
    names: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            names = list(json.load(f))
    except (OSError, ValueError):
        pass
    for name in names:
        # The index is a file in a folder a user chose, not fxprep's: a name that is not a plain
        # file name (``../x``, an absolute path, a separator) would make this remove files
        # outside the folder, so only names that stay inside it are taken.
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            continue
        removed += _unlink(os.path.join(folder, f"{name}.dat"))
    for entry in os.scandir(folder):
        if entry.name.endswith(f"{PARTIAL}.dat") or entry.name == "index.json" + PARTIAL:
            removed += _unlink(entry.path)
    return removed + _unlink(path)


def _unlink(path: str) -> int:
    """1 if ``path`` was removed, 0 if it was not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def _discard(path: str) -> None:
    _unlink(path)
