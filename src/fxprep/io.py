"""Save and load prepared modules without pickle.

A prepared module is handed to other tools, other machines and other people, so the saved form must
be readable without the original model's source and safe to open when it comes from someone else.
``torch.save`` fails both ways: it pickles (opening a file runs code) and it needs every class the
model was defined with. A saved directory holds instead:

``manifest.json``
    format name and version, fxprep and torch versions, the input spec, the fxprep report, and the
    sha256 of every other file (an edited or truncated file is refused with a clear error).
``graph.json``
    the ``torch.fx`` node list (name, op, target, args, kwargs) plus the pytree calling convention.
    Function targets are importable names; constants are tagged JSON (see :func:`encode`).
``modules.json``
    the module tree, one entry per path (see :data:`KINDS`), and where each tensor goes.
``weights.safetensors``
    every parameter, buffer and tensor constant, each tensor *object* once: tied weights are saved
    once and re-tied on load.
``forward.py``
    the generated ``forward`` code, for people to read. It is never executed.

Loading rebuilds the graph node by node from ``graph.json``; nothing is ``exec``-ed, ``eval``-ed or
unpickled. Every name a file asks to import is checked first (:class:`TrustPolicy`): classes must be
``nn.Module`` subclasses from a trusted module; functions must be tensor ops from torch's operator
namespaces, ``math``, ``operator`` (minus the getter factories), a short list of builtins, or a
module the caller trusts explicitly; attribute and method names starting with ``_`` (the way from a
tensor to ``__globals__``) are refused, apart from the Tensor operator dunders. A file that asks for
anything else raises :class:`~fxprep.errors.SerializationError` naming what it asked for.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import json
import math
import operator
import os
import re
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from . import ops
from .errors import SerializationError
from .passes import state_dict as state_dict_pass

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
}

DEFAULT_TRUSTED_CLASSES = ("torch.nn.", "torch.ao.nn.", "fxprep.", "torchvision.ops.", "torchvision.models.")
DEFAULT_TRUSTED_FUNCTIONS = ("torchvision.ops.",)
_CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

# Functions that may be called by a loaded graph -------------------------------------------------
_TORCH_NAMESPACES = (
    "torch.nn.functional.", "torch.special.", "torch.linalg.", "torch.fft.", "torch.functional.",
    "torch._C._nn.", "torch._C._linalg.", "torch._C._special.", "torch._C._fft.", "torch._C._VariableFunctions.",
    "torch.ops.aten.", "torch.ops.prims.",
)
_TORCH_EXTRA = frozenset({
    "torch.fx._symbolic_trace._assert_is_none", "torch._C._set_grad_enabled", "torch._assert",
    # `with torch.autocast(..., enabled=False):` regions as Dynamo records them (timm EfficientViT)
    "torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast",
})
# Top-level torch callables that touch files, compile code or change global state.
_TORCH_DENY = re.compile(
    r"^(load|save|compile|from_file|import_ir_module.*|set_.*|use_deterministic.*|manual_seed|seed|"
    r"initial_seed|hub|jit|package|export|onnx|library|classes|cond|vmap|func|_.*)$"
)
_BUILTINS = frozenset({
    "len", "getattr", "int", "float", "bool", "abs", "min", "max", "round", "range", "tuple", "list",
    "slice", "sum", "all", "any", "divmod", "pow", "isinstance",
})
_OPERATOR_DENY = frozenset({"attrgetter", "methodcaller", "call"})
# Dunder methods a graph may call on tensors (operator overloads), nothing else starting with "_".
_DUNDER_OK = frozenset(
    n for n in dir(torch.Tensor)
    if n.startswith("__") and n.endswith("__") and n.strip("_") in {
        *(m.strip("_") for m in dir(operator) if m.startswith("__")), "getitem", "setitem", "len", "radd", "rsub",
        "rmul", "rtruediv", "rfloordiv", "rpow", "rmatmul", "rand", "ror", "rxor", "rlshift", "rrshift", "rmod",
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow", "iand", "ior", "ixor",
    }
)


@dataclass(frozen=True)
class TrustPolicy:
    """What a loaded file may import. ``modules`` are extra module prefixes the caller trusts (their
    classes and functions), e.g. ``("timm.layers", "mypackage")``."""

    modules: tuple[str, ...] = ()

    def _trusted(self, name: str, defaults: tuple[str, ...]) -> bool:
        prefixes = (*defaults, *(m.rstrip(".") + "." for m in self.modules))
        return name.startswith(prefixes)

    def check_function(self, name: str) -> None:
        """Raise unless ``name`` may be called by a loaded graph."""
        if name.startswith("Tensor."):
            check_member(name.removeprefix("Tensor."), "Tensor method")
            return
        if name.startswith("autograd:"):
            self.check_class_name(name.removeprefix("autograd:"), "autograd.Function")
            return
        head, _, last = name.rpartition(".")
        if head == "operator" and last not in _OPERATOR_DENY and not last.startswith("_"):
            return
        if head == "builtins" and last in _BUILTINS:
            return
        if head == "math" and not last.startswith("_"):
            return
        if name in _TORCH_EXTRA or name.startswith(_TORCH_NAMESPACES):
            if not any(part.startswith("__") for part in name.split(".")):
                return
        if head == "torch" and not _TORCH_DENY.match(last):
            return
        if self._trusted(name, DEFAULT_TRUSTED_FUNCTIONS):
            return
        if name.startswith("torch.ops.") and name.count(".") >= 3:
            # A library's custom ops live under its own namespace (transformers' MoE kernels are
            # torch.ops.transformers.*): trusting the library trusts the ops it registers.
            namespace = name.split(".")[2]
            if any(m.rstrip(".") == namespace for m in self.modules):
                return
        raise SerializationError(
            f"refusing to load: the graph calls {name!r}, which is not a torch tensor op fxprep trusts. "
            f"If you trust the module it comes from, pass trusted_modules=[{name.rpartition('.')[0]!r}] to fxprep.load."
        )

    def check_class_name(self, name: str, what: str = "module class") -> None:
        if any(part.startswith("__") for part in name.split(".")) or not self._trusted(name, DEFAULT_TRUSTED_CLASSES):
            raise SerializationError(
                f"refusing to load: the file asks for {what} {name!r}, outside the trusted modules. "
                f"If you trust it, pass trusted_modules=[{name.rpartition('.')[0]!r}] to fxprep.load."
            )


def check_member(name: str, what: str) -> None:
    """Attribute / method names a loaded graph may use: public ones and the Tensor operator dunders."""
    if not isinstance(name, str) or not name.isidentifier() or (name.startswith("_") and name not in _DUNDER_OK):
        raise SerializationError(f"refusing to load: {what} {name!r} is private; a saved graph never needs it.")


def _import(name: str) -> Any:
    """Import ``pkg.mod.Attr.attr`` (the module part found by trying the longest importable prefix)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            break
        return obj
    raise SerializationError(f"cannot import {name!r}: is the package that defines it installed?")


