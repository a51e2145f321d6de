"""What a saved file may name: the trust policy of :func:`fxprep.load`.

Trust rests on identity, never on how a name looks: a name is a key in the allow-list's table of
objects (:mod:`.allowlist`), or, inside a package listed in ``trusted_modules``, an object that
names itself exactly so and is defined there. Saved attributes may not replace methods or
descriptors, ``getattr`` may not fetch a method, and ``call_method`` calls only Tensor methods.
Anything else raises :class:`~fxprep.errors.SerializationError` saying what would allow it.

See docs/security.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import re
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import ops
from ..errors import InvalidInput, SerializationError
from ..ops import autograd_function_caller
from . import allowlist
from .allowlist import canonical_name

_MISSING = object()
_DEFAULT_CLASS_PACKAGES = ("torch.nn.modules.", "torch.ao.nn.", "fxprep.ops.", "torchvision.ops.")

# Dunder methods a graph may call on tensors (operator overloads), nothing else starting with "__".
_DUNDER_OK = frozenset(
    n for n in dir(torch.Tensor)
    if n.startswith("__") and n.endswith("__") and n.strip("_") in {
        *(m.strip("_") for m in dir(operator) if m.startswith("__")), "getitem", "setitem", "len", "radd", "rsub",
        "rmul", "rtruediv", "rfloordiv", "rpow", "rmatmul", "rand", "ror", "rxor", "rlshift", "rrshift", "rmod",
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow", "iand", "ior", "ixor",
    }
)

# Read-only container methods a graph may call besides Tensor methods (``outputs.keys()``).
_CONTAINER_METHODS = frozenset({"keys", "values", "items", "get", "index", "count"})

# Types whose methods ``getattr`` may not fetch from a graph value: a bound method is code, and an
# allow-listed function taking a callable (``max(key=...)``, ``torch._check(msg)``) would call it.
_RECEIVER_TYPES: tuple[type, ...] = (
    object, torch.Tensor, torch.UntypedStorage, torch.TypedStorage, str, bytes, bytearray, list, tuple, dict, set,
    frozenset, int, float, complex, nn.Module, torch.Size, torch.dtype, torch.device, torch.utils.hooks.RemovableHandle,
)
# Fields of torch's named-tuple results (``x.max(dim=1).values``) that share a name with a method.
_DATA_FIELDS = frozenset({"values", "indices"})


def _is_code(static: Any) -> bool:
    """A class attribute that is code or computes on access (method, property, descriptor)."""
    return callable(static) or hasattr(type(static), "__get__") or hasattr(type(static), "__set__")


@functools.cache
def _method_names() -> frozenset[str]:
    names = set()
    receivers = list(_RECEIVER_TYPES)
    try:  # Tensor.numpy() gives an ndarray, whose tofile / dump write files
        import numpy as np

        receivers += [np.ndarray, np.generic]
    except ImportError:
        pass
    for cls in receivers:
        for name in dir(cls):
            if _is_code(inspect.getattr_static(cls, name, None)):
                names.add(name)
    # getset descriptors of torch.Tensor (shape, dtype, T, grad_fn) are data, not methods
    return frozenset(n for n in names if not isinstance(inspect.getattr_static(torch.Tensor, n, None),
                                                        types.GetSetDescriptorType))


def check_member(name: Any, what: str, allowed: Iterable[str] = ()) -> None:
    """A method name a ``call_method`` node (or a ``Tensor.<name>`` op) may call: a listed Tensor
    method (:mod:`.reviewed`), one the caller allowed (``allowed``: the ``Tensor.<name>`` entries of
    ``allow=``) or an operator dunder, or a read-only container method."""
    if not isinstance(name, str) or not name.isidentifier() or (name.startswith("_") and name not in _DUNDER_OK):
        raise SerializationError(f"refusing to load: {what} {name!r} is private; a saved graph never needs it.")
    if name in _CONTAINER_METHODS or name in _DUNDER_OK:
        return
    if not callable(inspect.getattr_static(torch.Tensor, name, None)):
        raise SerializationError(f"refusing to load: {what} {name!r} is not a Tensor method.")
    if name in allowlist.methods() or (f"Tensor.{name}" in allowed and name in allowlist.candidate_methods()):
        return
    if name in allowlist.candidate_methods():
        raise SerializationError(
            f"refusing to load: {what} {name!r} is not on fxprep's default list (fxprep.io.reviewed: what prepared "
            f"graphs of fxprep's suites and zoos call). {_ALLOW_HINT.format(name=f'Tensor.{name}')}")
    raise SerializationError(
        f"refusing to load: {what} {name!r} is never allowed (raw memory, hooks, autograd or I/O: "
        f"fxprep.io.reviewed.EXCLUDED_METHODS).")


_ALLOW_HINT = ("If you trust the file, pass allow=[{name!r}] to fxprep.load (and to fxprep.save when you write such "
               "files; docs/security.md, 'Widening the list').")


def check_getattr(name: Any) -> None:
    """An attribute name a graph's ``getattr`` may read: public data (``shape``, ``dtype``, a named
    tuple's or ModelOutput's field), never a method: a bound method is code the graph could pass on."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise SerializationError(f"refusing to load: attribute {name!r} is private (or not a literal name); "
                                 f"a saved graph never needs it.")
    if name in _method_names() and name not in _DATA_FIELDS:
        raise SerializationError(f"refusing to load: getattr(..., {name!r}) fetches a method, not data; a saved "
                                 f"graph never needs it.")


