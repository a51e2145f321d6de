"""Opaque sites: the parts of a model a capture keeps as eager calls, found from the frames of a
failure.

Both opaque-leaf fallbacks (fx in :mod:`.leaves`, Dynamo in :mod:`.dynamo.fallback`) speak this
vocabulary. A :class:`Site` is a submodule's ``forward``, another method of a submodule or of a
helper object it holds, or a free function a module calls; :func:`sites_from_frames` reads them off
the failing frames, innermost first, so the smallest part is made opaque. In the prepared graph a
method is an :class:`OpaqueMethod` and a function an :class:`OpaqueFunction`, each calling the
original code.

See docs/concepts/opaque-parts.md ("Under the hood").
"""

from __future__ import annotations

import functools
import traceback
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def mutable(value: Any) -> Any:
    """``value`` with fx's immutable containers as plain ones, recursively. An opaque part's code
    is the user's eager code and may write into what it is given (transformers'
    ``get_vision_window_index`` pops from its ``kwargs``), but fx hands a node's arguments as
    ``immutable_dict`` / ``immutable_list`` when it interprets the graph (``torch.export``, the
    ONNX exporter, Dynamo during capture)."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if type(value) in (immutable_dict, dict):
        return {k: mutable(v) for k, v in value.items()}
    if type(value) in (immutable_list, list):
        return [mutable(v) for v in value]
    if type(value) is tuple:
        return tuple(mutable(v) for v in value)
    return value


class OpaqueMethod(nn.Module):
    """Calls ``owner.<method>`` eagerly: one method of a module kept out of the trace.

    The owner is held by reference without being registered as a child, so its parameters are not
    listed twice; ``owner_path`` says where it lives in the original model.
    """

    def __init__(self, owner: nn.Module, method: str, owner_path: str):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.method = method
        self.owner_path = owner_path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = mutable((args, kwargs))
        return getattr(type(self.owner), self.method)(self.owner, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.owner_path or 'root'}.{self.method} (opaque: runs eagerly)"


class OpaqueFunction(nn.Module):
    """Calls a user function eagerly: a free function kept out of the trace."""

    def __init__(self, fn: Any):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = mutable((args, kwargs))
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__} (opaque: runs eagerly)"


@dataclass(frozen=True)
class Site:
    """An opaque part: a module (``method == 'forward'``), one method of a module, or one method of
    a plain helper object held by a module (``attr``, e.g. ``rpn.box_coder.decode``)."""

    path: str
    method: str = "forward"
    attr: str | None = None
    func: str | None = None  # "module.function" for a free function called from ``path``

    @property
    def qualname(self) -> str:
        if self.func is not None:
            return f"{self.path + '.' if self.path else ''}{self.method}"
        if self.method == "forward" and self.attr is None:
            return self.path
        return ".".join(p for p in (self.path, self.attr, self.method) if p)

    @property
    def is_module(self) -> bool:
        """The site is a whole module call (its ``forward``)."""
        return self.method == "forward" and self.attr is None and self.func is None

    def called_from(self, path: str) -> Site:
        """This function site as called by the module at ``path``: one patch of the function takes
        the calls of every module (the other layers of a stack), and each call is named after the
        module that made it."""
        assert self.func is not None, "only a function site is called from several modules"
        moved = Site(path, self.method, None, self.func)
        FUNCTIONS.setdefault(moved, FUNCTIONS[self])
        return moved

    def owner(self, model: nn.Module) -> Any:
        module = model.get_submodule(self.path)
        return module if self.attr is None else getattr(module, self.attr)

    def original(self, model: nn.Module) -> Any:
        """The un-patched callable this site stands for."""
        if self.func is not None:
            return FUNCTIONS[self][0]
        owner = self.owner(model)
        return functools.partial(getattr(type(owner), self.method), owner)

    def eager_module(self, model: nn.Module) -> nn.Module:
        """What the prepared graph calls for this site: the user's module itself, or a wrapper
        module calling the method or function."""
        if self.func is not None:
            return OpaqueFunction(FUNCTIONS[self][0])
        if self.is_module:
            return model.get_submodule(self.path)
        return OpaqueMethod(self.owner(model), self.method, self.qualname.rpartition(".")[0])


def helper_objects(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``id(obj) -> (module path, attribute)`` for plain Python objects modules hold (box coders,
    anchor matchers): their methods can be made opaque like a module's."""
    out: dict[int, tuple[str, str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for attr, value in m.__dict__.items():
            if attr.startswith("_") or isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
                continue
            if isinstance(value, (int, float, str, bool, bytes, tuple, list, dict, set, type(None))):
                continue
            if hasattr(value, "__dict__"):
                out.setdefault(id(value), (name, attr))
    return out


MISSING = object()  # "the name was not set": what :func:`put_back` removes again


def put_back(changes: list[tuple[dict[str, Any], str, Any]]) -> None:
    """Undo ``(namespace, name, value before)`` patches, last first (a site's method on its owner,
    a function in its callers' globals); a name that was :data:`MISSING` before is removed."""
    for place, name, before in reversed(changes):
        if before is MISSING:
            place.pop(name, None)
        else:
            place[name] = before


# Free functions made opaque: site → (function, the globals dicts where its name is patched).
FUNCTIONS: dict[Site, tuple[Any, list[dict[str, Any]]]] = {}


@dataclass(frozen=True)
class FrameRecord:
    """What a site needs of one running frame (a live frame or one met during an eager replay)."""

    code: types.CodeType
    owner: Any  # the frame's ``self``, or None
    globals: dict[str, Any]
    lineno: int

    @classmethod
    def of(cls, frame: types.FrameType, lineno: int | None = None) -> FrameRecord:
        return cls(frame.f_code, frame.f_locals.get("self"), frame.f_globals,
                   frame.f_lineno if lineno is None else lineno)


def frames_of(err: BaseException) -> list[FrameRecord]:
    """The frames of ``err``'s traceback, outermost first."""
    return [FrameRecord.of(f, lineno) for f, lineno in traceback.walk_tb(err.__traceback__)]


def _function_of(frame: FrameRecord, caller_globals: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]] | None:
    """The function object running in ``frame`` and the globals its callers find it in. A function
    its module binds to a ``functools.wraps`` wrapper (transformers' hub-kernel fallbacks:
    ``mamba_selective_scan`` is a ``wrapped`` that may call a compiled kernel) is that wrapper: what
    the callers look up and what the prepared module calls."""
    name = frame.code.co_name
    places: list[dict[str, Any]] = []
    fn = None
    for g in (caller_globals, frame.globals):
        candidate = g.get(name)
        if frame.code in wrapped_codes(candidate):
            fn = candidate
            if all(g is not p for p in places):
                places.append(g)
    return (fn, places) if fn is not None else None


def wrapped_codes(fn: Any) -> list[types.CodeType]:
    """The code objects of ``fn`` and of every function it wraps (``functools.wraps`` chains, and the
    function a hub-kernel function module calls: :func:`_function_module_target`)."""
    codes = []
    seen = 0
    while fn is not None and seen < 16:
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(code)
        fn = getattr(fn, "__wrapped__", None) if code is not None else _function_module_target(fn)
        seen += 1
    return codes


def _function_module_target(obj: Any) -> Any:
    """The function a module-level function module calls, or None. transformers (with the
    ``kernels`` package) binds a hub-kernel function's name to an ``nn.Module`` instance whose class
    ``forward`` calls the function it closes over (``func``: the ``functools.wraps`` fallback around
    the torch code, Mamba-2's ``mamba2_chunk_scan``): that module is what the callers look up."""
    if not isinstance(obj, nn.Module):
        return None
    forward = getattr(type(obj), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells or "func" not in code.co_freevars:
        return None
    target = cells[code.co_freevars.index("func")].cell_contents
    return target if callable(target) and not isinstance(target, nn.Module) else None


_METHOD_CACHE: dict[tuple[type, types.CodeType], str | None] = {}


def method_name(owner: Any, code: types.CodeType) -> str | None:
    """The name of the method of ``type(owner)`` whose code (or a decorator wrapper around it) is
    ``code``: ``forward`` for the ``wrapper`` frame of a transformers-decorated forward."""
    name = code.co_name
    if name.startswith(("<", "__")):
        return None
    cls = type(owner)
    if callable(getattr(cls, name, None)):
        return name
    key = (cls, code)
    if key not in _METHOD_CACHE:
        found = None
        for attr in ("forward", *sorted(n for k in cls.__mro__ for n in vars(k) if not n.startswith("__"))):
            fn = getattr(cls, attr, None)
            if callable(fn) and code in wrapped_codes(fn):
                found = attr
                break
        _METHOD_CACHE[key] = found
    return _METHOD_CACHE[key]


def sites_from_frames(frames: list[FrameRecord], model: nn.Module, *, nested: bool = False) -> list[Site]:
    """The sites running in ``frames`` (outermost first), innermost first: a function of the model's
    code called from the innermost method, then each method of a submodule or helper object.
    ``nested``: each function that function calls on the way too, found where its caller looks it up
    (Mamba-2's ``mamba2_scan_forward`` reads the layer's parameters; the ``mamba2_chunk_scan`` it
    calls does not: the per-step loop a scan search wants, :mod:`fxprep.capture.dynamo.scans`)."""
    from ..reporting.diagnose import is_user_file

    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    helpers: dict[int, tuple[str, str]] | None = None
    found: list[Site] = []
    site: Site | None = None
    site_globals: dict[str, Any] | None = None
    function_site = None
    for frame in frames:
        owner = frame.owner
        method = method_name(owner, frame.code) if owner is not None else None
        if method is not None and id(owner) in names:
            new = Site(names[id(owner)], method)
        elif method is not None:
            if helpers is None:
                helpers = helper_objects(model)
            new = None
            if id(owner) in helpers and hasattr(owner, "__dict__"):
                path, attr = helpers[id(owner)]
                new = Site(path, method, attr)
        else:
            new = None
        if new is not None:
            if new != site:
                found.append(new)
            site, site_globals, function_site = new, frame.globals, None
            continue
        if (site is not None and (function_site is None or nested) and owner is None and site_globals is not None
                and not frame.code.co_name.startswith("<") and is_user_file(frame.code.co_filename)):
            fn_found = _function_of(frame, site_globals)
            if fn_found is not None:
                # a function module: the function it calls stands for it (a plain function, named as it)
                fn = _function_module_target(fn_found[0]) or fn_found[0]
                fn_found = (fn, fn_found[1])
                function_site = Site(site.path, frame.code.co_name, None, f"{fn.__module__}.{fn.__qualname__}")
                FUNCTIONS[function_site] = fn_found
                found.append(function_site)
                if nested:  # the next function is looked up where this one looks
                    site_globals = frame.globals
    return list(reversed(found))


def failure_site(err: BaseException, model: nn.Module) -> Site | None:
    """The innermost method of the model (or of a helper object it holds) running when ``err`` was
    raised, or the user function that method called when the failure is inside that function."""
    sites = sites_from_frames(frames_of(err), model)
    return sites[0] if sites else None


__all__ = ["FUNCTIONS", "FrameRecord", "OpaqueFunction", "OpaqueMethod", "Site", "failure_site", "frames_of",
           "MISSING", "helper_objects", "method_name", "mutable", "put_back", "sites_from_frames", "wrapped_codes"]
