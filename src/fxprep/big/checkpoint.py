"""Reading weights without pickle: a state_dict, a ``.safetensors`` file, or a sharded directory.

:func:`open_checkpoint` gives a :class:`Checkpoint`: every key's shape and dtype up front (from
the safetensors headers, nothing loaded), and the tensors shard by shard (:meth:`Checkpoint.shards`),
so that :func:`fxprep.load_weights` checks everything before it changes anything, and holds at most
one shard of the file in memory at a time. A directory is read through its Hugging Face index
(``model.safetensors.index.json``, ``weight_map``: key → shard file), or is a single
``model.safetensors``. Pickled formats (``.bin``, ``.pt``) are refused: loading them runs code.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PureWindowsPath
from typing import Any

import torch

from ..errors import InvalidInput, WeightsError

_MAX_INDEX_BYTES = 256 * 2**20  # a 1T-parameter model's index is a few tens of MB

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "C64": torch.complex64, "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
    "U64": getattr(torch, "uint64", None),
}


@dataclass
class Checkpoint:
    """The keys of a checkpoint with their shapes and dtypes, and a way to read it shard by shard."""

    where: str
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    files: dict[str, list[str]] = field(default_factory=dict)  # shard file -> its keys ("" for a state_dict)
    state_dict: Mapping[str, Any] | None = None

    def shards(self, wanted: set[str]) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        """For each shard holding a wanted key, an iterator over its wanted ``(key, tensor)`` pairs
        (CPU tensors). A shard file is open only while its iterator runs."""
        for path, keys in self.files.items():
            keys = [k for k in keys if k in wanted]
            if keys:
                yield self._read(path, keys)

    def _read(self, path: str, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.state_dict is not None:
            for key in keys:
                yield key, self.state_dict[key]
            return
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in keys:
                    tensor = _aligned(f.get_tensor(key))
                    if (tuple(tensor.shape), tensor.dtype) != self.specs[key]:  # the file changed since it was opened
                        raise WeightsError(f"{path}: {key!r} is now {tuple(tensor.shape)} {tensor.dtype}, its header "
                                           f"said {self.specs[key]}: the file changed while it was read.")
                    yield key, tensor
        except WeightsError:
            raise
        except Exception as err:  # noqa: BLE001 - the file was readable a moment ago: say which and why
            raise WeightsError(f"cannot read the tensors of {path}: {type(err).__name__}: {str(err)[:200]}. The file "
                               f"changed or became unreadable while it was read; check it and load again.") from err


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage starting on a 64-byte boundary, as torch's allocator gives (a copy only when
    it does not). safetensors hands out tensors whose data may start anywhere, and vectorised CPU
    kernels then take another path whose results differ in the last bits from the same model loaded
    by ``from_pretrained`` (the reason :mod:`fxprep.io.format` aligns too)."""
    return t if t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)


def open_checkpoint(source: Any) -> Checkpoint:
    """A :class:`Checkpoint` for a state_dict, a ``.safetensors`` file or a directory of shards."""
    if isinstance(source, Mapping):
        specs = {}
        for key, value in source.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise InvalidInput(f"a state_dict maps names (str) to tensors; got {key!r}: {type(value).__name__}.")
            if value.layout != torch.strided or value.is_meta or value.is_quantized:
                raise InvalidInput(f"state_dict[{key!r}] is a {value.layout} {value.dtype} tensor on {value.device}: "
                                   f"load_weights takes dense tensors holding values (not meta, sparse or quantized).")
            specs[key] = (tuple(value.shape), value.dtype)
        return Checkpoint("the state_dict", specs, {"": list(source)}, source)
    if not isinstance(source, (str, Path)):
        raise InvalidInput(f"source must be a state_dict, a .safetensors file or a directory of them, not "
                           f"{type(source).__name__}.")
    path = Path(source)
    if _is(path, Path.is_dir, "source"):
        return _directory(path)
    if not _is(path, Path.exists, "source"):
        raise InvalidInput(f"no such file or directory: {path}")
    if path.suffix != ".safetensors":
        raise InvalidInput(f"{path.name}: only .safetensors files are read (pickled .bin/.pt files can run code "
                           f"when loaded); convert it, or load it yourself and pass the state_dict.")
    regular(path, "source")
    checkpoint = Checkpoint(str(path))
    _add_file(checkpoint, path)
    return checkpoint


