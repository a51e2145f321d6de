"""The activations :func:`fxprep.run_sequential` keeps between stages: per batch, the named values
later stages (or the final output) read, in memory on the CPU or one file per batch and value.

Stages run one after another over all batches, so what a stage produces waits until a later stage
reads it; a value no later stage reads (``Stage.frees``) is dropped as soon as its last reader ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch


class ActivationCache:
    """``folder`` None: in memory; else ``{batch}-{n}.pt`` files there (removed as they are dropped)."""

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
            old = self.files.setdefault(i, {}).get(name)
            self.files[i][name] = path
            if old is not None:
                old.unlink(missing_ok=True)

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
        """Bytes held: in memory (each storage once), or on disk."""
        if self.folder is None:
            return value_bytes([v for values in self.memory.values() for v in values.values()], None)
        return sum(p.stat().st_size for paths in self.files.values() for p in paths.values())

    def close(self) -> None:
        for paths in self.files.values():
            for path in paths.values():
                path.unlink(missing_ok=True)
        self.memory.clear()
        self.files.clear()


def to_device(value: Any, device: torch.device) -> Any:
    from accelerate.utils import send_to_device

    return send_to_device(value, device)


def value_bytes(value: Any, device: torch.device | None) -> int:
    """Bytes of the tensors in ``value`` (containers walked) on ``device`` (any when None), each
    storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor) and not t.is_meta and (device is None or t.device == device):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total
