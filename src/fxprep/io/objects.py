"""Opaque parts of a hybrid capture, and the plain objects they hold, saved by the name of their code.

A save holds no code, so an opaque part (:class:`~fxprep.capture.leaves.OpaqueMethod`,
``OpaqueFunction``) is written as the importable name of its code plus its owner's state, and only
when that code lives in a package the caller lists in ``trusted_modules``. Value tags added here:
``"object"``, ``"ref"`` and ``"module"``.

See docs/delivery.md ("Under the hood") and docs/security.md.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import SerializationError
from .allowlist import canonical_name
from .format import HOOK_DICTS, MODULE_INTERNALS, own_attrs, training_flag
from .trust import TrustPolicy, check_attribute, is_default_module_class


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def bare_instance(cls: type[object]) -> Any:
    """An instance made by ``cls.__new__`` alone: its ``__init__`` does not run."""
    return cls.__new__(cls)


def trust_hint(code: str, policy: TrustPolicy) -> str:
    """Why code of an untrusted package cannot be saved by name, and what to do."""
    package = code.split(".")[0]
    if policy.package_of(code) is not None:  # trusted, and still not found there by its own name
        return (
            f"{code} is not what that name resolves to inside {package!r}, which you trust (an object of "
            f"another kind stands there, or the code was defined elsewhere and assigned to it), so a load could "
            f"not find it by name. Save the original model instead, or make that part traceable (fxprep check "
            f"shows why it is not)."
        )
    listed = f" (trusted_modules={list(policy.modules)} does not include it)" if policy.modules else ""
    return (
        f"a saved directory holds no code, so loading it means importing {package}'s code by name, which fxprep "
        f"does only for packages you trust{listed}. If you trust {package!r}, pass trusted_modules=[{package!r}] "
        f"to fxprep.save and to fxprep.load. Save the original model instead if you do not, or make that part "
        f"traceable (fxprep check shows why it is not)."
    )


def method_function(cls: type, method: str) -> Any:
    """The plain function ``cls.<method>`` runs (found without running attribute hooks), or None."""
    fn = inspect.getattr_static(cls, method, None)
    return fn if isinstance(fn, types.FunctionType) else None


@dataclass
class ObjectWriter:
    """Writes owners and helper objects as ``"object"`` values. ``paths``: id(module) → its path in
    the saved tree; ``tensor_key``: the tree's tensor table; ``policy``: the packages trusted at save."""

    policy: TrustPolicy
    paths: dict[int, str]
    tensor_key: Callable[[torch.Tensor, str], str]
    encoder: Callable[..., Any]  # encode.Encoder, passed in to keep the import one way
    ids: dict[int, int] = field(default_factory=dict)
    _open: set[int] = field(default_factory=set)

    def encode(self, obj: Any, where: str) -> dict[str, Any]:
        """``obj`` as an ``"object"`` value; ``where`` is its dotted path (``post.owner.helper``),
        used in messages and to name its tensors in the weights file."""
        if isinstance(obj, nn.Module) and id(obj) in self.paths:
            return {"$": "module", "v": self.paths[id(obj)]}
        if id(obj) in self.ids:
            if id(obj) in self._open:
                raise SerializationError(f"cannot save {where}: a {type(obj).__qualname__} refers back to itself.")
            return {"$": "ref", "v": self.ids[id(obj)]}
        cls = type(obj)
        name = class_name(cls)
        if not (isinstance(obj, nn.Module) and is_default_module_class(cls)):
            package = self.policy.package_of(cls.__module__)
            if package is None or not self.policy.trusted_code(cls):
                raise SerializationError(f"cannot save {where}: it holds a {name}, and " + trust_hint(name, self.policy))
        self.ids[id(obj)] = len(self.ids)
        self._open.add(id(obj))
        try:
            entry: dict[str, Any] = {"$": "object", "id": self.ids[id(obj)], "class": name}
            attrs = own_attrs(obj) if isinstance(obj, nn.Module) else dict(vars(obj))
            entry["attrs"] = {k: self._attr(cls, k, v, f"{where}.{k}") for k, v in attrs.items()}
            if isinstance(obj, nn.Module):
                entry.update(self._module_parts(obj, where))
        finally:
            self._open.discard(id(obj))
        return entry

    def _attr(self, cls: type, name: str, value: Any, where: str) -> Any:
        try:
            check_attribute(cls, name)
        except SerializationError as err:
            raise SerializationError(f"cannot save {where}: it could not be loaded back ({err}).") from err
        return self.encoder(where, lambda t: self.tensor_key(t, where), lambda obj, _: self.encode(obj, where))(value)

    def _module_parts(self, module: nn.Module, where: str) -> dict[str, Any]:
        if any(getattr(module, h) for h in HOOK_DICTS):
            raise SerializationError(f"cannot save {where}: it has forward/backward hooks, which have no saved form.")
        params = {n: None if p is None else [self.tensor_key(p, f"{where}.{n}"), bool(p.requires_grad)]
                  for n, p in module._parameters.items()}
        buffers = {n: None if b is None else self.tensor_key(b, f"{where}.{n}") for n, b in module._buffers.items()}
        children = {n: None if c is None else self.encode(c, f"{where}.{n}") for n, c in module._modules.items()}
        return {"training": module.training, "parameters": params, "buffers": buffers,
                "non_persistent": sorted(module._non_persistent_buffers_set), "children": children}


