"""The objects a saved file may name without ``trusted_modules``: the reviewed list, as objects.

Each name :mod:`.reviewed` lists is resolved once, by a single dictionary lookup in a fixed
namespace object, and a saved name is a key in the table this builds; an alias is accepted because
it resolves to the same object, and is never listed. :func:`candidate_function` and friends say what
an explicit ``allow=`` may add (never an excluded family). Built lazily on first use and cached.

See docs/security.md ("How names are resolved").
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
# the packages whose layer classes the list names (fxprep.ops' are allowed by rule)
LISTED_CLASS_PACKAGES = ("torch.nn.modules.", "torch.ao.nn.", "torchvision.ops.")
# classes allowed by rule, not listed: fxprep's op classes (each runs only the callable it names, which
# the list checks) and torch's module containers (ModuleList, ModuleDict, Sequential, ParameterList...:
# they hold children and run nothing but them; an opaque part's owner holds them in its state)
BY_RULE_CLASSES = ("fxprep.ops.", "torch.nn.modules.container.")


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
    """Saved name → the function object it stands for: the listed functions this torch has."""
    if _measuring:
        return candidate_functions()
    table: dict[str, Any] = {}
    excluded = excluded_objects()
    for name in reviewed.listed()["functions"]:
        obj = resolve(name)
        if obj is not None and id(obj) not in excluded:
            table[name] = obj
    return table


@functools.cache
def _listed_ids() -> frozenset[int]:
    return frozenset(id(obj) for obj in functions().values())


def alias(name: str) -> Any:
    """The listed function ``name`` stands for when it is another name of one (one lookup in its fixed
    namespace gives the very object), else None."""
    obj = resolve(name)
    return obj if obj is not None and id(obj) in _listed_ids() else None


@functools.cache
def methods() -> frozenset[str]:
    """The listed Tensor method names (operator dunders are decided in :mod:`.trust`)."""
    return candidate_methods() if _measuring else frozenset(reviewed.listed()["methods"])


@functools.cache
def aten_ops() -> frozenset[str]:
    """``torch.ops.aten`` ops allowed: ``op.overload`` as listed, or ``op`` where the list names the
    whole op (every overload)."""
    return frozenset(reviewed.listed()["aten"])


def aten_allowed(op: str, overload: str | None, table: frozenset[str] | None = None) -> bool:
    """Whether ``torch.ops.aten.<op>[.<overload>]`` is in ``table`` (default: the list)."""
    if _measuring and table is None:
        return candidate_aten(op)
    table = aten_ops() if table is None else table
    return op in table or (overload is not None and f"{op}.{overload}" in table)


@functools.cache
def torchvision_functions() -> dict[str, Any]:
    """torchvision.ops' listed functions, by their defining module's name too."""
    listed = [n.removeprefix(TORCHVISION_OPS + ".") for n in reviewed.listed()["functions"]
              if n.startswith(TORCHVISION_OPS + ".")]
    if not listed:
        return {}
    try:
        ops = importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return {}
    table: dict[str, Any] = {}
    for name in listed:
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


# --- what an explicit opt-in may add (and what measuring the list starts from) ----------------------
@functools.cache
def candidate_functions() -> dict[str, Any]:
    """Every callable a saved name may stand for when the caller allows it: each function of the fixed
    namespaces and the graph helpers, less the excluded ones (by identity)."""
    excluded = excluded_objects()
    table = {name: obj for name, obj in _EXTRA_FUNCTIONS.items() if id(obj) not in excluded}
    for prefix, namespace in _NAMESPACES:
        for attr in list(vars(namespace)):
            name = f"{prefix}.{attr}"
            if prefix in reviewed.PYTHON_NAMESPACES and name not in reviewed.OPT_IN_PYTHON:
                continue  # eval, exec, open, setattr, operator.call: never, whatever a caller allows
            obj = resolve(name)
            if obj is not None and id(obj) not in excluded and not attr.startswith("__"):
                table.setdefault(name, obj)
    return table


@functools.cache
def candidate_names() -> dict[int, str]:
    """id(function) → the saved name an opt-in gives it (the first namespace holding it: F before torch)."""
    order = {prefix: i for i, (prefix, _) in enumerate(_NAMESPACES)}
    names: dict[int, str] = {}
    for name, obj in sorted(candidate_functions().items(),
                            key=lambda item: (order.get(item[0].rpartition(".")[0], 99), item[0])):
        names.setdefault(id(obj), name)
    return names


def excluded(name: str) -> str | None:
    """The excluded callable ``name`` is (by its listed name, or what it resolves to), else None."""
    names = {n for entries in reviewed.EXCLUDED_FUNCTIONS.values() for n in entries}
    if name in names:
        return name
    obj = resolve(name)
    return excluded_objects().get(id(obj)) if obj is not None else None


def default_namespace(name: str) -> bool:
    """Whether a saved function or class name is one the default list decides (a torch, math, operator
    or builtins callable, fxprep's graph helpers, a torch.nn layer, an excluded callable), not a
    trusted package's."""
    return (resolve(name) is not None or name in _EXTRA_FUNCTIONS or name.startswith(LISTED_CLASS_PACKAGES)
            or name.startswith("fxprep.ops.") or excluded(name) is not None)


def any_name(fn: Any) -> str:
    """The saved name of ``fn``: its listed name, else the name an opt-in gives it, else "" (the
    candidates are built only when a function is not listed: never for an honest save)."""
    name = function_names().get(id(fn))
    return name if name is not None else candidate_names().get(id(fn), "")


def candidate_function(name: str) -> Any:
    """The callable an ``allow=`` entry names, or None when no opt-in may allow it."""
    return candidate_functions().get(name)


@functools.cache
def candidate_methods() -> frozenset[str]:
    """Every public Tensor method, less the excluded ones."""
    excluded = {m for names in reviewed.EXCLUDED_METHODS.values() for m in names}
    return frozenset(n for n in dir(torch.Tensor) if not n.startswith("_") and n not in excluded
                     and callable(getattr(torch.Tensor, n, None)))


def candidate_aten(op: str) -> bool:
    """Whether ``torch.ops.aten.<op>`` may be allowed: any aten op but an excluded function's."""
    excluded = {n.rpartition(".")[2] for names in reviewed.EXCLUDED_FUNCTIONS.values() for n in names}
    return op not in excluded and not op.startswith(("_unsafe", "_from_blob", "set_", "_set_", "_sparse", "sparse_",
                                                     "_nested", "from_file", "_efficientzerotensor"))


@functools.cache
def candidate_module_classes() -> dict[str, type]:
    """Every torch.nn / torch.ao.nn layer class, fxprep's op classes and, where torchvision is
    installed, torchvision.ops' layers (what the tables hold when every layer is allowed)."""
    table = _all_module_classes()
    try:
        importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return table
    return {**table, **_module_classes((TORCHVISION_OPS,))}


def widen_for_measurement() -> None:
    """Allow every candidate for this process: for ``benchmarks/allowlist_usage.py`` alone, which
    measures what prepared graphs name and must not be refused for what the list does not hold yet."""
    global _measuring
    _measuring = True
    for table in (functions, _listed_ids, methods, aten_ops, function_names, module_classes, torchvision_functions,
                  torchvision_classes):
        table.cache_clear()


_measuring = False


def _module_classes(package_names: tuple[str, ...]) -> dict[str, type]:
    table: dict[str, type] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not any(module_name == p or module_name.startswith(p + ".") for p in package_names):
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module_name:
                table[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return table


def _all_module_classes() -> dict[str, type]:
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
def module_classes() -> dict[str, type]:
    """Saved class name → nn.Module subclass a save may build: the listed torch.nn / torch.ao.nn layers
    (found by their own names among the classes those packages define), and by rule every fxprep.ops op
    class and torch module container (:data:`BY_RULE_CLASSES`)."""
    every = _all_module_classes()
    if _measuring:
        return every
    listed = set(reviewed.listed()["classes"])
    return {name: cls for name, cls in every.items() if name in listed or name.startswith(BY_RULE_CLASSES)}


@functools.cache
def torchvision_classes() -> dict[str, type]:
    """torchvision.ops' listed layers (FrozenBatchNorm2d, Conv2dNormActivation...)."""
    listed = {n for n in reviewed.listed()["classes"] if n.startswith(TORCHVISION_OPS + ".")}
    if not listed and not _measuring:
        return {}
    try:
        importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return {}
    every = _module_classes((TORCHVISION_OPS,))
    return every if _measuring else {name: cls for name, cls in every.items() if name in listed}


@functools.cache
def dtype_table(kind: type) -> dict[str, Any]:
    """``{"float32": torch.float32, ...}`` for dtypes, layouts and memory formats, from torch's own
    module dict (never ``getattr(torch, saved_name)``, which may import submodules); built once per
    kind (the loader and the self-check read the same table; nobody writes to it)."""
    return {str(v).removeprefix("torch."): v for v in list(vars(torch).values()) if isinstance(v, kind)}
