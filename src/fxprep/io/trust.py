"""What a saved file may name: the trust policy of :func:`fxprep.load`.

A saved directory comes from someone else. Every class and function it names is checked here before
anything is imported or called: classes must be ``nn.Module`` subclasses from a trusted module;
functions must be tensor ops from torch's operator namespaces, ``math``, ``operator`` (minus the
getter factories), a short list of builtins, or a module the caller trusts explicitly; attribute and
method names starting with ``_`` (the way from a tensor to ``__globals__``) are refused, apart from
the Tensor operator dunders. A file that asks for anything else raises
:class:`~fxprep.errors.SerializationError` naming what it asked for.
"""

from __future__ import annotations

import importlib
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import ops
from ..errors import SerializationError

DEFAULT_TRUSTED_CLASSES = ("torch.nn.", "torch.ao.nn.", "fxprep.", "torchvision.ops.", "torchvision.models.")
DEFAULT_TRUSTED_FUNCTIONS = ("torchvision.ops.", "fxprep.cond.cond")


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
