"""The files of a saved directory, the manifest that ties them together, and reading them back.

A saved directory holds ``manifest.json`` (versions, input spec, report, and the sha256 of every
other file), ``graph.json``, ``modules.json`` (see :data:`KINDS`), ``weights.safetensors`` and
``forward.py`` (for people; never executed). JSON values are tagged; :data:`TYPES` lists the Python
types a value may name. Change the format only together with :data:`FORMAT_VERSION`. Reading is
bounded by :data:`LIMITS`, so a crafted save cannot exhaust memory or the stack.

See docs/delivery.md for the format and docs/security.md for the limits.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.inputs import normalize_example_inputs
from ..errors import SerializationError

FORMAT = "fxprep.saved_module"
# 2: tensor slots and constants record dtype and shape; opaque parts and helper objects.
# 3: the manifest records the self-check (io/selfcheck.py); input-guard tensors keep the example shape and dtype.
FORMAT_VERSION = 3
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
    "init": "a torch.nn layer rebuilt by calling its constructor with the recorded arguments (then torch's weight_norm "
            "where it records a parametrization: io/parametrized.py)",
    "owned": "a child the parent's constructor creates (MultiheadAttention.out_proj): only checked",
    "bound_op": "an fxprep.ops op: its callable's name plus the argument templates",
    "state": "any other trusted module class: created without __init__, its plain attributes restored",
    "same_as": "the same module object as another path (identity is kept)",
    "opaque_method": "an opaque part running owner.<method>: the owner as a saved object, the method by name (trusted code only)",
    "opaque_function": "an opaque part running a function, by its module.qualname (trusted code only)",
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
    with open_regular(path) as f:
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


def tensor_record(t: torch.Tensor) -> dict[str, Any]:
    """What a slot records about its tensor, checked against the weights file on load."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": [int(x) for x in t.shape]}


# --- load --------------------------------------------------------------------------------------
# Far above any real save (a 7B-parameter LLM's graph.json is a few MB, nesting ~20 deep).
# probe_bytes: the whole-load budget of the self-check's inputs (every example tensor of the input
# guard together, as drawn), checked from the declared shapes before anything is allocated; tensors
# and constants are bounded by the weights file itself (safetensors refuses a header whose offsets
# pass its end, and every slot's declared dtype and shape must match the tensor read).
# forward_bytes: what the self-check's forward may hold at once beyond the module's own weights
# (io/peak.py: each aten op is run on fake tensors first, and does not run past it); forward_tensors:
# how many tensors its ops may have made that are alive at once (~640 bytes each, views too: a real
# forward holds thousands; x.unbind() of a 2**28-element probe would make 2**28).
# op_flops: the multiply-adds x 2 one matmul, convolution or attention op may take (io/peak.py: counted on
# fake tensors before it runs; a real model's largest at its example's size is ~1e11). python_*: the
# Python values the graph's own Python calls build (io/pyvalues.py): bits of one integer, items of one
# sequence, items made over the whole run. load_seconds: the whole of load (and of save's self-check);
# past it, load stops between two ops with a SerializationError.
LIMITS = {"json_bytes": 256 * 2**20, "depth": 100, "values": 20_000_000, "entries": 2_000_000, "probe_bytes": 4 * 2**30,
          "forward_bytes": 8 * 2**30, "forward_tensors": 1_000_000, "op_flops": 2**42, "python_int_bits": 2**16,
          "python_items": 2**20, "python_total": 2**24, "load_seconds": 600}


def regular_file(path: Path) -> os.stat_result:
    """``path``'s stat if it is a regular file (not a link, device or fifo); SerializationError otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as err:
        raise SerializationError(f"{path} is missing: not an fxprep save directory (fxprep.save writes it).") from err
    except OSError as err:
        raise SerializationError(f"cannot read {path}: {err}") from err
    if not stat.S_ISREG(st.st_mode):
        raise SerializationError(f"{path} is not a regular file (a link, FIFO or device): fxprep.save never writes one.")
    return st


def open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file, checked on the open file itself: opened
    without following a link and without waiting (``O_NONBLOCK``: opening a FIFO for reading would
    block until a writer comes, which for a FIFO an unpacked archive left never happens), then
    refused unless ``fstat`` says regular. The check and the read are of the same file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as err:
        raise SerializationError(f"{path} is missing: not an fxprep save directory (fxprep.save writes it).") from err
    except OSError as err:  # ELOOP: a link
        raise SerializationError(f"cannot read {path} ({err.strerror}): fxprep.save writes regular files only.") from err
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise SerializationError(f"{path} is not a regular file (a link, FIFO or device): fxprep.save never writes one.")
    return f


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (fxprep writes non-finite floats as tagged values)")


def check_shape(data: Any, path: Path) -> None:
    """Depth and size of parsed JSON, walked without recursion."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > LIMITS["depth"] or count > LIMITS["values"]:
            what = "nested deeper" if depth > LIMITS["depth"] else "holds more values"
            limit = LIMITS["depth"] if depth > LIMITS["depth"] else LIMITS["values"]
            raise SerializationError(f"{path} is {what} than any fxprep save ({limit}): refusing to read it.")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def read_json(path: Path) -> Any:
    st = regular_file(path)
    if st.st_size > LIMITS["json_bytes"]:
        raise SerializationError(f"{path} is {st.st_size} bytes, more than any fxprep save ({LIMITS['json_bytes']}).")
    try:
        with open_regular(path) as f:
            raw = f.read(LIMITS["json_bytes"] + 1)
        if len(raw) > LIMITS["json_bytes"]:
            raise SerializationError(f"{path} is larger than any fxprep save ({LIMITS['json_bytes']} bytes).")
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError as err:
        raise SerializationError(f"{path} is nested deeper than any fxprep save: refusing to read it.") from err
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError; so are huge ints
        raise SerializationError(f"{path} is not valid JSON ({str(err)[:200]}); the file is damaged.") from err
    except OSError as err:
        raise SerializationError(f"cannot read {path}: {err}") from err
    check_shape(data, path)
    return data


def entries(container: Any, key: str, path: str) -> list[Any]:
    """A list field of a saved file, bounded in length."""
    value = container.get(key) if isinstance(container, dict) else None
    if not isinstance(value, list):
        raise SerializationError(f"malformed {path}: {key!r} must be a list.")
    if len(value) > LIMITS["entries"]:
        raise SerializationError(f"{path} lists {len(value)} {key}, more than any fxprep save ({LIMITS['entries']}).")
    return value


def training_flag(entry: dict[str, Any]) -> bool:
    """A module entry's ``training``: a bool (anything else would be truthy and switch train mode on)."""
    flag = entry.get("training", False)
    if type(flag) is not bool:
        raise SerializationError(f"malformed {MODULES}: {str(entry.get('path'))[:80]!r} has training={str(flag)[:40]!r}, "
                                 f"not true or false.")
    return flag


def is_save(directory: Path) -> bool:
    """Whether ``directory`` holds an fxprep save (a regular manifest naming the format)."""
    try:
        manifest = read_json(directory / MANIFEST)
    except SerializationError:
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


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
            regular_file(path)
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

    with open_regular(directory / WEIGHTS):  # a FIFO is refused without blocking (safe_open would wait on it)
        pass
    try:
        with safe_open(str(directory / WEIGHTS), framework="pt", device="cpu") as f:
            # One tensor at a time, so a misaligned one is copied while only it is in memory twice.
            return {key: _aligned(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, OverflowError, MemoryError) as err:
        raise SerializationError(f"cannot read {directory / WEIGHTS}: {str(err)[:300]}") from err