# --- naming functions and classes ----------------------------------------------------------------
_CANONICAL_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch", torch), ("torch.nn.functional", torch.nn.functional), ("torch.special", torch.special),
    ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("math", math), ("operator", operator),
    ("builtins", builtins),
)


def function_name(fn: Any) -> str:
    """An importable name for a graph target or BoundOp callable, checked to resolve to ``fn`` itself.

    Starts from :func:`fxprep.ops.qualified_name`; OpOverloads are ``torch.ops.<ns>.<op>.<overload>``.
    """
    if isinstance(fn, torch._ops.OpOverload):
        name = f"torch.ops.{fn.namespace}.{fn._opname}.{fn._overloadname}"
    elif isinstance(fn, torch._ops.OpOverloadPacket):
        name = f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
    else:
        name = ops.qualified_name(fn)
    if _resolves_to(name, fn):
        return name
    short = getattr(fn, "__name__", None)
    for prefix, namespace in _CANONICAL_NAMESPACES:
        if short and getattr(namespace, short, None) is fn:
            return f"{prefix}.{short}"
    raise SerializationError(
        f"cannot save a call to {fn!r}: it has no importable name ({name!r} does not resolve to it). "
        f"Define it at module level, or mark the calling module fxprep.opaque / modules_to_exclude."
    )


def _resolves_to(name: str, fn: Any) -> bool:
    try:
        found = _resolve_function(name)
    except Exception:  # noqa: BLE001 - any failure means "not this name"
        return False
    if isinstance(found, ops._MethodCall) and isinstance(fn, ops._MethodCall):
        return found.name == fn.name
    if getattr(fn, "autograd_function", None) is not None:
        return getattr(found, "autograd_function", None) is fn.autograd_function
    return found is fn


def _resolve_function(name: str) -> Callable[..., Any]:
    if name.startswith("torch.ops."):
        obj: Any = torch.ops
        for part in name.removeprefix("torch.ops.").split("."):
            obj = getattr(obj, part)
        return obj
    try:
        return ops.resolve_callable(name)
    except ImportError as err:
        raise SerializationError(f"cannot import callable {name!r}: {err}") from err


def load_function(name: str, policy: TrustPolicy) -> Callable[..., Any]:
    policy.check_function(name)
    return _resolve_function(name)


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def load_class(name: str, policy: TrustPolicy) -> type[nn.Module]:
    policy.check_class_name(name)
    cls = _import(name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise SerializationError(f"refusing to load: {name!r} is not an nn.Module subclass.")
    return cls


# --- constants ---------------------------------------------------------------------------------
_TYPES: dict[str, Any] = {
    "torch.Tensor": torch.Tensor, "int": int, "float": float, "bool": bool, "str": str, "torch.Size": torch.Size,
    "torch.dtype": torch.dtype, "torch.device": torch.device,
}
_TYPE_NAMES = {v: k for k, v in _TYPES.items()}


@dataclass
class _Encoder:
    """Turns Python values into tagged JSON. ``tensor_key`` (when given) names a tensor in the
    weights file; ``where`` says what is being encoded, for error messages."""

    where: str
    tensor_key: Callable[[torch.Tensor], str] | None = None

    def __call__(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) in (int, bool):
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
        if isinstance(v, fx.Node):
            return {"$": "node", "v": v.name}
        if isinstance(v, ops.Slot):
            return {"$": "slot", "v": v.index}
        if isinstance(v, torch.Size):
            return {"$": "size", "v": [int(x) for x in v]}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$": "tuple", "v": [self(x) for x in v]}
        if type(v) is list or isinstance(v, fx.immutable_collections.immutable_list):
            return [self(x) for x in v]
        if type(v) is dict or isinstance(v, fx.immutable_collections.immutable_dict):
            return {"$": "dict", "v": [[self(k), self(x)] for k, x in v.items()]}
        if isinstance(v, slice):
            return {"$": "slice", "v": [self(v.start), self(v.stop), self(v.step)]}
        if v is Ellipsis:
            return {"$": "ellipsis"}
        if isinstance(v, complex):
            return {"$": "complex", "v": [v.real, v.imag]}
        if isinstance(v, torch.dtype):
            return {"$": "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$": "device", "v": str(v)}
        if isinstance(v, torch.memory_format):
            return {"$": "memory_format", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.layout):
            return {"$": "layout", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Tensor) and self.tensor_key is not None:
            return {"$": "tensor", "v": self.tensor_key(v)}
        if isinstance(v, type) and v in _TYPE_NAMES:
            return {"$": "type", "v": _TYPE_NAMES[v]}
        if callable(v) and not isinstance(v, (type, nn.Module)):
            return {"$": "fn", "v": function_name(v)}
        raise SerializationError(
            f"cannot save {self.where}: a {type(v).__qualname__} has no safe saved form (fxprep saves tensors, "
            f"numbers, strings, dtypes, devices, slices, tuples/lists/dicts of those, and functions with an importable name)."
        )


@dataclass
class _Decoder:
    policy: TrustPolicy
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self(x) for x in v]
        if not isinstance(v, dict) or "$" not in v:
            raise SerializationError(f"malformed value in saved file: {str(v)[:80]}")
        tag, x = v["$"], v.get("v")
        try:
            return self._tagged(tag, x)
        except SerializationError:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed entry is a file problem
            raise SerializationError(f"malformed {tag!r} value in saved file: {str(x)[:80]} ({err})") from err

    def _tagged(self, tag: str, x: Any) -> Any:
        if tag == "node":
            if x not in self.nodes:
                raise SerializationError(f"graph refers to node {x!r} before it is defined (or never).")
            return self.nodes[x]
        if tag == "tuple":
            return tuple(self(i) for i in x)
        if tag == "dict":
            return {self(k): self(i) for k, i in x}
        if tag == "slot":
            return ops.Slot(int(x))
        if tag == "slice":
            return slice(*(self(i) for i in x))
        if tag == "float":
            if x not in ("inf", "-inf", "nan"):
                raise SerializationError(f"bad float {x!r}")
            return float(x)
        if tag == "size":
            return torch.Size(int(i) for i in x)
        if tag == "ellipsis":
            return Ellipsis
        if tag == "complex":
            return complex(float(x[0]), float(x[1]))
        if tag in ("dtype", "memory_format", "layout"):
            value = getattr(torch, str(x), None)
            kinds = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}
            if not isinstance(value, kinds[tag]):
                raise SerializationError(f"unknown {tag} {x!r}")
            return value
        if tag == "device":
            return torch.device(str(x))
        if tag == "tensor":
            if x not in self.tensors:
                raise SerializationError(f"tensor {x!r} is missing from {WEIGHTS}.")
            return self.tensors[x]
        if tag == "type":
            if x not in _TYPES:
                raise SerializationError(f"unknown type {x!r}")
            return _TYPES[x]
        if tag == "fn":
            return load_function(str(x), self.policy)
        raise SerializationError(f"unknown value tag {tag!r} in saved file.")


