"""The files of a saved directory, the manifest that ties them together, and reading them back.

A saved directory holds:

``manifest.json``
    format name and version, fxprep and torch versions, the input spec, the fxprep report, and the
    sha256 of every other file (an edited or truncated file is refused with a clear error).
``graph.json``
    the ``torch.fx`` node list (name, op, target, args, kwargs) plus the pytree calling convention.
``modules.json``
    the module tree, one entry per path (see :data:`KINDS`), and where each tensor goes.
``weights.safetensors``
    every parameter, buffer and tensor constant, each tensor *object* once.
``forward.py``
    the generated ``forward`` code, for people to read. It is never executed.

JSON values are tagged (``{"$": "tuple", "v": [...]}``); :data:`TYPES` lists the Python types a
value may name. Change the format only together with :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SerializationError
from ..inputs import normalize_example_inputs

FORMAT = "fxprep.saved_module"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH = "graph.json"
MODULES = "modules.json"
WEIGHTS = "weights.safetensors"
CODE = "forward.py"
CHECKED_FILES = (GRAPH, MODULES, WEIGHTS, CODE)


# Module entry kinds in modules.json.
KINDS = {
    "root": "the GraphModule itself",
    "container": "a plain nn.Module / Sequential / ModuleList / ModuleDict: created empty, children added",
    "init": "a torch.nn layer rebuilt by calling its constructor with the recorded arguments",
    "owned": "a child the parent's constructor creates (MultiheadAttention.out_proj): only checked",
    "bound_op": "an fxprep.ops op: its callable's name plus the argument templates",
    "state": "any other trusted module class: created without __init__, its plain attributes restored",
    "same_as": "the same module object as another path (identity is kept)",
    "graph": "a nested GraphModule (a torch.cond branch): its graph's nodes, built after the whole tree",
}


CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)
MODULE_INTERNALS = frozenset(nn.Module().__dict__)
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


# --- constants ---------------------------------------------------------------------------------
TYPES: dict[str, Any] = {
    "torch.Tensor": torch.Tensor, "int": int, "float": float, "bool": bool, "str": str, "torch.Size": torch.Size,
    "torch.dtype": torch.dtype, "torch.device": torch.device,
}


TYPE_NAMES = {v: k for k, v in TYPES.items()}


# --- module tree: save side ---------------------------------------------------------------------
def own_attrs(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if k not in MODULE_INTERNALS}


# --- save --------------------------------------------------------------------------------------
def dumps(data: dict[str, Any]) -> str:
    """JSON with one list item per line: compact, yet diffable and greppable."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            body = ",\n  ".join(json.dumps(v, allow_nan=False) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {body}\n ]" if value else f"{json.dumps(key)}: []")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_spec(example_inputs: Any) -> list[dict[str, Any]] | None:
    example = normalize_example_inputs(example_inputs)
    if example is None:
        return None
    items = [(None, a) for a in example.args] + list(example.kwargs.items())
    spec = []
    for name, value in items:
        if isinstance(value, torch.Tensor):
            spec.append({"name": name, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")})
        else:
            spec.append({"name": name, "value": repr(value)[:200]})
    return spec


def contiguous_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What safetensors accepts: CPU, contiguous, no two entries over the same storage."""
    out: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu")
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if not t.is_contiguous() or (storage in storages and t.numel() > 0):
            t = t.contiguous().clone()
        storages.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        out[key] = t
    return out


# --- load --------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise SerializationError(f"{path} is missing: not an fxprep save directory (fxprep.save writes it).") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SerializationError(f"{path} is not valid JSON ({err}); the file is damaged.") from err


def check_manifest(directory: Path, check_integrity: bool) -> dict[str, Any]:
    manifest = read_json(directory / MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SerializationError(f"{directory / MANIFEST} is not an fxprep manifest (format {FORMAT!r} expected).")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SerializationError(
            f"{directory} was saved in format version {version!r}; this fxprep reads version {FORMAT_VERSION}."
        )
    if check_integrity:
        sums = manifest.get("sha256")
        if not isinstance(sums, dict):
            raise SerializationError(f"{directory / MANIFEST} has no checksums.")
        for name in CHECKED_FILES:
            path = directory / name
            if not path.exists():
                raise SerializationError(f"{path} is missing.")
            if sha256(path) != sums.get(name):
                raise SerializationError(
                    f"{path} does not match its checksum in {MANIFEST}: it was modified or damaged after "
                    f"saving. Re-save it (or load with check_integrity=False if you edited it on purpose)."
                )
    return manifest


# CPU kernels pick their code path by the data's alignment; torch's own allocator aligns to 64 bytes.
_ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage that starts on a 64-byte boundary (a copy only when it does not).

    Why: safetensors hands out tensors whose data may start anywhere (seen: ``data_ptr() % 64`` of
    8 to 40), and vectorised CPU kernels then take another path whose results differ from the saved
    model's in the last bits (~1e-8). A loaded model must compute bit for bit what the saved one did.
    """
    if t.data_ptr() % _ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(directory / WEIGHTS), framework="pt", device="cpu") as f:
            # One tensor at a time, so a misaligned one is copied while only it is in memory twice.
            return {key: _aligned(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise SerializationError(f"cannot read {directory / WEIGHTS}: {err}") from err