def regular(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (a link to one is followed: the Hugging Face cache
    is made of them), before anything opens it: opening a FIFO for reading blocks until something
    writes to it, which an unpacked archive's FIFO never does, and a device has no end."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as err:
        raise WeightsError(f"{what}: {str(path)[:200]!r} cannot be looked up ({type(err).__name__}: "
                           f"{str(err)[:80]}).") from err
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise WeightsError(f"{what}: {path} is {kind}, not a regular file; load_weights reads only regular files "
                           f"(an unpacked archive can leave FIFOs and devices: replace it with the real file).")


def _no_special_files(path: Path) -> None:
    """Every entry of a checkpoint directory is a regular file or a directory (links followed): the
    index, the shards and what transformers' ``from_pretrained`` reads beside them (``config.json``,
    ``generation_config.json``) would block or never end on a FIFO or a device."""
    try:
        entries = list(os.scandir(path))
    except OSError as err:
        raise WeightsError(f"cannot list the checkpoint directory {path}: {err}") from err
    for entry in entries:
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling link: the lookups below say so if it is one they need
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            regular(Path(entry.path), f"{path}")


def _directory(path: Path) -> Checkpoint:
    _no_special_files(path)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise WeightsError(f"{path} holds several indexes ({', '.join(i.name for i in indexes)}); keep one of them "
                           f"in the shards' directory, or pass a single .safetensors file.")
    checkpoint = Checkpoint(str(path))
    if indexes:
        by_file = _read_index(indexes[0])
        for name, keys in by_file.items():
            shard = path / name
            if not _is(shard, Path.is_file, f"{indexes[0].name}: field 'weight_map'[{sorted(keys)[0][:80]!r}]"):
                raise WeightsError(f"{indexes[0].name} names shard {name[:200]!r} (for {len(keys)} tensor(s), e.g. "
                                   f"{sorted(keys)[0][:80]!r}), which is not a file in {path}: the download is "
                                   f"incomplete, or the index belongs to another checkpoint.")
            regular(shard, f"{indexes[0].name}: shard {name[:200]!r}")
            found = _add_file(checkpoint, shard)
            if set(found) != keys:
                missing = sorted(keys - set(found))[:5]
                raise WeightsError(f"shard {name} does not hold what {indexes[0].name} says it does "
                                   f"(missing: {', '.join(missing) or 'none'}; extra: {', '.join(sorted(set(found) - keys)[:5]) or 'none'}): "
                                   f"the shard or the index is from another checkpoint.")
        return checkpoint
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        listed = ", ".join(f.name for f in files[:5]) or "none"
        raise WeightsError(f"{path} has no *.safetensors.index.json and {len(files)} .safetensors files ({listed}); "
                           f"expected an index (model.safetensors.index.json) or exactly one .safetensors file. "
                           f"Pickled checkpoints (.bin, .pt) are not read: convert them to safetensors.")
    regular(files[0], f"{path}")
    _add_file(checkpoint, files[0])
    return checkpoint


def _read_index(index: Path) -> dict[str, set[str]]:
    """Shard file name → the keys a Hugging Face index puts there. Every malformed part is a
    :class:`WeightsError` naming the field; a shard name must stay inside the index's directory
    (a plain relative path: no ``..``, not absolute), since the index is data from whoever wrote the
    checkpoint and ``../elsewhere/x.safetensors`` would read any local file into the model. A shard
    that is a symlink is followed: the Hugging Face cache is made of them."""
    regular(index, "the index")
    try:
        # O_NONBLOCK: a FIFO put there after the check above is read as empty, never waited on
        with os.fdopen(os.open(index, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise WeightsError(f"the index {index} is not a regular file.")
            raw = f.read(_MAX_INDEX_BYTES + 1)
        if len(raw) > _MAX_INDEX_BYTES:
            raise WeightsError(f"{index} is larger than any safetensors index ({_MAX_INDEX_BYTES} bytes).")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as err:
        raise WeightsError(f"{index} is not a safetensors index (not readable JSON: {str(err)[:200]}).") from err
    if not isinstance(data, dict):
        raise WeightsError(f"{index} is not a safetensors index: the file holds a {type(data).__name__}, not an object.")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index}: field 'weight_map' must map tensor names to shard files, not "
                           f"{'nothing' if weight_map is None else type(weight_map).__name__}.")
    by_file: dict[str, set[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise WeightsError(f"{index}: field 'weight_map'[{key[:80]!r}] must be a shard file name, not {str(name)[:80]!r}.")
        shard = PurePath(name)
        if shard.is_absolute() or PureWindowsPath(name).is_absolute() or ".." in shard.parts or "\\" in name:
            raise WeightsError(f"{index}: field 'weight_map'[{key[:80]!r}] names shard {name[:200]!r}, outside the "
                               f"checkpoint's directory; an index may name only files beside it (or below it).")
        by_file.setdefault(name, set()).add(key)
    return by_file


def _is(path: Path, test: Any, what: str) -> bool:
    """``path.is_dir()`` / ``is_file()`` / ``exists()``, with a name the OS refuses outright (longer
    than a file name may be: ``OSError: File name too long``) a :class:`WeightsError` naming ``what``."""
    try:
        return bool(test(path))
    except (OSError, ValueError) as err:
        raise WeightsError(f"{what}: {str(path)[:200]!r} cannot be looked up ({type(err).__name__}: "
                           f"{str(err)[:80]}); name an existing file or directory.") from err


def _add_file(checkpoint: Checkpoint, path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for key in keys:
                piece = f.get_slice(key)
                dtype = _DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise WeightsError(f"{path.name}: tensor {key!r} has dtype {piece.get_dtype()}, which this torch "
                                       f"does not have.")
                if key in checkpoint.specs:
                    raise WeightsError(f"{key!r} is in two shards of {checkpoint.where}.")
                checkpoint.specs[key] = (tuple(piece.get_shape()), dtype)
    except WeightsError:
        raise
    except Exception as err:  # noqa: BLE001 - a broken file is the user's to fix: say which
        raise WeightsError(f"cannot read {path} as safetensors ({str(err)[:200]}): the file is truncated, damaged "
                           f"or not a safetensors file; download or write it again.") from err
    checkpoint.files[str(path)] = keys
    return keys
