"""What ``fxprep prepare`` is given, checked before torch is imported and before any model is built.

A mistake a string can show (a misspelt ``--dtype``, an ``-o`` into a folder that is not a save, a
checkpoint without ``config.json``, a missing path) is a usage error (exit 2) or, for a place that
cannot be written, a save error (exit 4), within a second, naming the flag or path and, where it
can, the closest right answer (:func:`closest`). What needs torch or the model is checked as soon as
that is at hand.

See docs/cli.md.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import InvalidInput, SerializationError
from ..options import TRACERS


class SpecError(InvalidInput):
    """A model spec, an ``--input`` string or an option that cannot be understood (a usage error)."""


SOURCES = ("torchvision", "timm", "transformers", "demo")
CONTROL_FLOW = ("rewrite",)
#: ``--dtype`` of a checkpoint: name -> torch dtype name (None: the checkpoint's own)
CHECKPOINT_DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                     "float16": "float16", "fp16": "float16"}
SPEC_FORMS = ("a checkpoint directory (config.json + safetensors, as save_pretrained writes it), torchvision:NAME, "
              "timm:NAME, transformers:TYPE_OR_CLASS, demo:NAME or path/to/file.py:ClassOrFactory")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|hpu|npu|meta)(:\d+)?$")
_INPUT = re.compile(r"^(?:[A-Za-z_]\w*=)?\d+(?:x\d+)*(?::\w+)?$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def closest(word: str, choices: Iterable[str], n: int = 5) -> list[str]:
    """The ``n`` choices nearest ``word`` (difflib's ratio; case ignored), nearest first."""
    by_lower: dict[str, str] = {}
    for c in choices:
        by_lower.setdefault(c.lower(), c)
    return [by_lower[m] for m in difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=0.6)]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` Did you mean X or Y?`` (with a leading space), or ``""`` when nothing is close."""
    near = closest(word, choices)
    if not near:
        return ""
    return " Did you mean " + (near[0] if len(near) == 1 else ", ".join(near[:-1]) + " or " + near[-1]) + "?"


def checkpoint_dir(spec: str) -> Path | None:
    """``spec`` as a checkpoint directory when it is a directory (whatever it holds); else None."""
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def check_checkpoint(path: Path, *, meta: bool) -> None:
    """A directory given as the spec: it must hold a readable ``config.json`` with a ``model_type`` and
    weights (safetensors for ``--meta``, whose weights ``load_weights`` reads)."""
    config = path / "config.json"
    if not config.is_file():
        held = sorted(p.name for p in path.iterdir())[:6] if os.access(path, os.R_OK) else []
        raise SpecError(f"{path} is a directory without config.json, so it is not a transformers checkpoint "
                        f"(save_pretrained writes config.json and the safetensors weights)"
                        + (f"; it holds {', '.join(held)}" if held else "; it is empty") + f". A spec is {SPEC_FORMS}.")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpecError(f"{config} cannot be read as JSON ({type(err).__name__}: {err}).") from err
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise SpecError(f"{config} has no model_type, so transformers cannot tell which model it describes.")
    names = {p.name for p in path.iterdir()}
    safetensors = any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names)
    if meta and not safetensors:
        raise SpecError(f"{path} holds no safetensors weights (model.safetensors or shards with "
                        f"model.safetensors.index.json): --meta loads the weights with fxprep.load_weights, "
                        f"which reads safetensors only; save_pretrained writes them by default.")
    if not safetensors and not any(n.endswith(".bin") for n in names):
        raise SpecError(f"{path} holds config.json but no weights (looked for {', '.join(WEIGHT_FILES)}).")


def check_spec(spec: str, *, meta: bool, checkpoint_options: bool) -> None:
    """The spec's form, and the path it names: a missing file or directory is said by its name."""
    directory = checkpoint_dir(spec)
    if directory is not None:
        check_checkpoint(directory, meta=meta)
        return
    if checkpoint_options:
        raise SpecError(f"--meta, --device and --dtype apply to a checkpoint directory (config.json + "
                        f"safetensors); {spec!r} is not one.")
    source, sep, name = spec.rpartition(":")
    if sep and name and not Path(source).is_file():
        first, _, rest = spec.partition(":")
        if first in SOURCES:
            source, name = first, rest
    if sep and source in SOURCES:
        if not name:
            raise SpecError(f"{spec!r} names no model: write {source}:NAME.")
        return
    if sep and name and source and (source.endswith(".py") or Path(source).exists() or "/" in source or os.sep in source):
        if not Path(source).is_file():
            raise SpecError(f"no such file {source!r} (spec {spec!r}: path/to/file.py:ClassOrFactory).")
        return
    if sep and source and name and not Path(spec).exists():
        raise SpecError(f"unknown model source {source!r} in {spec!r}.{did_you_mean(source, SOURCES)} "
                        f"A spec is {SPEC_FORMS}.")
    path = Path(spec).expanduser()
    if path.is_file():
        raise SpecError(f"{spec} is a file: a Python file is given as {spec}:ClassOrFactory (the class or function "
                        f"that builds the model), a checkpoint as its directory.")
    if not sep and not ("/" in spec or os.sep in spec or spec.startswith((".", "~"))):
        raise SpecError(f"{spec!r} is neither a directory here nor a model spec. A spec is {SPEC_FORMS}: "
                        f"for a zoo's model write {', '.join(f'{s}:{spec}' for s in SOURCES[:3])}.")
    if "/" in spec or os.sep in spec or spec.startswith((".", "~")):
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        raise SpecError(f"no such file or directory: {spec} (the nearest that exists is {parent}/). "
                        f"A spec is {SPEC_FORMS}.")
    raise SpecError(f"cannot read model spec {spec!r}: a spec is {SPEC_FORMS}.")


def check_choice(flag: str, value: str | None, choices: Iterable[str]) -> None:
    if value is not None and value not in choices:
        choices = list(choices)
        raise SpecError(f"{flag} must be one of {', '.join(choices)}, not {value!r}.{did_you_mean(value, choices)}")


def check_device(text: str | None) -> None:
    if text is not None and not _DEVICE.match(text):
        raise SpecError(f"--device {text!r} is not a device: write cpu, cuda, cuda:1 (or mps, xpu...).")
    if text is not None and text.startswith("meta"):
        raise SpecError("--device meta cannot hold the weights; use --meta to prepare without them.")


def check_inputs(flag: str, values: Iterable[str]) -> None:
    """``--input`` / ``--verify-input`` strings: their form only (the sizes are checked when made)."""
    for value in values:
        for part in (p.strip() for p in value.split(",")):
            if part and not _INPUT.match(part):
                raise SpecError(f"cannot read {flag} {part!r}: write DIMS[:DTYPE] or NAME=DIMS[:DTYPE], "
                                f"e.g. 1x3x224x224 or input_ids=1x16:int64.")


def check_output_dir(path: Path) -> None:
    """``-o``: a place a save can go, or an earlier save to replace; refused at once otherwise (exit 4).
    The exact rule (:func:`fxprep.io.target.check_target`) is applied again once torch is imported."""
    if path.is_symlink():
        raise SerializationError(f"-o {path}: it is a symbolic link; a save is never written through one. "
                                 f"Give the real directory's path.")
    if path.exists() and not path.is_dir():
        raise SerializationError(f"-o {path}: a file of that name exists (an existing file is never replaced); -o "
                                 f"names a directory to save into (the prepared module is several files).")
    if path.is_dir():
        try:
            names = sorted(os.listdir(path))
        except OSError as err:
            raise SerializationError(f"-o {path}: cannot list it ({err.strerror or err}).") from err
        if names and "manifest.json" not in names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise SerializationError(f"-o {path}: it is a directory that is not an fxprep save (it holds {shown}); -o "
                                     f"replaces only an empty directory or an earlier fxprep save. Choose a new or "
                                     f"empty directory.")
    _writable_ancestor("-o", path)


def check_output_file(flag: str, path: Path) -> None:
    """``--onnx`` / ``--show``: a file that can be written (an existing one is replaced)."""
    if path.is_dir():
        raise SerializationError(f"{flag} {path}: it is a directory; {flag} names a file to write.")
    _writable_ancestor(flag, path.parent if path.exists() else path)


def _writable_ancestor(flag: str, path: Path) -> None:
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SerializationError(f"{flag} {path}: {ancestor} is a file, so no directory can be made under it.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SerializationError(f"{flag} {path}: {ancestor} is not writable.")


def check_prepare(spec: str, *, inputs: list[str], verify_inputs: list[str], output: Path | None, onnx: Path | None,
                  show: Path | None, tracer: str, control_flow: str | None, dynamic: list[str], static: bool,
                  verify: bool, verify_grad: bool, meta: bool, device: str | None, dtype: str | None) -> None:
    """Every check of ``fxprep prepare``'s arguments that needs neither torch nor the model."""
    if verify_grad and not verify:
        raise SpecError("--verify-grad compares gradients during verification; it cannot go with --no-verify.")
    if static and dynamic:
        raise SpecError("--static captures for the example's shapes only; it cannot go with --dynamic.")
    check_choice("--tracer", tracer, TRACERS)
    check_choice("--control-flow", control_flow, CONTROL_FLOW)
    check_choice("--dtype", dtype.lower() if dtype is not None else None, CHECKPOINT_DTYPES)
    check_device(device)
    check_inputs("--input", inputs)
    check_inputs("--verify-input", verify_inputs)
    check_spec(spec, meta=meta, checkpoint_options=bool(meta or device or dtype))
    if output is not None:
        check_output_dir(output)
    for flag, path in (("--onnx", onnx), ("--show", show)):
        if path is not None:
            check_output_file(flag, path)