# --- module tree: save side ---------------------------------------------------------------------
def _own_attrs(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}


# Constructor arguments whose value is not stored under their own name.
_INIT_OVERRIDES: dict[type, Callable[[nn.Module], dict[str, Any]]] = {
    nn.MultiheadAttention: lambda m: {"bias": m.in_proj_bias is not None, "add_bias_kv": m.bias_k is not None},
}


def init_kwargs(module: nn.Module) -> dict[str, Any] | None:
    """Constructor arguments of a ``torch.nn`` layer, read back from its attributes (None when some
    required argument is not stored). Tensor-valued flags (``bias``) become booleans; ``device``,
    ``dtype`` and private arguments take their defaults (tensors are assigned after construction)."""
    cls = type(module)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if isinstance(module, nn.RNNBase) and cls is not nn.RNNBase:
            # LSTM/GRU/RNN take (*args, **kwargs) and pass their mode to RNNBase themselves.
            params = [p for p in list(inspect.signature(nn.RNNBase.__init__).parameters.values())[1:] if p.name != "mode"]
            if isinstance(module, nn.RNN):
                params.append(inspect.Parameter("nonlinearity", inspect.Parameter.KEYWORD_ONLY, default="tanh"))
    except (TypeError, ValueError):
        return None
    override = _INIT_OVERRIDES.get(cls, lambda m: {})(module)
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("device", "dtype") or p.name.startswith("_"):
            continue
        if p.name in override:
            kwargs[p.name] = override[p.name]
            continue
        try:
            value = getattr(module, p.name)
        except AttributeError:
            if p.default is p.empty:
                return None
            continue
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        elif isinstance(value, (torch.Tensor, nn.Module)):
            if p.default is p.empty:
                return None
            continue
        if p.default is not p.empty and _same(value, p.default):
            continue  # defaults are left out: shorter, and some classes refuse explicit defaults (GRU proj_size)
        kwargs[p.name] = value
    return kwargs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, weakref.ref) and isinstance(b, weakref.ref):
        return True  # caches of references to tensors (RNN flat weights): rebuilt by the class itself
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001
        return False


