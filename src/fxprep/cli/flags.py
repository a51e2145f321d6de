"""The ``prepare`` options that need reading: ``--dynamic``, ``--exclude``, ``--exclude-class``,
``--verify-input`` and ``-o``, each turned into what :func:`fxprep.prepare_model` takes.

Each mistake is a :class:`~fxprep.cli.specs.SpecError` (exit 2) that shows the expected form and,
where the model knows the answer, the names it would accept (closest first), because a typo in a
module name is the common case and the model's own list is the fastest fix.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import SerializationError
from .specs import SpecError, inputs_from_strings, integer_high
from .validate import check_output_dir as check_output_dir_early

_DYNAMIC_ITEM = re.compile(r"^(?P<dim>\d+)(?:=(?P<symbol>[A-Za-z_]\w*))?$")


def _closest(word: str, choices: Iterable[str], n: int = 8) -> str:
    choices = sorted(set(choices))
    near = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    shown = near or choices[:n]
    more = "" if near or len(choices) <= n else f", ... ({len(choices)} in all)"
    return ", ".join(shown) + more


def parse_dynamic(values: list[str], model: nn.Module, example: Any) -> Any:
    """``--dynamic`` values → the ``dynamic`` option: ``"batch"`` or ``{argument: {dim: symbol}}``."""
    if not values:
        return None
    if "batch" in values:
        if len(values) > 1:
            raise SpecError("--dynamic batch makes dim 0 of every input dynamic; do not combine it with NAME:DIM=SYMBOL.")
        return "batch"
    arguments = _argument_names(model, example)
    dynamic: dict[str, dict[int, str]] = {}
    for value in values:
        name, sep, dims = value.partition(":")
        items = [_DYNAMIC_ITEM.match(d.strip()) for d in dims.split(",")] if sep else [None]
        if not name.isidentifier() or any(m is None for m in items):
            raise SpecError(
                f"cannot read --dynamic {value!r}: write 'batch' or NAME:DIM=SYMBOL[,DIM=SYMBOL...], "
                f"e.g. input_ids:0=batch,1=seq (SYMBOL defaults to NAME_DIM)."
            )
        if arguments and name not in arguments:
            raise SpecError(f"--dynamic {value!r}: {name!r} is not an input of {type(model).__name__}.forward; "
                            f"its inputs: {', '.join(arguments)}.")
        for m in items:
            assert m is not None
            dynamic.setdefault(name, {})[int(m["dim"])] = m["symbol"] or f"{name}_{m['dim']}"
    return dynamic


def _argument_names(model: nn.Module, example: Any) -> list[str]:
    """The names ``--dynamic`` may use: forward()'s parameters (and the example's keyword names)."""
    names = list(example) if isinstance(example, dict) else []
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return names
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return []  # *args / **kwargs: any name may be right; prepare_model checks it against the call
    return names + [p.name for p in params if p.name not in names]


def modules_to_exclude(model: nn.Module, names: list[str]) -> list[nn.Module] | None:
    """``--exclude`` qualified module names → the model's module objects."""
    if not names:
        return None
    known = dict(model.named_modules())
    out = []
    for name in names:
        if not name or name not in known:
            raise SpecError(f"--exclude {name!r}: {type(model).__name__} has no submodule of that name; "
                            f"closest: {_closest(name, (k for k in known if k))}.")
        out.append(known[name])
    return out


def classes_to_exclude(model: nn.Module, names: list[str]) -> list[type] | None:
    """``--exclude-class`` values → classes: a class of the model's own modules by name or
    qualified name, else an importable ``package.module.Class`` path."""
    if not names:
        return None
    used: dict[str, set[type]] = {}
    for m in model.modules():
        cls = type(m)
        used.setdefault(cls.__name__, set()).add(cls)
        used.setdefault(f"{cls.__module__}.{cls.__qualname__}", set()).add(cls)
    out = []
    for name in names:
        found = used.get(name)
        if found and len(found) > 1:
            paths = sorted(f"{c.__module__}.{c.__qualname__}" for c in found)
            raise SpecError(f"--exclude-class {name!r} names {len(found)} different classes in the model: "
                            f"{', '.join(paths)}; give the qualified name.")
        if found:
            out.append(next(iter(found)))
        elif "." in name:
            out.append(_import_class(name))
        else:
            plain = (k for k in used if "." not in k)
            raise SpecError(f"--exclude-class {name!r}: no module of {type(model).__name__} has that class; "
                            f"classes in the model (closest first): {_closest(name, plain)}. An importable "
                            f"path (package.module.Class) also works.")
    return out


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise SpecError(f"--exclude-class {path!r}: cannot import it ({type(err).__name__}: {err}).") from err
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise SpecError(f"--exclude-class {path!r} is not a torch.nn.Module class.")
    return obj


def split_inputs(values: Iterable[str]) -> list[str]:
    """``--input`` values, each possibly several comma-separated tensors, as one list of tensors."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def verify_inputs(values: list[str], model: nn.Module) -> list[Any]:
    """``--verify-input`` values → extra example inputs: each value is one call, its tensors
    separated by commas (``1x3x64x64`` or ``input_ids=2x12:int64,attention_mask=2x12:int64``)."""
    return [inputs_from_strings(split_inputs([value]), high=integer_high(model)) for value in values]


def check_output_dir(path: Path) -> None:
    """``-o``: the checks that need no torch (:func:`.validate.check_output_dir`), then the rule
    ``fxprep.save`` itself applies (:func:`fxprep.io.target.check_target`: an earlier fxprep save is
    replaced, anything else refused), before minutes of preparing rather than after."""
    from ..io.target import check_target

    check_output_dir_early(path)
    try:
        check_target(path, overwrite=True)
    except SerializationError as err:
        raise SerializationError(f"-o {path}: {err}") from None
