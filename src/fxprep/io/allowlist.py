"""The objects a saved file may name without ``trusted_modules``, enumerated from the real modules.

:mod:`.trust` never follows a saved name attribute by attribute (``torch.nn.functional.torch.
builtins.eval`` *is* ``builtins.eval`` when walked that way). Instead, the functions and classes a
save may use are listed here once, as objects, by walking torch's operator namespaces, ``math``,
``operator`` and a few builtins, and the ``torch.nn`` / ``torch.ao.nn`` / ``fxprep`` module
classes. A saved name is then a key in these tables, and what it resolves to is the object the
table holds. Built lazily on first use (a few tens of milliseconds) and cached for the process.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import math
import operator
import re
import sys
import types
from typing import Any

import torch
from torch import nn

from .. import cond, decisions

# Namespaces whose public (and, for torch's C namespaces, private) tensor ops a graph may call:
# (prefix written in saves, the namespace object, whether _names count).
_NAMESPACES: tuple[tuple[str, Any, bool], ...] = (
    ("torch.nn.functional", torch.nn.functional, False),
    ("torch", torch, True),
    ("torch.special", torch.special, False),
    ("torch.linalg", torch.linalg, False),
    ("torch.fft", torch.fft, False),
    ("torch.functional", torch.functional, False),
    ("torch._C._nn", torch._C._nn, True),
    ("torch._C._linalg", torch._C._linalg, True),
    ("torch._C._special", torch._C._special, True),
    ("torch._C._fft", torch._C._fft, True),
)

# Where a tensor op is implemented: builtins report one of these as __module__ ...
_BUILTIN_HOMES = frozenset({"torch", "torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft"})
# ... Python-level ops one of these.
_PYTHON_HOMES = frozenset({
    "torch.nn.functional", "torch.functional", "torch._lowrank", "torch._lobpcg", "torch._linalg_utils",
})

# Python functions defined in torch/__init__.py that graphs call (shape asserts, symbolic ints).
_TORCH_PYTHON_OK = frozenset({
    "_assert", "_check", "_check_is_size", "sym_float", "sym_int", "sym_ite", "sym_max", "sym_min", "sym_not",
    "sym_sqrt", "sym_sum", "is_tensor",
})

# Names refused in every namespace: files, threads, global or process state, code loading.
DENY = re.compile(
    r"^(load|save|from_file|fork|wait|compile|cond|while_loop|vmap|import_ir_module.*|parse_.*|set_.*|_set_.*|"
    r"init_num_threads|manual_seed|seed|initial_seed|.*_seed|.*rng_state|_cufft_.*|_enable_.*|_disable_.*|_print|"
    r"_test_.*|use_deterministic_algorithms|handle_torch_function|has_torch_function.*|boolean_dispatch|_add_docstr)$"
)

# Graph targets outside the namespaces, named by where they are defined.
_EXTRA_FUNCTIONS: tuple[tuple[str, Any], ...] = (
    ("torch.fx._symbolic_trace._assert_is_none", torch.fx._symbolic_trace._assert_is_none),
    # Dynamo's grad-mode toggles and `with torch.autocast(..., enabled=False):` regions (timm EfficientViT)
    ("torch._C._set_grad_enabled", torch._C._set_grad_enabled),
    ("torch.amp.autocast_mode._enter_autocast", torch.amp.autocast_mode._enter_autocast),
    ("torch.amp.autocast_mode._exit_autocast", torch.amp.autocast_mode._exit_autocast),
    # a data-dependent branch of a prepared graph (control_flow="rewrite", a user's torch.cond)
    ("fxprep.cond.cond", cond.cond),
    # the check of a value decided from the example (dynamo+values)
    ("fxprep.decisions.check_decision", decisions.check_decision),
)

BUILTINS = ("len", "getattr", "int", "float", "bool", "abs", "min", "max", "round", "range", "tuple", "list",
            "slice", "sum", "all", "any", "divmod", "pow", "isinstance")

# operator's factories of getters and callers would turn data into code.
_OPERATOR_DENY = frozenset({"attrgetter", "itemgetter", "methodcaller", "call"})

# torch.ops namespaces trusted by default, and op names refused in them.
OP_NAMESPACES = frozenset({"aten", "prims"})
OP_DENY = re.compile(r"^(from_file|save|load.*|.*seed|_cufft_.*|_print|set_.*|_set_.*)$")

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


def _is_op(obj: Any, prefix: str, name: str) -> bool:
    if isinstance(obj, (types.ModuleType, type)) or not callable(obj) or DENY.match(name):
        return False
    home = getattr(obj, "__module__", None)
    if isinstance(obj, types.BuiltinFunctionType):
        return home in _BUILTIN_HOMES
    if isinstance(obj, types.FunctionType):
        if prefix == "torch" and home == "torch":
            return name in _TORCH_PYTHON_OK
        return home in _PYTHON_HOMES
    return False


@functools.cache
def functions() -> dict[str, Any]:
    """Saved name → the function object it stands for (every name fxprep writes for these)."""
    table: dict[str, Any] = {}
    for prefix, namespace, private_ok in _NAMESPACES:
        for name, obj in vars(namespace).items():
            if name.startswith("__") or (name.startswith("_") and not private_ok):
                continue
            if _is_op(obj, prefix, name):
                table[f"{prefix}.{name}"] = obj
    for name in dir(math):
        if not name.startswith("_") and isinstance(getattr(math, name), types.BuiltinFunctionType):
            table[f"math.{name}"] = getattr(math, name)
    for name in dir(operator):
        obj = getattr(operator, name)
        if not name.startswith("_") and name not in _OPERATOR_DENY and callable(obj) and not isinstance(obj, type):
            table[f"operator.{name}"] = obj
    for name in BUILTINS:
        table[f"builtins.{name}"] = getattr(builtins, name)
    for name, obj in _EXTRA_FUNCTIONS:
        table[name] = obj
    return table


@functools.cache
def torchvision_functions() -> dict[str, Any]:
    """torchvision.ops' own functions (nms, roi_align, box ops), by their defining module's name."""
    try:
        ops = importlib.import_module(TORCHVISION_OPS)
    except ImportError:
        return {}
    table: dict[str, Any] = {}
    for name in getattr(ops, "__all__", ()):
        obj = getattr(ops, name, None)
        if isinstance(obj, types.FunctionType) and str(obj.__module__).startswith(TORCHVISION_OPS + "."):
            table[f"{TORCHVISION_OPS}.{name}"] = obj
            table[str(canonical_name(obj))] = obj
    return table


@functools.cache
def function_names() -> dict[int, str]:
    """id(function) → one saved name for it (the first namespace listing it wins: F before torch)."""
    names: dict[int, str] = {}
    for name, obj in functions().items():
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