# What fx writes a non-identifier name into: ``getattr(self, "block1-0")`` in the generated forward,
# which fx then executes. A quote, backslash or line break in a saved name would be code.
ATOM = re.compile(r'[^"\\\x00-\x1f\x7f.]{1,200}')


def is_atom(name: Any) -> bool:
    """A name for a child, parameter or buffer: what nn.Module accepts (no dots, not empty), less
    anything that could end a string literal in the code fx generates from it."""
    return isinstance(name, str) and ATOM.fullmatch(name) is not None


def check_attribute(cls: type, name: Any, what: str = "attribute") -> None:
    """A name a save may set on an instance of ``cls`` (an attribute, tensor slot or constant): an
    identifier (or, for tensor slots, a name like ParameterList's ``"0"``), not a dunder, not
    nn.Module's bookkeeping, and not something the class defines as code (``forward``, any method,
    property or descriptor): a saved value may not replace behaviour."""
    from .format import MODULE_INTERNALS

    named = isinstance(name, str) and (name.isidentifier() or (what.startswith("tensor") and is_atom(name)))
    if not named or name.startswith("__"):
        raise SerializationError(f"refusing to load: {what} name {str(name)[:80]!r} of {cls.__name__}.")
    if name in MODULE_INTERNALS:
        raise SerializationError(f"refusing to load: {what} {name!r} would overwrite nn.Module internals of {cls.__name__}.")
    if _is_code(inspect.getattr_static(cls, name, None)):
        raise SerializationError(
            f"refusing to load: {what} {name!r} of {cls.__name__} would replace the class's own {name!r} "
            f"(a method, property or descriptor); a save may set data only."
        )


