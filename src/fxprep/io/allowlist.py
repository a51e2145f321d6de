"""The objects a saved file may name without ``trusted_modules``: the reviewed list, as objects.

:mod:`.trust` never follows a saved name attribute by attribute (``torch.nn.functional.torch.
builtins.eval`` *is* ``builtins.eval`` when walked that way). Instead, each name :mod:`.reviewed`
lists (one entry each, by family) is resolved here once, by a single dictionary lookup in a fixed
namespace object (``vars(torch.nn.functional)["relu"]``), and a saved name is a key in the table
this builds: what it resolves to is the object the table holds. Nothing outside the reviewed list
is ever in the table, whatever a namespace holds: a new torch release adds operators to
``torch``, not to this list. Excluded families (raw-pointer tensor makers, process-state changers,
I/O) are refused by identity as well, so a name that a torch version aliases to an excluded object
is refused too. Built lazily on first use and cached for the process.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import math
import operator
import sys
import types
from typing import Any

import torch
from torch import nn

from .. import cond, decisions
from . import checked, reviewed

# The namespaces a reviewed name may live in: saved prefix → the namespace object (looked up once,
# never walked). Order matters for saving: the first namespace holding an object names it (F before torch).
_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch.nn.functional", torch.nn.functional),
    ("torch", torch),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
    ("torch.fft", torch.fft),
    ("torch.functional", torch.functional),
    ("torch._C._nn", torch._C._nn),
    ("torch._C._linalg", torch._C._linalg),
    ("torch._C._special", torch._C._special),
    ("torch._C._fft", torch._C._fft),
    ("math", math),
    ("operator", operator),
    ("builtins", builtins),
)

# Graph helpers named by where they are defined (not in a namespace above).
_EXTRA_FUNCTIONS: dict[str, Any] = {
    "torch.fx._symbolic_trace._assert_is_none": torch.fx._symbolic_trace._assert_is_none,
    # `with torch.autocast(..., enabled=False):` regions (timm EfficientViT): balanced pairs only
    "torch.amp.autocast_mode._enter_autocast": torch.amp.autocast_mode._enter_autocast,
    "torch.amp.autocast_mode._exit_autocast": torch.amp.autocast_mode._exit_autocast,
    # a data-dependent branch of a prepared graph (control_flow="rewrite", a user's torch.cond)
    "fxprep.cond.cond": cond.cond,
    # the check of a value decided from the example (dynamo+values)
    "fxprep.decisions.check_decision": decisions.check_decision,
    # torch._grouped_mm behind a check of its offsets (a bfloat16 mixture of experts' saved graph)
    checked.NAME: checked.grouped_mm,
    # a shape built from symbolic sizes (GPT-2's ``input_shape + (hidden,)`` under dynamic shapes):
    # a tuple of ints, named here because a class is never looked up in a namespace above
    "torch.Size": torch.Size,
}
AUTOCAST_ENTER = torch.amp.autocast_mode._enter_autocast
AUTOCAST_EXIT = torch.amp.autocast_mode._exit_autocast

# torch.ops namespaces trusted by default (aten only: prims are lower-level, unchecked building blocks).
OP_NAMESPACES = frozenset({"aten"})

# Module classes: every nn.Module subclass defined under these packages.
_TORCH_CLASS_PACKAGES = ("torch.nn.modules", "torch.ao.nn")
_AO_SUBPACKAGES = (
    "torch.ao.nn.quantized", "torch.ao.nn.quantized.dynamic", "torch.ao.nn.quantized.reference", "torch.ao.nn.qat",
    "torch.ao.nn.qat.dynamic", "torch.ao.nn.intrinsic", "torch.ao.nn.intrinsic.qat", "torch.ao.nn.intrinsic.quantized",
    "torch.ao.nn.intrinsic.quantized.dynamic", "torch.ao.nn.quantizable", "torch.ao.nn.sparse",
)
TORCHVISION_OPS = "torchvision.ops"


def canonical_name(obj: Any) -> str | None:
    """``module.qualname`` of a class or function, as it names itself (None when it does not)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}.{qualname}"


_MISSING = object()


def resolve(name: str) -> Any:
    """The object a reviewed ``name`` stands for: one lookup in its namespace's own dict (None when
    this torch has no such entry)."""
    if name in _EXTRA_FUNCTIONS:
        return _EXTRA_FUNCTIONS[name]
    prefix, _, attr = name.rpartition(".")
    namespace = dict(_NAMESPACES).get(prefix)
    if namespace is None:
        return None
    obj = vars(namespace).get(attr, _MISSING)
    return None if obj is _MISSING or isinstance(obj, (types.ModuleType, type)) or not callable(obj) else obj