@dataclass
class ObjectReader:
    """Rebuilds ``"object"``/``"ref"``/``"module"`` values: classes only through the policy, each
    object created without running its constructor, attributes restored under the same rules as
    module attributes, tensors taken from the tree's table (so they stay shared)."""

    policy: TrustPolicy
    modules: dict[str, nn.Module]
    tensors: dict[str, torch.Tensor]
    made: dict[int, Any] = field(default_factory=dict)
    _building: set[int] = field(default_factory=set)

    def module(self, path: Any) -> nn.Module:
        if not isinstance(path, str) or path not in self.modules:
            raise SerializationError(f"a saved object refers to module {str(path)[:80]!r}, which is not in the tree.")
        return self.modules[path]

    def ref(self, n: Any) -> Any:
        if not isinstance(n, int) or n not in self.made or n in self._building:
            raise SerializationError(f"a saved object refers to object {str(n)[:20]} before it is complete.")
        return self.made[n]

    def build(self, entry: dict[str, Any], decode: Callable[[Any], Any]) -> Any:
        n, attrs = entry.get("id"), entry.get("attrs")
        if not isinstance(n, int) or n in self.made or not isinstance(attrs, dict):
            raise SerializationError(f"malformed saved object: {str(entry)[:120]}")
        cls = self.policy.object_class(entry.get("class"))
        try:
            obj = bare_instance(cls)
        except Exception as err:  # noqa: BLE001 - any class that cannot be created bare
            raise SerializationError(f"cannot rebuild a {class_name(cls)} from its attributes: {err}") from err
        if isinstance(obj, nn.Module):
            nn.Module.__init__(obj)
        elif not hasattr(obj, "__dict__"):
            raise SerializationError(f"cannot rebuild a {class_name(cls)}: it keeps no attribute dict.")
        self.made[n] = obj
        self._building.add(n)
        if isinstance(obj, nn.Module):
            self._module_parts(obj, entry, decode)
        for k, v in attrs.items():
            check_attribute(cls, k)
            object.__setattr__(obj, k, decode(v))
        self._building.discard(n)
        return obj

    def _module_parts(self, module: nn.Module, entry: dict[str, Any], decode: Callable[[Any], Any]) -> None:
        cls = type(module)
        module.training = training_flag(entry)
        for field_name in ("parameters", "buffers", "children"):
            if not isinstance(entry.get(field_name), dict):
                raise SerializationError(f"malformed saved {class_name(cls)}: {field_name!r} missing.")
        for name, slot in entry["parameters"].items():
            check_attribute(cls, name, "tensor slot (parameter)")
            module._parameters[name] = None if slot is None else self._parameter(slot)
        for name, key in entry["buffers"].items():
            check_attribute(cls, name, "tensor slot (buffer)")
            module._buffers[name] = None if key is None else self._tensor(key, parameter=False)
        non_persistent = entry.get("non_persistent", [])
        if not isinstance(non_persistent, list) or not set(non_persistent) <= set(entry["buffers"]):
            raise SerializationError(f"malformed saved {class_name(cls)}: non-persistent buffers.")
        module._non_persistent_buffers_set.update(non_persistent)
        for name, child in entry["children"].items():
            if not isinstance(name, str) or not name or "." in name or name.startswith("__") or name in MODULE_INTERNALS:
                raise SerializationError(f"refusing to load: child module name {str(name)[:80]!r}.")
            value = None if child is None else decode(child)
            if value is not None and not isinstance(value, nn.Module):
                raise SerializationError(f"malformed saved {class_name(cls)}: child {name!r} is not a module.")
            module._modules[name] = value

    def _parameter(self, slot: Any) -> nn.Parameter:
        if not (isinstance(slot, list) and len(slot) == 2 and isinstance(slot[1], bool)):
            raise SerializationError(f"malformed saved parameter {str(slot)[:80]}.")
        t = self._tensor(slot[0], parameter=True)
        if isinstance(t, nn.Parameter):
            return t
        try:
            p = nn.Parameter(t, requires_grad=slot[1])
        except RuntimeError as err:
            raise SerializationError(f"tensor {slot[0]!r} cannot be a parameter: {err}") from err
        self.tensors[slot[0]] = p
        return p

    def _tensor(self, key: Any, parameter: bool) -> torch.Tensor:
        t = self.tensors.get(key) if isinstance(key, str) else None
        if t is None:
            raise SerializationError(f"a saved object refers to tensor {str(key)[:80]!r}, which is not in the weights.")
        if not parameter and isinstance(t, nn.Parameter):
            raise SerializationError(f"tensor {key!r} is used both as a parameter and as a buffer.")
        return t


def opaque_code_name(module: nn.Module) -> tuple[str, Any] | None:
    """For an opaque part: (what it runs, the function object) — ``Owner.method`` / ``module.fn``."""
    from ..capture.leaves import OpaqueFunction, OpaqueMethod

    if isinstance(module, OpaqueMethod):
        owner = module.__dict__.get("owner")
        fn = method_function(type(owner), module.method)
        return f"{class_name(type(owner))}.{module.method}", fn
    if isinstance(module, OpaqueFunction):
        return str(canonical_name(module.fn) or repr(module.fn)), module.fn
    return None
