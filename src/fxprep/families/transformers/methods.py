"""transformers methods that run a rewritten copy during capture, so that the graph follows eager.

Some transformers code takes another path under a trace, for reasons plain from its source
(:mod:`.compilable_checks`, :mod:`.unpadded`). Each such method is parsed, changed and compiled with
the control-flow rewrite's machinery (:mod:`fxprep.capture.rewrite.source`), and the copy is
installed on the instances for the ``with`` block only (:func:`rewritten_methods`); the class is
never touched, and a method that cannot be rewritten keeps its code. Copies are compiled once per
class attribute.

See docs/checkpoints.md ("Under the hood").
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...capture.rewrite.source import Method, SourceUnavailable, bound, compile_function, parse
from ...capture.rewrite.transform import mangle
from . import compilable_checks as hf_checks
from . import unpadded as hf_unpadded


@dataclass(frozen=True)
class SourceChange:
    """One change: ``wanted`` tests a function's code cheaply, ``rewrite`` edits its parsed def in
    place and returns the helpers the copy calls (None when nothing matched)."""

    wanted: Callable[[types.CodeType], bool]
    rewrite: Callable[[ast.FunctionDef, dict[str, Any]], dict[str, Any] | None]


CHANGES = (SourceChange(hf_checks.wanted, hf_checks.rewrite),
           SourceChange(hf_unpadded.wanted, hf_unpadded.rewrite))

_COMPILED: dict[int, tuple[Any, Any]] = {}  # id(class attribute) -> (the attribute, its copy or None)
_CANDIDATES: dict[type, list[tuple[str, Any, types.FunctionType]]] = {}  # class -> (name, attribute, raw function)


def _candidates(cls: type) -> list[tuple[str, Any, types.FunctionType]]:
    """``(name, attribute, undecorated function)`` for the functions a transformers class itself
    defines whose code some change wants."""
    if cls not in _CANDIDATES:
        found = []
        if cls.__module__.startswith("transformers."):
            for name, attr in vars(cls).items():
                raw = inspect.unwrap(attr) if isinstance(attr, types.FunctionType) else None
                if isinstance(raw, types.FunctionType) and any(c.wanted(raw.__code__) for c in CHANGES):
                    found.append((name, attr, raw))
        _CANDIDATES[cls] = found
    return _CANDIDATES[cls]


def _methods(model: nn.Module) -> list[Method]:
    """The candidate methods of ``model``'s classes, each with the modules whose class resolves the
    name to it (a subclass overriding it does not run it)."""
    by_type: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        by_type.setdefault(type(module), []).append(module)
    found: dict[tuple[type, str], Method] = {}
    for kind, modules in by_type.items():
        for cls in kind.__mro__:
            for name, attr, raw in _candidates(cls):
                method = found.setdefault((cls, name), Method(cls, name, attr, raw, raw.__code__.co_filename, 0, 0))
                if inspect.getattr_static(kind, name, None) is attr:
                    method.instances.extend(modules)
    return [m for m in found.values() if m.instances]


def _changed(method: Method, tree: ast.FunctionDef) -> dict[str, Any] | None:
    """Make in ``tree`` (``method``'s parsed def) every change that applies; the helpers the copy
    needs, or None when none applies (or the method is not transformers' own)."""
    if not method.cls.__module__.startswith("transformers."):
        return None
    helpers: dict[str, Any] = {}
    changed = False
    for change in CHANGES:
        if change.wanted(method.raw.__code__):
            added = change.rewrite(tree, method.raw.__globals__)
            if added is not None:
                helpers.update(added)
                changed = True
    return helpers if changed else None


def source_tree(method: Method) -> tuple[ast.FunctionDef, dict[str, Any]]:
    """``method``'s def as :func:`...capture.rewrite.source.parse` reads it, with every change that applies
    made, and the helpers those changes need (none for a method no change applies to).

    For the control-flow rewrite (:mod:`...capture.rewrite.session`): its copy of a method replaces the one
    :func:`rewritten_methods` would install on the same instances, so it must start from the changed
    source, not the file's; otherwise the changes here are lost wherever a data-dependent ``if`` is
    rewritten in the same method. Raises :class:`SourceUnavailable` as ``parse`` does."""
    tree = parse(method)
    return tree, _changed(method, tree) or {}


def rewritten(method: Method) -> Any:
    """``method`` compiled with every change that applies, or None (none applies, or its source
    cannot be recompiled). Compiled once per class attribute."""
    cached = _COMPILED.get(id(method.attr))
    if cached is not None and cached[0] is method.attr:
        return cached[1]
    copy = None
    try:
        tree = parse(method)
        helpers = _changed(method, tree)
        if helpers is not None:
            mangle(tree, method.cls.__name__)
            copy = compile_function(method, tree, helpers)
    except (SourceUnavailable, SyntaxError, ValueError, TypeError):
        copy = None
    _COMPILED[id(method.attr)] = (method.attr, copy)
    return copy


@contextlib.contextmanager
def rewritten_methods(model: nn.Module) -> Iterator[None]:
    """For the ``with`` block, the model's transformers methods that some change applies to run
    their rewritten copies (module docstring)."""
    replacements = []
    for method in _methods(model):
        copy = rewritten(method)
        if copy is not None:
            # an instance that already has its own entry keeps it: the user's attribute, or the
            # control-flow rewrite's copy, made from the changed source (:func:`source_tree`)
            method.instances = [i for i in method.instances if method.name not in i.__dict__]
            replacements.append((method, copy))
    with bound(replacements):
        yield