@functools.cache
def excluded_objects() -> dict[int, str]:
    """id → saved name of every excluded function this torch has (raw memory, process state, I/O)."""
    found: dict[int, str] = {}
    for names in reviewed.EXCLUDED_FUNCTIONS.values():
        for name in names:
            module, _, attr = name.rpartition(".")
            obj = vars(sys.modules[module]).get(attr) if module in sys.modules else None
            if obj is not None:
                found[id(obj)] = name
    return found


@functools.cache
def functions() -> dict[str, Any]:
    """Saved name → the function object it stands for: the reviewed functions this torch has."""
    table: dict[str, Any] = {}
    excluded = excluded_objects()
    for names in reviewed.FUNCTIONS.values():
        for name in names:
            obj = resolve(name)
            if obj is not None and id(obj) not in excluded:
                table[name] = obj
    return table


@functools.cache
def methods() -> frozenset[str]:
    """The reviewed Tensor method names (operator dunders are decided in :mod:`.trust`)."""
    return frozenset(m for names in reviewed.METHODS.values() for m in names)


@functools.cache
def aten_ops() -> frozenset[str]:
    """``torch.ops.aten`` op names allowed: the reviewed extras, and every reviewed torch function's
    own op (``torch.linalg.norm`` is ``aten.linalg_norm``, ``F.relu`` is ``aten.relu``)."""
    names = set(reviewed.ATEN)
    for name in functions():
        prefix, _, attr = name.rpartition(".")
        if prefix in ("torch", "torch.nn.functional", "torch._C._nn", "torch.functional"):
            names.add(attr)
        elif prefix in ("torch.linalg", "torch.special", "torch.fft"):
            names.add(f"{prefix.rpartition('.')[2]}_{attr}")
        elif prefix in ("torch._C._linalg", "torch._C._special", "torch._C._fft"):
            names.add(attr)
    excluded = {n.rpartition(".")[2] for names_ in reviewed.EXCLUDED_FUNCTIONS.values() for n in names_}
    return frozenset(names - excluded)


@functools.cache
def torchvision_functions() -> dict[str, Any]:
    """torchvision.ops' reviewed functions (nms, roi_align, box ops), by their defining module's name too."""
    try:
        ops = importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return {}
    table: dict[str, Any] = {}
    for name in reviewed.TORCHVISION_FUNCTIONS:
        obj = vars(ops).get(name)
        if isinstance(obj, types.FunctionType) and str(obj.__module__).startswith(TORCHVISION_OPS + "."):
            table[f"{TORCHVISION_OPS}.{name}"] = obj
            table[str(canonical_name(obj))] = obj
    return table


@functools.cache
def function_names() -> dict[int, str]:
    """id(function) → one saved name for it (the first namespace listing it wins: F before torch)."""
    order = {prefix: i for i, (prefix, _) in enumerate(_NAMESPACES)}
    names: dict[int, str] = {}
    for name, obj in sorted(functions().items(), key=lambda item: (order.get(item[0].rpartition(".")[0], 99), item[0])):
        names.setdefault(id(obj), name)
    return names


def _module_classes(package_names: tuple[str, ...]) -> dict[str, type]:
    table: dict[str, type] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not any(module_name == p or module_name.startswith(p + ".") for p in package_names):
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module_name:
                table[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return table


@functools.cache
def module_classes() -> dict[str, type]:
    """Saved class name → nn.Module subclass: torch.nn and torch.ao.nn layers, fxprep.ops ops."""
    for name in _AO_SUBPACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional part missing from this torch build
            continue
    from .. import ops

    table = _module_classes(_TORCH_CLASS_PACKAGES)
    table["torch.nn.modules.module.Module"] = nn.Module
    for obj in vars(ops).values():
        if isinstance(obj, type) and issubclass(obj, ops.BoundOp) and obj.__module__ == ops.__name__:
            table[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return table


@functools.cache
def torchvision_classes() -> dict[str, type]:
    """torchvision.ops' layers (FrozenBatchNorm2d, Conv2dNormActivation, FeaturePyramidNetwork...)."""
    try:
        importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return {}
    return _module_classes((TORCHVISION_OPS,))


@functools.cache
def dtype_table(kind: type) -> dict[str, Any]:
    """``{"float32": torch.float32, ...}`` for dtypes, layouts and memory formats, from torch's own
    module dict (never ``getattr(torch, saved_name)``, which may import submodules); built once per
    kind (the loader and the self-check read the same table; nobody writes to it)."""
    return {str(v).removeprefix("torch."): v for v in list(vars(torch).values()) if isinstance(v, kind)}