def _inside(module: Any, packages: Iterable[str]) -> str | None:
    """The package of ``packages`` that module name ``module`` is, or lies inside (None if none)."""
    if not isinstance(module, str):
        return None
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def _valid_path(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and all(p.isidentifier() and not p.startswith("__") for p in name.split("."))


def _named_within(obj: Any, name: str) -> Any:
    """``obj`` where it names itself ``name``; else the one function a wrapper at ``name`` holds that
    does: ``functools.wraps``' ``__wrapped__``, or a closure cell of the wrapper class's own
    ``forward`` / ``__call__`` (the ``kernels`` package replaces transformers' scan functions by such
    modules; fxprep's opaque part calls the function inside, which names itself after the
    attribute). Identity, not text: the function is the object found there. ``_MISSING`` else."""
    if obj is _MISSING or canonical_name(obj) == name:
        return obj
    inside: list[Any] = [inspect.getattr_static(obj, "__wrapped__", None)]
    for attr in ("forward", "__call__"):
        method = inspect.getattr_static(type(obj), attr, None)
        if isinstance(method, types.FunctionType) and method.__closure__:
            inside += [cell.cell_contents for cell in method.__closure__ if _filled(cell)]
    found = [fn for fn in inside if isinstance(fn, types.FunctionType) and canonical_name(fn) == name]
    return found[0] if len(found) == 1 else _MISSING


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises ValueError
    except ValueError:
        return False
    return True


def _find_in(package: str, name: str) -> Any:
    """The object ``name`` names, imported from inside ``package`` only: the longest importable
    module prefix (never outside the package), then the rest through class dicts (no attribute
    hooks, no modules in between). ``_MISSING`` when there is none."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        if _inside(module_name, (package,)) is None:
            break
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        for j, part in enumerate(parts[i:]):
            if j and not isinstance(obj, type):
                return _MISSING
            obj = vars(obj).get(part, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


@dataclass(frozen=True)
class TrustPolicy:
    """What a loaded file may use. ``modules`` are packages (or modules) the caller trusts, e.g.
    ``("torchvision",)`` or ``("timm.layers", "mypackage")``: their classes and functions, by their
    own canonical names, and the ``torch.ops.<package>`` custom ops they register."""

    modules: tuple[str, ...] = ()
    # callables the caller allows beyond the default list (``allow=``): function names of the fixed
    # namespaces, ``Tensor.<method>``, ``torch.ops.aten.<op>[.<overload>]``, torch.nn layer classes
    allow: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.modules, str) or not all(_valid_path(m) for m in self.modules):
            raise InvalidInput(
                f"trusted_modules must be a list of package names such as ['torchvision'], not {self.modules!r}."
            )
        for name in self.allow:
            if not _allowable(name):
                raise InvalidInput(
                    f"allow={sorted(self.allow)!r}: {name!r} is not a callable an opt-in may allow: a function of "
                    f"torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, math, operator or builtins "
                    f"by its saved name, 'Tensor.<method>', 'torch.ops.aten.<op>' or a torch.nn layer class; raw "
                    f"memory, process state and I/O are never allowed (fxprep.io.reviewed.EXCLUDED_*).")

    @classmethod
    def of(cls, trusted_modules: Iterable[str] | None, allow: Iterable[str] | None = None) -> TrustPolicy:
        for value, what in ((trusted_modules, "trusted_modules"), (allow, "allow")):
            if isinstance(value, str):
                raise InvalidInput(f"{what} must be a list of names, e.g. [{value!r}], not a string.")
        try:
            modules, allowed = tuple(trusted_modules or ()), frozenset(allow or ())
        except TypeError as err:
            raise InvalidInput(f"trusted_modules and allow must be lists of names, not {trusted_modules!r} / "
                               f"{allow!r}.") from err
        return cls(modules, allowed)  # its own checks name the entry that is refused

    # --- the trusted packages -------------------------------------------------------------------
    def package_of(self, module: Any) -> str | None:
        """The trusted package that module name ``module`` lies in."""
        return _inside(module, self.modules)

    def _trusted_object(self, name: str) -> Any:
        """The object a trusted package defines under its canonical ``name`` (identity checked)."""
        package = self.package_of(name)
        if package is None or not _valid_path(name):
            return _MISSING
        obj = _named_within(_find_in(package, name), name)
        if obj is _MISSING or self.package_of(getattr(obj, "__module__", None)) is None:
            return _MISSING
        return obj

    @staticmethod
    def _hint(name: str, trusted: tuple[str, ...] = ()) -> str:
        """Which trusted_modules entry would allow ``name``: its module, if already imported. A
        custom op ``torch.ops.<ns>.<op>`` is allowed by trusting the library ``<ns>`` (that is how
        :meth:`_op` looks it up), never by trusting ``torch.ops``, which is torch itself; an aten op
        outside the reviewed list is allowed by no entry."""
        parts = name.split(".")
        if name.startswith("torch.ops."):
            namespace = parts[2] if len(parts) >= 4 else ""
            if not namespace.isidentifier() or namespace in allowlist.OP_NAMESPACES:
                return "No trusted_modules entry allows it: only the reviewed ops of that namespace are loaded."
            if namespace in trusted:
                return (f"The torch.ops.{namespace} namespace is trusted, but this process has no such op: "
                        f"import the module of {namespace!r} that registers it before fxprep.load.")
            return (f"It is a custom op of the torch.ops.{namespace} namespace: if you trust the library that "
                    f"registers it, pass trusted_modules=[{namespace!r}] to fxprep.load.")
        module = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in sys.modules),
                      name.rpartition(".")[0])
        if not module:
            return ""
        package = module.split(".")[0]
        whole = f" (its module) or [{package!r}] (its whole package)" if package != module else ""
        return f"If you trust it, pass trusted_modules=[{module!r}]{whole} to fxprep.load."

    # --- functions ------------------------------------------------------------------------------
    def function(self, name: Any) -> Callable[..., Any]:
        """The function a loaded graph (or op) may call under ``name``; raises unless trusted."""
        if not isinstance(name, str):
            raise SerializationError(f"refusing to load: malformed function name {str(name)[:80]!r}.")
        if name.startswith("Tensor."):
            check_member(name.removeprefix("Tensor."), "Tensor method", self.allow)
            return ops.method_call(name.removeprefix("Tensor."))
        if name.startswith("autograd:"):
            cls = self._trusted_object(name.removeprefix("autograd:"))
            if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
                raise self._refuse(name.removeprefix("autograd:"), "autograd.Function")
            return autograd_function_caller(cls)
        fn = allowlist.functions().get(name, _MISSING)
        if fn is _MISSING:  # another name of a listed function (the same object), or one the caller allowed
            fn = allowlist.alias(name) or (allowlist.candidate_function(name) if name in self.allow else None) or _MISSING
        if fn is _MISSING and name.startswith(allowlist.TORCHVISION_OPS + "."):
            fn = allowlist.torchvision_functions().get(name, _MISSING)
        if fn is _MISSING and name.startswith("torch.ops."):
            fn = self._op(name)
        if fn is _MISSING:  # a trusted package's function, or class called as one (an output container)
            obj = self._trusted_object(name)
            if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
                fn = obj
        if fn is _MISSING:
            raise self._refuse(name, "function")
        return fn

    def check_function(self, name: str) -> None:
        """Raise unless ``name`` may be called by a loaded graph. A trusted library's custom op
        namespace is accepted by name (its ops exist once the library is imported)."""
        if isinstance(name, str) and name.startswith("torch.ops."):
            parts = name.split(".")
            if len(parts) in (4, 5) and all(p.isidentifier() for p in parts) and parts[2] in self.modules:
                return
        self.function(name)

    def import_op_modules(self, recorded: Any) -> None:
        """Import the modules a save recorded as registering its custom ops
        (:func:`.encode.custom_op_modules`), each only where the op's namespace is a trusted library
        and the module lies inside a trusted package: importing a trusted package's module is what
        trusting it allows (docs/security.md). A module that fails to import is left: the op's
        lookup then refuses, naming the op."""
        if recorded is None:
            return
        if not isinstance(recorded, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in recorded.items()):
            raise SerializationError("refusing to load: malformed op_modules in the manifest.")
        for op, module in recorded.items():
            namespace = op.partition("::")[0]
            if namespace in allowlist.OP_NAMESPACES or namespace not in self.modules:
                continue
            if not _valid_path(module) or self.package_of(module) is None or module in sys.modules:
                continue
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - the op's lookup refuses, naming it
                pass

    def _op(self, name: str) -> Any:
        """``torch.ops.<ns>.<op>[.<overload>]``: an OpOverloadPacket / OpOverload of a trusted
        namespace (aten, prims, or a trusted library's), looked up by its exact qualified name."""
        parts = name.split(".")
        if len(parts) not in (4, 5) or not all(p.isidentifier() and not p.startswith("__") for p in parts[2:]):
            return _MISSING
        namespace, op_name = parts[2], parts[3]
        if namespace not in allowlist.OP_NAMESPACES and namespace not in self.modules:
            return _MISSING
        if namespace in allowlist.OP_NAMESPACES and not (
                allowlist.aten_allowed(op_name, parts[4] if len(parts) == 5 else None)
                or (name in self.allow and allowlist.candidate_aten(op_name))):
            return _MISSING  # only the listed ops (io/reviewed.py) and those the caller allowed
        try:
            packet = getattr(getattr(torch.ops, namespace), op_name)
            found = packet if len(parts) == 4 else getattr(packet, parts[4])
        except (AttributeError, RuntimeError):
            return _MISSING
        if isinstance(found, torch._ops.OpOverloadPacket) and len(parts) == 4:
            return found if found._qualified_op_name == f"{namespace}::{op_name}" else _MISSING
        if isinstance(found, torch._ops.OpOverload) and len(parts) == 5:
            same = found.namespace == namespace and found._opname == op_name and found._overloadname == parts[4]
            return found if same else _MISSING
        return _MISSING

    # --- classes --------------------------------------------------------------------------------
    def module_class(self, name: Any) -> type[nn.Module]:
        """The nn.Module subclass a save may build under ``name``."""
        cls = self._class(name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise SerializationError(f"refusing to load: {str(name)[:120]!r} is not an nn.Module subclass.")
        return cls

    def object_class(self, name: Any) -> type:
        """A class whose instances a save may rebuild from plain attributes (a module, or a helper
        object such as a box coder held by one): a default module class or a trusted package's."""
        cls = self._class(name)
        if not isinstance(cls, type) or issubclass(cls, BaseException):
            raise SerializationError(f"refusing to load: {str(name)[:120]!r} is not a class.")
        return cls

    def _class(self, name: Any) -> Any:
        if not isinstance(name, str):
            raise SerializationError(f"refusing to load: malformed class name {str(name)[:80]!r}.")
        cls = allowlist.module_classes().get(name, _MISSING)
        if cls is _MISSING and name in self.allow:
            cls = allowlist.candidate_module_classes().get(name, _MISSING)
        if cls is _MISSING and name.startswith(allowlist.TORCHVISION_OPS + "."):
            cls = allowlist.torchvision_classes().get(name, _MISSING)
        if cls is _MISSING:
            cls = self._trusted_object(name)
        if cls is _MISSING and name in allowlist.candidate_module_classes():
            raise self._refuse(name, "class")
        if cls is _MISSING and name.startswith(_DEFAULT_CLASS_PACKAGES) and name.rpartition(".")[0] in sys.modules \
                and _valid_path(name) and not self.package_of(name):
            raise SerializationError(
                f"cannot import {name!r}: this installation has no such module class (saved with another "
                f"version of the library?)."
            )
        if cls is _MISSING or not isinstance(cls, type):
            raise self._refuse(name, "class")
        return cls

    def trusted_code(self, fn: Any) -> bool:
        """Whether function ``fn`` (an opaque part's code) is defined inside a trusted package and
        is what its own canonical name resolves to there."""
        name = canonical_name(fn)
        return name is not None and self._trusted_object(name) is fn

    def _refuse(self, name: str, what: str) -> SerializationError:
        listed = f" (trusted: {list(self.modules)})" if self.modules else ""
        excluded = allowlist.excluded(name) if isinstance(name, str) else None
        if excluded is not None:
            return SerializationError(
                f"refusing to load: the file asks for {what} {name[:200]!r}, which is {excluded!r}: never allowed "
                f"(raw memory, process state or I/O: fxprep.io.reviewed.EXCLUDED_FUNCTIONS).")
        if _allowable(name):  # a torch callable the default list leaves out: the caller may allow it
            return SerializationError(
                f"refusing to load: the file asks for {what} {name[:200]!r}, which is not on fxprep's default list "
                f"(fxprep.io.reviewed: what prepared graphs of fxprep's suites and zoos use). "
                f"{_ALLOW_HINT.format(name=name)}")
        return SerializationError(
            f"refusing to load: the file asks for {what} {name[:200]!r}, which is not one fxprep trusts{listed}. "
            f"{self._hint(name, self.modules)}"
        )


def _allowable(name: Any) -> bool:
    """Whether an ``allow=`` entry may name ``name``: a candidate of :mod:`.allowlist` (never excluded)."""
    if not isinstance(name, str):
        return False
    if name.startswith("Tensor."):
        return name.removeprefix("Tensor.") in allowlist.candidate_methods()
    if allowlist.excluded(name) is not None:  # by name too: the tables hold objects, and a library may
        return False  # replace one (torch.manual_seed wrapped after the candidates were collected)
    if name.startswith("torch.ops.aten."):
        parts = name.split(".")
        if not (len(parts) in (4, 5) and all(p.isidentifier() for p in parts) and allowlist.candidate_aten(parts[3])):
            return False
        try:  # an op this torch has (a name is only a name: no opt-in for an op that does not exist)
            getattr(torch.ops.aten, parts[3])
        except (AttributeError, RuntimeError):
            return False
        return True
    return allowlist.candidate_function(name) is not None or name in allowlist.candidate_module_classes()


def is_default_module_class(cls: type) -> bool:
    """torch.nn / torch.ao.nn / fxprep.ops / torchvision.ops classes (trusted without asking)."""
    name = canonical_name(cls)
    if name is None:
        return False
    if allowlist.module_classes().get(name) is cls:
        return True
    return name.startswith(allowlist.TORCHVISION_OPS + ".") and allowlist.torchvision_classes().get(name) is cls


def default_function_name(fn: Any) -> str | None:
    """The saved name of an allow-listed function (preferring ``ops.qualified_name``'s), or None."""
    try:
        preferred = ops.qualified_name(fn)
    except Exception:  # noqa: BLE001 - an odd callable: no preferred name
        preferred = None
    table = allowlist.functions()
    if preferred is not None and table.get(preferred, _MISSING) is fn:
        return preferred
    name = allowlist.function_names().get(id(fn))
    if name is not None and table.get(name) is fn:
        return name
    vision = allowlist.torchvision_functions() if str(getattr(fn, "__module__", "")).startswith("torchvision.ops") else {}
    found = next((n for n, f in vision.items() if f is fn), None)
    if found is None and _torch_callable(fn):  # not listed: the name an allow= entry gives it (load refuses
        found = allowlist.candidate_names().get(id(fn))  # it without one, naming it)
    return found


def _torch_callable(fn: Any) -> bool:
    module = str(getattr(fn, "__module__", None) or "")
    return module in ("torch", "math", "builtins", "_operator", "operator") or module.startswith("torch.")