def _structure_matches(original: nn.Module, rebuilt: nn.Module) -> bool:
    """Same subtree paths and classes, same tensor slots (names, None-ness, shapes), same buffer
    persistence and no more hooks than the constructor itself registers."""
    a = list(original.named_modules(remove_duplicate=False))
    b = list(rebuilt.named_modules(remove_duplicate=False))
    if [(n, type(m)) for n, m in a] != [(n, type(m)) for n, m in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        for slots in ("_parameters", "_buffers"):
            sx, sy = getattr(x, slots), getattr(y, slots)
            if sx.keys() != sy.keys():
                return False
            for k in sx:
                if (sx[k] is None) != (sy[k] is None) or (sx[k] is not None and sx[k].shape != sy[k].shape):
                    return False
        if x._non_persistent_buffers_set != y._non_persistent_buffers_set:
            return False
        if any(len(getattr(x, h)) > len(getattr(y, h)) for h in _HOOK_DICTS):
            return False
        tensors_x = {k for k, v in _own_attrs(x).items() if isinstance(v, torch.Tensor)}
        tensors_y = {k for k, v in _own_attrs(y).items() if isinstance(v, torch.Tensor)}
        if tensors_x or tensors_y:
            return False  # plain tensor attributes are not restored by construction
    return True


@dataclass
class _TreeWriter:
    """Builds the modules.json entries and the tensor table of one GraphModule."""

    gm: fx.GraphModule
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    key_of: dict[int, str] = field(default_factory=dict)
    slots: list[dict[str, Any]] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def tensor_key(self, t: torch.Tensor, suggested: str) -> str:
        key = self.key_of.get(id(t))
        if key is None:
            if t.is_meta:
                raise SerializationError(
                    f"cannot save tensor {suggested!r}: it is on the meta device (no data). Load the real "
                    f"weights into the prepared module first (gm.load_state_dict(..., assign=True))."
                )
            if t.layout != torch.strided or t.is_quantized:
                raise SerializationError(f"cannot save tensor {suggested!r}: {t.layout} / quantized tensors are not supported.")
            key = suggested
            while key in self.tensors:
                key += "_"
            self.key_of[id(t)] = key
            self.tensors[key] = t
        return key

    def write(self) -> None:
        self._paths_by_id: dict[int, list[str]] = {}
        for n, m in self.gm.named_modules(remove_duplicate=False):
            self._paths_by_id.setdefault(id(m), []).append(n)
        seen: dict[int, str] = {}
        owned: set[str] = set()
        for path, module in self.gm.named_modules(remove_duplicate=False):
            entry: dict[str, Any] = {"path": path, "training": module.training}
            if id(module) in seen:
                entry.update(kind="same_as", of=seen[id(module)])
                self.entries.append(entry)
                continue
            seen[id(module)] = path
            entry["class"] = class_name(type(module))
            self._record_slots(path, module)  # first, so tensors are keyed by their slot path
            if module is self.gm:
                entry["kind"] = "root"
                self._check_root_hooks()
            elif path in owned:
                entry["kind"] = "owned"
            else:
                entry.update(self._describe(path, module, owned))
            self.entries.append(entry)

    def _check_root_hooks(self) -> None:
        if any(getattr(self.gm, h) for h in _HOOK_DICTS):
            raise SerializationError("cannot save: the prepared module has forward/backward hooks, which have no saved form.")

    def _describe(self, path: str, module: nn.Module, owned: set[str]) -> dict[str, Any]:
        cls = type(module)
        where = f"module {path!r} ({class_name(cls)})"
        if isinstance(module, ops.BoundOp):
            enc = _Encoder(where)
            return {"kind": "bound_op", "fn": function_name(module.fn), "args": [enc(a) for a in module.args],
                    "kwargs": {k: enc(v) for k, v in module.kwargs.items()}}
        if any(getattr(module, h) for h in _HOOK_DICTS if not cls.__module__.startswith("torch.")):
            raise SerializationError(f"cannot save {where}: it has forward/backward hooks, which have no saved form.")
        if cls in _CONTAINERS:
            if _own_attrs(module):
                return self._state(path, module)
            return {"kind": "container"}
        if cls.__module__.startswith(("torch.nn.", "torch.ao.nn.")):
            described = self._init(path, module, owned)
            if described is not None:
                return described
        return self._state(path, module)

    def _init(self, path: str, module: nn.Module, owned: set[str]) -> dict[str, Any] | None:
        kwargs = init_kwargs(module)
        if kwargs is None:
            return None
        try:
            with torch.device("meta"):
                rebuilt = type(module)(**kwargs)
        except Exception:  # noqa: BLE001 - not reconstructible this way: fall back to "state"
            return None
        if not _structure_matches(module, rebuilt):
            return None
        # Everything the constructor creates below this module must not be shared with the outside.
        for m in module.modules():
            if any(not (n == path or n.startswith(path + ".")) for n in self._paths_by_id.get(id(m), [])):
                return None
        patches: dict[str, dict[str, Any]] = {}
        for (sub, x), (_, y) in zip(module.named_modules(remove_duplicate=False), rebuilt.named_modules(remove_duplicate=False)):
            ax, ay = _own_attrs(x), _own_attrs(y)
            if not ay.keys() <= ax.keys():
                return None
            # attributes set after construction (transformers' _is_hf_initialized) are patched in too
            diff = {k: v for k, v in ax.items() if k not in ay or not _same(v, ay[k])}
            if diff:
                try:
                    enc = _Encoder(f"attributes of {path}.{sub}")
                    patches[sub] = {k: enc(v) for k, v in diff.items()}
                except SerializationError:
                    return None
        for sub, _ in module.named_modules(remove_duplicate=False):
            if sub:
                owned.add(f"{path}.{sub}")
        enc = _Encoder(f"constructor of {path!r}")
        return {"kind": "init", "init": {k: enc(v) for k, v in kwargs.items()}, "patch": patches}

    def _state(self, path: str, module: nn.Module) -> dict[str, Any]:
        cls = type(module)
        where = f"module {path!r} of class {class_name(cls)}"
        if any(getattr(module, h) for h in (*_HOOK_DICTS, "_state_dict_hooks", "_load_state_dict_pre_hooks")):
            raise SerializationError(f"cannot save {where}: it has hooks, which have no saved form.")
        attrs = {}
        for k, v in _own_attrs(module).items():
            if k.startswith("__"):
                continue
            try:
                attrs[k] = _Encoder(f"{where}, attribute {k!r}", lambda t, k=k: self.tensor_key(t, f"{path}.{k}"))(v)
            except SerializationError as err:
                if cls.__module__ == "fxprep.capture.leaves":
                    hint = ("it is an opaque part of a model that could not be traced whole: it runs the original "
                            "Python code, which a saved directory does not contain. Save the original model "
                            "instead, or make that part traceable (fxprep check shows why it is not)")
                else:
                    hint = ("fxprep does not know its constructor, and saves such modules from their plain "
                            "attributes only. Let fxprep trace into it instead of keeping it as a leaf, or save "
                            "the original model")
                raise SerializationError(
                    f"cannot save {where}: attribute {k!r} holds a {type(v).__qualname__}, which has no safe "
                    f"saved form; {hint}."
                ) from err
        return {"kind": "state", "attrs": attrs}

    def _record_slots(self, path: str, module: nn.Module) -> None:
        for role, slots in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in slots.items():
                key = None if t is None else self.tensor_key(t, f"{path}.{name}" if path else name)
                slot = {"module": path, "name": name, "role": role, "key": key}
                if role == "parameter" and t is not None:
                    slot["requires_grad"] = bool(t.requires_grad)
                if role == "buffer":
                    slot["persistent"] = name not in module._non_persistent_buffers_set
                self.slots.append(slot)

    def constants(self) -> list[dict[str, Any]]:
        """Plain tensor attributes read by get_attr nodes (fx's ``_tensor_constant0``)."""
        out = []
        for node in self.gm.graph.nodes:
            if node.op != "get_attr":
                continue
            owner_path, _, name = str(node.target).rpartition(".")
            try:
                owner = self.gm.get_submodule(owner_path)
            except AttributeError as err:
                raise SerializationError(f"get_attr {node.target!r} points nowhere.") from err
            if name in owner._parameters or name in owner._buffers or name in owner._modules:
                continue
            value = getattr(owner, name, None)
            if not isinstance(value, torch.Tensor):
                raise SerializationError(
                    f"cannot save get_attr {node.target!r}: a {type(value).__qualname__} (nested graphs such as "
                    f"torch.cond branches, script objects) has no saved form yet."
                )
            out.append({"path": str(node.target), "key": self.tensor_key(value, str(node.target))})
        return out


# --- graph: save side ---------------------------------------------------------------------------
def _graph_json(gm: fx.GraphModule) -> dict[str, Any]:
    nodes = []
    for node in gm.graph.nodes:
        enc = _Encoder(f"node {node.name!r} ({node.op} {node.target})")
        if node.op == "call_function":
            target: Any = {"fn": function_name(node.target)}
        else:
            target = str(node.target)
        entry = {"name": node.name, "op": node.op, "target": target, "args": [enc(a) for a in node.args],
                 "kwargs": {k: enc(v) for k, v in node.kwargs.items()}}
        try:
            if node.type is not None and node.type in _TYPE_NAMES:
                entry["type"] = _TYPE_NAMES[node.type]
        except TypeError:  # unhashable annotation: left out (it only changes the printed code)
            pass
        nodes.append(entry)
    return {"class_name": type(gm).__name__, "nodes": nodes, "codegen": _codegen_json(gm.graph)}


def _codegen_json(graph: fx.Graph) -> dict[str, Any] | None:
    codegen = graph._codegen
    if type(codegen) is fx.graph.CodeGen:
        return None
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        info = codegen.pytree_info
        try:
            return {
                "kind": "pytree",
                "orig_args": list(info.orig_args),
                "in_spec": None if info.in_spec is None else pytree.treespec_dumps(info.in_spec),
                "out_spec": None if info.out_spec is None else pytree.treespec_dumps(info.out_spec),
            }
        except Exception as err:  # noqa: BLE001
            raise SerializationError(f"cannot save the module's calling convention (pytree spec): {err}") from err
    raise SerializationError(f"cannot save a graph with custom code generation {type(codegen).__qualname__}.")


# --- save --------------------------------------------------------------------------------------
def _dumps(data: dict[str, Any]) -> str:
    """JSON with one list item per line: compact, yet diffable and greppable."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            body = ",\n  ".join(json.dumps(v, allow_nan=False) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {body}\n ]" if value else f"{json.dumps(key)}: []")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _input_spec(example_inputs: Any) -> list[dict[str, Any]] | None:
    from .inputs import normalize_example_inputs

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


def _contiguous_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def save(gm: fx.GraphModule, directory: str | os.PathLike[str], *, example_inputs: Any = None) -> Path:
    """Write ``gm`` (a module returned by :func:`fxprep.prepare_model`) to ``directory``.

    Nothing is pickled: see the module docstring for the files. ``example_inputs`` (optional) is
    recorded in the manifest as the input spec. Raises :class:`SerializationError` at save time for
    anything that could not be loaded back (a leaf module with unknown constructor state, a function
    without an importable name, hooks), naming the module or node.
    """
    if not isinstance(gm, fx.GraphModule):
        raise SerializationError(f"fxprep.save expects a torch.fx.GraphModule, not {type(gm).__name__}.")
    from safetensors.torch import save_file

    from . import __version__

    graph = _graph_json(gm)
    writer = _TreeWriter(gm)
    writer.write()
    tree = {"modules": writer.entries, "tensors": writer.slots, "constants": writer.constants(),
            "aliases": state_dict_pass.aliases(gm)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GRAPH).write_text(_dumps(graph))
    (directory / MODULES).write_text(_dumps(tree))
    (directory / CODE).write_text(f"# Generated by torch.fx for {graph['class_name']}; for reading only (fxprep.load never runs it).\n{gm.code}")
    try:
        save_file(_contiguous_unshared(writer.tensors), str(directory / WEIGHTS), metadata={"format": FORMAT})
    except Exception as err:  # noqa: BLE001
        raise SerializationError(f"cannot write {WEIGHTS}: {err}") from err
    report = getattr(gm, "fxprep_report", None)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fxprep_version": __version__,
        "torch_version": torch.__version__,
        "class_name": graph["class_name"],
        "inputs": _input_spec(example_inputs),
        "inputs_text": getattr(report, "inputs", ""),
        "devices": sorted({str(t.device) for t in writer.tensors.values()}),
        "report": report.to_dict() if report is not None and hasattr(report, "to_dict") else None,
        "sha256": {name: _sha256(directory / name) for name in CHECKED_FILES},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return directory


# --- load --------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise SerializationError(f"{path} is missing: not an fxprep save directory (fxprep.save writes it).") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SerializationError(f"{path} is not valid JSON ({err}); the file is damaged.") from err


def _check_manifest(directory: Path, check_integrity: bool) -> dict[str, Any]:
    manifest = _read_json(directory / MANIFEST)
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
            if _sha256(path) != sums.get(name):
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


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(directory / WEIGHTS), framework="pt", device="cpu") as f:
            # One tensor at a time, so a misaligned one is copied while only it is in memory twice.
            return {key: _aligned(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise SerializationError(f"cannot read {directory / WEIGHTS}: {err}") from err


def _is_atom(name: Any) -> bool:
    """A name nn.Module accepts for a child, parameter or buffer: a non-empty string without dots."""
    return isinstance(name, str) and bool(name) and "." not in name


def _field(entry: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
        raise SerializationError(f"malformed entry in {MODULES}: {str(entry)[:120]} (field {key!r})")
    return entry[key]


def _set_attrs(module: nn.Module, attrs: dict[str, Any], decode: _Decoder) -> None:
    """Plain attributes (private ones included: ``_reversed_padding_repeated_twice``); never a dunder,
    never nn.Module's own bookkeeping, and values are only what the decoder can build."""
    for k, v in attrs.items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("__"):
            raise SerializationError(f"refusing to load: attribute name {k!r} of {type(module).__name__}.")
        if k in _MODULE_INTERNALS:
            raise SerializationError(f"refusing to overwrite nn.Module internal {k!r}.")
        object.__setattr__(module, k, decode(v))


def _build_modules(tree: dict[str, Any], decode: _Decoder, policy: TrustPolicy) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {}
    for entry in _field(tree, "modules", list):
        path = _field(entry, "path", str)
        kind = _field(entry, "kind", str)
        if path in modules or (path == "") != (kind == "root"):
            raise SerializationError(f"malformed module tree in {MODULES} at {path!r}.")
        parent_path, _, atom = path.rpartition(".")
        if path and (parent_path not in modules or not atom or "." in atom):
            raise SerializationError(f"module {path!r} in {MODULES} has no parent entry before it.")
        if kind == "same_as":
            of = _field(entry, "of", str)
            if of not in modules:
                raise SerializationError(f"module {path!r} refers to unknown module {of!r}.")
            module = modules[of]
        elif kind == "owned":
            module = modules[parent_path]._modules.get(atom)  # type: ignore[assignment]
            expected = _field(entry, "class", str)
            if module is None or class_name(type(module)) != expected:
                raise SerializationError(
                    f"module {path!r}: the parent's constructor did not create a {expected} there "
                    f"(saved with another torch version?)."
                )
        elif kind == "root":
            module = nn.Module()
        else:
            module = _build_one(entry, kind, decode, policy)
        module.training = bool(entry.get("training", False))
        if path and kind != "owned":
            modules[parent_path]._modules[atom] = module
        modules[path] = module
    return modules


def _build_one(entry: dict[str, Any], kind: str, decode: _Decoder, policy: TrustPolicy) -> nn.Module:
    name = _field(entry, "class", str)
    cls = load_class(name, policy)
    path = entry["path"]
    if kind == "container":
        if cls not in _CONTAINERS:
            raise SerializationError(f"module {path!r}: {name} is not a plain container class.")
        return cls()
    if kind == "bound_op":
        if not issubclass(cls, ops.BoundOp):
            raise SerializationError(f"module {path!r}: {name} is not an fxprep.ops.BoundOp.")
        fn = load_function(_field(entry, "fn", str), policy)
        args, kwargs = _call_args(entry, decode, f"module {path!r}")
        if fn is builtins.getattr and len(args) >= 2:
            check_member(args[1], "attribute")
        return cls(fn, args, kwargs)
    if kind == "init":
        kwargs = {k: decode(v) for k, v in _field(entry, "init", dict).items()}
        if not all(k.isidentifier() for k in kwargs):
            raise SerializationError(f"module {path!r}: malformed constructor arguments.")
        try:
            with torch.device("meta"):
                module = cls(**kwargs)
        except Exception as err:  # noqa: BLE001
            raise SerializationError(f"module {path!r}: {name}(**{kwargs}) failed: {err}") from err
        for sub, attrs in _field(entry, "patch", dict).items():
            try:
                target = module.get_submodule(sub)
            except AttributeError as err:
                raise SerializationError(f"module {path!r}: no submodule {sub!r} to patch.") from err
            _set_attrs(target, _field({"a": attrs}, "a", dict), decode)
        return module
    if kind == "state":
        _field(entry, "attrs", dict)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        return module  # attributes are set once the tensors they may refer to exist
    raise SerializationError(f"module {path!r}: unknown kind {kind!r} in {MODULES}.")


def _assign_tensors(tree: dict[str, Any], modules: dict[str, nn.Module], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put every saved tensor in its slot(s); one object per key, so tied weights stay tied.
    Returns key → the object now in the tree."""
    objects: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def tensor(key: str, parameter: bool, requires_grad: bool) -> torch.Tensor:
        if key not in weights:
            raise SerializationError(f"tensor {key!r} is missing from {WEIGHTS}.")
        used.add(key)
        obj = objects.get(key)
        if obj is None:
            obj = nn.Parameter(weights[key], requires_grad=requires_grad) if parameter else weights[key]
            objects[key] = obj
        elif isinstance(obj, nn.Parameter) != parameter:
            raise SerializationError(f"tensor {key!r} is used both as a parameter and as a buffer.")
        return obj

    for slot in _field(tree, "tensors", list):
        path = _field(slot, "module", str)
        name = _field(slot, "name", str)
        role = _field(slot, "role", str)
        module = modules.get(path)
        if module is None or role not in ("parameter", "buffer") or not _is_atom(name):
            raise SerializationError(f"malformed tensor slot in {MODULES}: {str(slot)[:120]}")
        key = slot.get("key")
        slots = module._parameters if role == "parameter" else module._buffers
        if key is None:
            if name in slots and slots[name] is not None:
                raise SerializationError(f"{path}.{name} was saved as None but the constructor created it.")
            slots[name] = None
            continue
        value = tensor(str(key), role == "parameter", bool(slot.get("requires_grad", True)))
        existing = slots.get(name)
        if existing is not None and existing.shape != value.shape:
            raise SerializationError(
                f"{path}.{name}: saved shape {tuple(value.shape)} does not fit the module, which expects "
                f"{tuple(existing.shape)}; {WEIGHTS} does not belong to this module tree."
            )
        if name in slots:
            setattr(module, name, value)  # keeps subclasses' bookkeeping (RNN flat weights) in step
        elif role == "parameter":
            module.register_parameter(name, value)  # type: ignore[arg-type]
        else:
            module.register_buffer(name, value)
        if role == "buffer":
            if slot.get("persistent", True):
                module._non_persistent_buffers_set.discard(name)
            else:
                module._non_persistent_buffers_set.add(name)
    for c in _field(tree, "constants", list):
        target = _field(c, "path", str)
        owner_path, _, name = target.rpartition(".")
        if not _is_atom(name) or name.startswith("__"):
            raise SerializationError(f"bad constant name {target!r} in {MODULES}.")
        if owner_path not in modules:
            raise SerializationError(f"constant {target!r} has no owner module.")
        key = _field(c, "key", str)
        setattr(modules[owner_path], name, objects.get(key, weights.get(key)))
        if key not in weights:
            raise SerializationError(f"tensor {key!r} is missing from {WEIGHTS}.")
        used.add(key)
    unused = set(weights) - used - _attr_keys(tree)
    if unused:
        raise SerializationError(f"{WEIGHTS} holds tensors no module uses ({sorted(unused)[:5]}): files do not belong together.")
    return {**weights, **objects}


def _attr_keys(tree: dict[str, Any]) -> set[str]:
    keys: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if v.get("$") == "tensor":
                keys.add(str(v.get("v")))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for entry in tree.get("modules", []):
        walk(entry.get("attrs"))
    return keys


def _check_no_meta(root: nn.Module) -> None:
    for path, module in root.named_modules():
        for name, t in [*module._parameters.items(), *module._buffers.items(), *_own_attrs(module).items()]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise SerializationError(
                    f"{path or 'root'}.{name} ({type(module).__name__}) has no saved value: its constructor "
                    f"creates a tensor fxprep did not save. Please report this with the module class."
                )


def _build_graph(graph_json: dict[str, Any], root: nn.Module, decode: _Decoder, policy: TrustPolicy) -> fx.Graph:
    graph = fx.Graph()
    for entry in _field(graph_json, "nodes", list):
        name = _field(entry, "name", str)
        op = _field(entry, "op", str)
        if not name.isidentifier() or name in decode.nodes:
            raise SerializationError(f"bad node name {name!r} in {GRAPH}.")
        target: Any = entry.get("target")
        if op == "call_function":
            target = load_function(_field(target, "fn", str) if isinstance(target, dict) else "", policy)
        elif op in ("call_module", "get_attr"):
            if not isinstance(target, str):
                raise SerializationError(f"node {name!r}: malformed target.")
            # any module name nn.Module accepts ("block1-0" in regnet); only the tree is searched
            if not all(_is_atom(part) and not part.startswith("__") for part in target.split(".")):
                raise SerializationError(f"node {name!r}: malformed {op} target {target!r}.")
            try:
                (root.get_submodule if op == "call_module" else _get_attr_checker(root))(target)
            except AttributeError as err:
                raise SerializationError(f"node {name!r}: {op} target {target!r} does not exist in the module tree.") from err
        elif op == "call_method":
            check_member(target, "method")
        elif op in ("placeholder", "output"):
            if not isinstance(target, str) or (op == "placeholder" and not target.lstrip("*").isidentifier()):
                raise SerializationError(f"node {name!r}: malformed target.")
        else:
            raise SerializationError(f"node {name!r}: unknown op {op!r}.")
        args, kwargs = _call_args(entry, decode, f"node {name!r}")
        if op == "call_function" and target is builtins.getattr and len(args) >= 2:
            check_member(args[1], "attribute")
        type_expr = _TYPES.get(entry["type"]) if isinstance(entry.get("type"), str) else None
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise SerializationError(f"node name {name!r} cannot be reproduced (got {node.name!r}).")
        decode.nodes[name] = node
    codegen = graph_json.get("codegen")
    if codegen is not None:
        graph._codegen = _pytree_codegen(codegen)
    try:
        graph.lint()
    except Exception as err:  # noqa: BLE001
        raise SerializationError(f"{GRAPH} does not describe a valid graph: {err}") from err
    return graph


def _call_args(entry: dict[str, Any], decode: _Decoder, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = entry.get("args", []), entry.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(k.isidentifier() for k in kwargs):
        raise SerializationError(f"{where}: malformed args/kwargs in saved file.")
    return tuple(decode(a) for a in args), {k: decode(v) for k, v in kwargs.items()}


def _get_attr_checker(root: nn.Module) -> Callable[[str], Any]:
    def check(target: str) -> Any:
        owner_path, _, name = target.rpartition(".")
        owner = root.get_submodule(owner_path)
        if name not in owner._parameters and name not in owner._buffers and name not in owner._modules \
                and not isinstance(owner.__dict__.get(name), torch.Tensor):
            raise AttributeError(target)
        return owner
    return check


# Modules that only define output containers (registered with pytree when imported).
_CONTAINER_MODULES = ("transformers.modeling_outputs", "collections")


def _import_pytree_types(spec: dict[str, Any]) -> None:
    """Import the modules that register the calling convention's container types (a transformers
    ``ModelOutput``), so a fresh process can load the module; only known container modules."""
    names: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if isinstance(v.get("type"), str):
                names.add(v["type"])
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for key in ("in_spec", "out_spec"):
        if isinstance(spec.get(key), str):
            try:
                walk(json.loads(spec[key]))
            except json.JSONDecodeError:
                continue
    for name in names:
        module = name.rpartition(".")[0]
        if module in _CONTAINER_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:
                pass


def _pytree_codegen(spec: Any) -> fx.graph.CodeGen:
    if not isinstance(spec, dict) or spec.get("kind") != "pytree":
        raise SerializationError(f"unknown calling convention in {GRAPH}: {str(spec)[:80]}")
    orig_args = spec.get("orig_args")
    if not isinstance(orig_args, list) or not all(isinstance(a, str) and a.isidentifier() for a in orig_args):
        raise SerializationError(f"malformed argument names in {GRAPH}.")
    _import_pytree_types(spec)
    try:
        in_spec = None if spec.get("in_spec") is None else pytree.treespec_loads(spec["in_spec"])
        out_spec = None if spec.get("out_spec") is None else pytree.treespec_loads(spec["out_spec"])
    except Exception as err:  # noqa: BLE001
        raise SerializationError(
            f"cannot read the calling convention (pytree spec) in {GRAPH}: {err}. If it names a container "
            f"type from a library (transformers ModelOutput), import that library before fxprep.load."
        ) from err
    return fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(orig_args, in_spec, out_spec))


def _report_from_dict(data: Any, directory: Path) -> Any:
    from .capture.common import CaptureAttempt
    from .report import AddedModule, LeftFunctional, Report, Unrolled, Verification

    if not isinstance(data, dict):
        report = Report("unknown")
    else:
        try:
            report = Report(
                str(data.get("model", "unknown")),
                tracer=data.get("tracer"),
                attempts=[CaptureAttempt(a["tracer"], bool(a["ok"]), float(a["seconds"]), a.get("error"), a.get("error_type"))
                          for a in data.get("attempts", [])],
                added=[AddedModule(**a) for a in data.get("added", [])],
                left=[LeftFunctional(**x) for x in data.get("left_functional", [])],
                unrolled=[Unrolled(**u) for u in data.get("unrolled", [])],
                leaves=dict(data.get("leaves", {})),
                notes=list(data.get("notes", [])),
                issues=list(data.get("issues", [])),
                verification=Verification(**data.get("verification", {"status": "skipped"})),
                timings=dict(data.get("timings", {})),
                inputs=str(data.get("inputs", "")),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise SerializationError(f"the report in {MANIFEST} is malformed: {err}") from err
    report.note(f"loaded from {directory} (fxprep.load)")
    return report


def load(
    directory: str | os.PathLike[str],
    *,
    trusted_modules: Iterable[str] = (),
    check_integrity: bool = True,
) -> fx.GraphModule:
    """Rebuild a module written by :func:`save`, without the original source and without unpickling.

    ``trusted_modules``: extra module prefixes whose classes and functions the saved graph may use
    (for leaves or wrapped functions from your own package, timm or transformers). ``check_integrity``
    compares each file with the checksum in the manifest. Every problem, tampering included, is a
    :class:`SerializationError` that says what was refused.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SerializationError(f"{directory} is not a directory written by fxprep.save.")
    policy = TrustPolicy(tuple(trusted_modules))
    manifest = _check_manifest(directory, check_integrity)
    graph_json = _read_json(directory / GRAPH)
    tree = _read_json(directory / MODULES)
    if not isinstance(graph_json, dict) or not isinstance(tree, dict):
        raise SerializationError(f"{directory}: {GRAPH} / {MODULES} are malformed.")
    weights = _load_weights(directory)
    modules = _build_modules(tree, _Decoder(policy), policy)
    live = _assign_tensors(tree, modules, weights)
    # Attributes of "state" modules may refer to tensors (RNN flat weights): restore them now.
    state_decode = _Decoder(policy, tensors=live)
    for entry in tree["modules"]:
        if entry.get("kind") == "state":
            _set_attrs(modules[entry["path"]], entry["attrs"], state_decode)
    root = modules[""]
    _check_no_meta(root)
    graph = _build_graph(graph_json, root, _Decoder(policy), policy)
    class_name_ = str(graph_json.get("class_name", "GraphModule"))
    if not class_name_.isidentifier():
        raise SerializationError(f"bad class name {class_name_!r} in {GRAPH}.")
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name_)
    for attr in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        setattr(gm, attr, getattr(root, attr))
    for k, v in _own_attrs(root).items():
        object.__setattr__(gm, k, v)
    gm.training = root.training
    gm.graph = graph
    gm.recompile()
    aliases = tree.get("aliases") or {}
    if aliases:
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise SerializationError(f"malformed aliases in {MODULES}.")
        setattr(gm, state_dict_pass.ALIASES_ATTR, dict(aliases))
        gm.register_state_dict_post_hook(state_dict_pass._drop_aliases)
        gm.register_load_state_dict_pre_hook(state_dict_pass._fill_aliases)
    gm.fxprep_report = _report_from_dict(manifest.get("report"), directory)  # type: ignore[assignment]
    return gm


