"""Where in the user's model a Dynamo failure happened: from Dynamo's user stack to live objects.

Dynamo's error names the frames it was tracing, not which instance ran them. :func:`resolve` names
the objects from the stack alone where each frame's class has one instance in the model; otherwise
:func:`locate` replays the model eagerly with a trace hook and stops at each call matching the
stack, giving the live frames and the other instances that would fail the same way.

See docs/concepts/opaque-parts.md ("Under the hood") for the matching rules and costs.
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn

from ...core.inputs import ExampleInputs
from ...core.runs import SEED, preserved_state
from ...reporting.diagnose import is_user_file
from ..sites import FrameRecord, Site, helper_objects, sites_from_frames, wrapped_codes
from .opaque import OPAQUE_PREFIX

MAX_MATCHES = 256


def user_stack(err: BaseException) -> list[tuple[str, str, int]]:
    """Dynamo's user frames for ``err`` as ``(file, function, line)``, outermost first, without the
    frames of torch, the standard library and fxprep."""
    stack = getattr(err, "real_stack", None)
    if not stack and err.__context__ is not None:
        stack = getattr(err.__context__, "real_stack", None)
    out = []
    for summary in stack or []:
        filename = getattr(summary, "filename", None)
        if filename and is_user_file(filename):
            out.append((_norm(filename), summary.name, int(summary.lineno or 0)))
    return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def origin_stack(err: BaseException) -> list[tuple[str, str, int]]:
    """For a guard on a data-dependent size (``Eq(u2*u3, 24)``): the user frames where the first of
    its unbacked symbols was *created* (the ``.item()``, ``.tolist()`` or tensor-valued slice), which
    is what must be opaque; the guard itself may fail much later, or with no user frame at all.
    Empty when unknown, or when the symbols came out of an opaque part (:mod:`.opaque`)."""
    cause: BaseException | None = err
    seen: set[int] = set()
    while cause is not None and getattr(cause, "cond", None) is None and id(cause) not in seen:
        seen.add(id(cause))  # a chain may loop: an error re-raised while handling one raised from it
        cause = cause.__context__ or cause.__cause__
    cond = getattr(cause, "cond", None)
    output = getattr(err, "_torch_dynamo_tracer_output", None)  # private: feature-detected
    graph_out = getattr(output, "output_graph", None) or getattr(output, "output_graph_for_cleanup", None)
    graph = getattr(graph_out, "graph", None)
    symbols = getattr(cond, "free_symbols", None)
    if not symbols or graph is None:
        return []
    for node in graph.nodes:
        bindings = node.meta.get("unbacked_bindings") or {}
        if not any(sym in symbols for sym in bindings):
            continue
        if node.op == "call_function" and getattr(node.target, "__name__", "").startswith(OPAQUE_PREFIX):
            return []
        frames = [(_norm(f), name, int(line)) for f, line, name in _FRAME.findall(node.meta.get("stack_trace") or "")]
        return [f for f in frames if is_user_file(f[0])]
    return []


def _norm(filename: str) -> str:
    return os.path.normcase(os.path.abspath(filename))


@dataclass
class Located:
    """The frames of each eager call on the failing path, the first being the one Dynamo failed in
    (calls matching Dynamo's stack call line for call line if there are any, else by function names)."""

    chains: list[list[FrameRecord]]

    def sites(self, model: nn.Module, *, nested: bool = False) -> list[tuple[Site, list[Site]]]:
        """The candidate sites, innermost first, each with the same site in the other matching
        calls (other instances of the same class reached the same way); ``nested``: the functions
        a function called from a method calls too (:func:`~fxprep.capture.sites.sites_from_frames`)."""
        first = sites_from_frames(self.chains[0], model, nested=nested)
        others = [sites_from_frames(chain, model, nested=nested) for chain in self.chains[1:]]
        out = []
        for k, site in enumerate(first):
            same: list[Site] = []
            if site.func is None:  # a function site is patched where it is looked up: every call
                kind = type(site.owner(model))
                for sites in others:
                    other = sites[k] if len(sites) == len(first) else None
                    if other is not None and other != site and other not in same and other.func is None \
                            and other.method == site.method and type(other.owner(model)) is kind:
                        same.append(other)
            out.append((site, same))
        return out


def _chain_matches(chain: list[tuple[str, str, int]], stack: list[tuple[str, str, int]], exact: bool) -> bool:
    """Whether the user frames of an eager call end with Dynamo's user stack (the eager chain also
    holds the frames of whoever called the model)."""
    if len(chain) < len(stack):
        return False
    tail = chain[len(chain) - len(stack):]
    for k, ((f1, n1, l1), (f2, n2, l2)) in enumerate(zip(tail, stack)):
        if f1 != f2 or n1 != n2:
            return False
        if exact and k < len(stack) - 1 and l1 != l2:
            return False
    return True


def _innermost_of_runs(codes: list[Any]) -> list[int]:
    """The indexes of an eager chain's frames left when consecutive frames of one code object are
    taken as one, the innermost: a wrapper that calls itself again eagerly but not under Dynamo
    (transformers' hub-kernel function modules: ``Func.forward`` dispatches to the active one's
    ``forward`` while compiling, and through a second ``Func.forward`` call eagerly) is one frame in
    both stacks. By code object, not by file and name: a layer's ``forward`` calling its attention's
    ``forward`` in the same file (YOSO) are two frames."""
    return [k for k in range(len(codes)) if k + 1 == len(codes) or codes[k + 1] is not codes[k]]


def locate(stack: list[tuple[str, str, int]], model: nn.Module, call: ExampleInputs) -> Located | None:
    """The live frames of the eager calls on the path of ``stack`` (Dynamo's user frames,
    :func:`user_stack` or :func:`origin_stack`), or None when the eager run never takes that path."""
    if not stack:
        return None
    target_file, target_name, _ = stack[-1]
    candidates: list[tuple[list[tuple[str, str, int]], list[FrameRecord]]] = []
    previous: Callable[..., Any] | None = sys.gettrace()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        # a global trace function is called once per new Python frame (a profile function would
        # also be called for every C call and return: several times slower on a detector's forward);
        # whoever traced before (a debugger, coverage) keeps tracing
        local = previous(frame, event, arg) if previous is not None else None
        if event != "call" or len(candidates) >= MAX_MATCHES:
            return local
        code = frame.f_code
        if code.co_name != target_name or _norm(code.co_filename) != target_file:
            return local
        frames = []
        f = frame
        while f is not None:
            if is_user_file(f.f_code.co_filename):
                frames.append(f)
            f = f.f_back
        frames.reverse()
        described = [(_norm(f.f_code.co_filename), f.f_code.co_name, f.f_lineno) for f in frames]
        kept = _innermost_of_runs([f.f_code for f in frames])
        frames, described = [frames[k] for k in kept], [described[k] for k in kept]
        if _chain_matches(described, stack, exact=False):
            records = [FrameRecord.of(f) for f in frames[len(frames) - len(stack):]]
            candidates.append((described, records))
        return local

    fresh = call.fresh_copy()
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            sys.settrace(trace)
            try:
                model(*fresh.args, **fresh.kwargs)
            finally:
                sys.settrace(previous)
    except Exception:  # noqa: BLE001 - the calls seen before an eager failure still locate it
        pass
    if not candidates:
        return None
    exact = [records for described, records in candidates if _chain_matches(described, stack, exact=True)]
    return Located(exact or [records for _, records in candidates])


def _lines(code: types.CodeType) -> range:
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return range(code.co_firstlineno, last + 1)


def _matches(code: Any, file: str, name: str, line: int) -> TypeGuard[types.CodeType]:
    return (isinstance(code, types.CodeType) and code.co_name == name and _norm(code.co_filename) == file
            and line in _lines(code))


def _method_codes(cls: type) -> list[types.CodeType]:
    """The code objects of the methods ``cls`` has or inherits, decorator wrappers included (a
    ``super().forward`` runs a base class's code with the subclass's ``self``)."""
    found: list[types.CodeType] = []
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            found.extend(wrapped_codes(fn))
    return found


def _nested(code: types.CodeType, file: str, name: str, line: int) -> types.CodeType | None:
    """A function defined inside ``code`` (a closure, a comprehension) at ``file:line``."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if _matches(const, file, name, line):
                return const
            inner = _nested(const, file, name, line)
            if inner is not None:
                return inner
    return None


def _module_globals(file: str, cache: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The globals of the loaded module whose source is ``file``."""
    if file not in cache:
        cache[file] = None
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if isinstance(path, str) and _norm(path) == file:
                cache[file] = vars(module)
                break
    return cache[file]


def _method_frame(file: str, name: str, line: int, by_class: dict[type, list[Any]],
                  methods: dict[type, list[types.CodeType]], module_globals: dict[str, Any] | None
                  ) -> tuple[bool, FrameRecord | None]:
    """The frame as a method of the one object in the model that can run it. The first value says
    whether any class has a method there (then a None record means: not one code, or not one owner)."""
    owners: dict[int, Any] = {}
    codes: list[types.CodeType] = []
    for cls, instances in by_class.items():
        for code in methods[cls]:
            if _matches(code, file, name, line):
                if code not in codes:
                    codes.append(code)
                if code.co_argcount and code.co_varnames[0] == "self":
                    owners.update((id(obj), obj) for obj in instances)
    if len(codes) != 1 or len(owners) != 1 or module_globals is None:
        return bool(codes), None
    return True, FrameRecord(codes[0], next(iter(owners.values())), module_globals, line)


def _function_frame(file: str, name: str, line: int, previous: FrameRecord | None,
                    module_globals: dict[str, Any] | None) -> FrameRecord | None:
    """The frame as a function found where its caller (or its own module) looks it up, or as a
    closure or comprehension defined in its caller."""
    scopes = [g for g in (previous.globals if previous is not None else None, module_globals) if g is not None]
    for scope in scopes:
        fn = scope.get(name)
        code = getattr(fn, "__code__", None)
        if fn is not None and _matches(code, file, name, line):
            return FrameRecord(code, None, fn.__globals__, line)
    if previous is not None:
        code = _nested(previous.code, file, name, line)
        if code is not None:
            return FrameRecord(code, None, previous.globals, line)
    return None


def resolve(stack: list[tuple[str, str, int]], model: nn.Module) -> Located | None:
    """The frames of ``stack`` found without running the model, or None when the stack alone does
    not say which objects ran it: a method whose class has several instances in the model (which
    block of a stack of identical layers?), a decorator's wrapper shared by many methods, a
    function that is not found where its caller looks it up."""
    if not stack:
        return None
    objects: list[Any] = list(model.modules())
    objects.extend(getattr(model.get_submodule(path), attr) for path, attr in helper_objects(model).values())
    by_class: dict[type, list[Any]] = {}
    for obj in objects:
        by_class.setdefault(type(obj), []).append(obj)
    methods = {cls: _method_codes(cls) for cls in by_class}
    files: dict[str, dict[str, Any] | None] = {}
    records: list[FrameRecord] = []
    for file, name, line in stack:
        module_globals = _module_globals(file, files)
        is_method, record = _method_frame(file, name, line, by_class, methods, module_globals)
        if not is_method:
            record = _function_frame(file, name, line, records[-1] if records else None, module_globals)
        if record is None:
            return None
        records.append(record)
    return Located([records])


__all__ = ["Located", "locate", "origin_stack", "resolve", "user_stack"]