# --- reading without loading ------------------------------------------------------------------------
def _node_refs(value: Any) -> list[str]:
    refs: list[str] = []
    if isinstance(value, dict):
        if value.get("$") == "node":
            return [str(value.get("v"))]
        for x in value.values():
            refs += _node_refs(x)
    elif isinstance(value, list):
        for x in value:
            refs += _node_refs(x)
    return refs


def inspect_saved(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What a saved directory holds, read from its JSON files only (nothing imported, nothing run):
    manifest, class name, and one row per node with its inputs and, for modules, their class."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SerializationError(f"{directory} is not a directory written by fxprep.save.")
    manifest = _check_manifest(directory, check_integrity=False)
    graph_json = _read_json(directory / GRAPH)
    tree = _read_json(directory / MODULES)
    classes = {}
    for entry in tree.get("modules", []) if isinstance(tree, dict) else []:
        if isinstance(entry, dict):
            classes[entry.get("path")] = str(entry.get("class", "")).rpartition(".")[2] or entry.get("kind")
            if entry.get("kind") == "bound_op":
                classes[entry.get("path")] += f"({entry.get('fn')})"
    rows = []
    for node in _field(graph_json, "nodes", list):
        op, target = node.get("op"), node.get("target")
        if op == "call_module":
            what = f"{target}: {classes.get(target, '?')}"
        elif op == "call_function" and isinstance(target, dict):
            what = str(target.get("fn"))
        elif op == "call_method":
            what = f"Tensor.{target}"
        else:
            what = str(target)
        rows.append({"name": node.get("name"), "op": op, "what": what,
                     "inputs": _node_refs([node.get("args"), node.get("kwargs")])})
    return {"class_name": graph_json.get("class_name"), "manifest": manifest, "nodes": rows}
