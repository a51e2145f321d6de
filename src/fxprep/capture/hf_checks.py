"""transformers' run-time checks whose message is built before the check, made lazy during capture.

A multimodal transformers model checks that the prompt holds as many image tokens as its vision
tower made features: ``torch_compilable_check(cond, f"... features: {n_image_features}")`` (152
``get_placeholder_mask`` methods in transformers 5, and some ``forward`` methods). Under tracing that
function drops the message and calls ``torch._check(cond)``; but the f-string is an argument, built
before the call, and Dynamo formats the size it holds. Formatting a symbolic size specialises it: the
number of features follows the batch (one image per sample), so a batch declared dynamic is
specialised by a message that is never shown, and the graph refuses every other batch.

``torch_compilable_check`` also takes its message as a callable, built only when the check fails.
During capture each method of the model's transformers classes that passes an f-string runs a copy
whose message is ``lambda: f"..."`` (:mod:`.rewrite.source` compiles it: the method's globals,
closure kept, installed on the instances only for the ``with`` block); nothing else in the method
changes, so the check itself is traced as before. A decorated method (a few models' ``forward``),
or one whose source cannot be read or recompiled, keeps its original code.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from .rewrite.source import Method, SourceUnavailable, bound, compile_function, parse

_CHECK = "torch_compilable_check"
_COMPILED: dict[int, tuple[Any, Any]] = {}  # id(class attribute) -> (the attribute, its lazy copy or None)
_CALLING: dict[type, list[tuple[str, types.FunctionType]]] = {}  # a class -> its methods that call the check


class _LazyMessage(ast.NodeTransformer):
    """``torch_compilable_check(cond, f"...")`` -> ``torch_compilable_check(cond, lambda: f"...")``."""

    def __init__(self) -> None:
        self.changed = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name != _CHECK:
            return node
        if len(node.args) >= 2 and isinstance(node.args[1], ast.JoinedStr):
            node.args[1] = self._lazy(node.args[1])
        for keyword in node.keywords:
            if keyword.arg == "msg" and isinstance(keyword.value, ast.JoinedStr):
                keyword.value = self._lazy(keyword.value)
        return node

    def _lazy(self, message: ast.expr) -> ast.Lambda:
        self.changed += 1
        empty = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
        return ast.copy_location(ast.Lambda(args=empty, body=message), message)


def _methods(model: nn.Module) -> list[Method]:
    """The undecorated methods of ``model``'s transformers classes that call the check, each with
    the modules whose class resolves the name to it (a subclass overriding it does not run it)."""
    by_type: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        by_type.setdefault(type(module), []).append(module)
    found: dict[tuple[type, str], Method] = {}
    for kind, modules in by_type.items():
        for cls in kind.__mro__:
            for name, fn in _calling(cls):
                method = found.setdefault((cls, name), Method(cls, name, fn, fn, fn.__code__.co_filename, 0, 0))
                if inspect.getattr_static(kind, name, None) is fn:
                    method.instances.extend(modules)
    return [m for m in found.values() if m.instances]


def _calling(cls: type) -> list[tuple[str, types.FunctionType]]:
    """``(name, function)`` of the plain functions ``cls`` itself defines that call the check, for a
    transformers class. A decorated method (a model's ``forward`` under ``can_return_tuple`` and
    the like) is left as it is: its decorators would have to be applied again to a copy."""
    if cls not in _CALLING:
        _CALLING[cls] = [] if not cls.__module__.startswith("transformers.") else [
            (name, attr) for name, attr in vars(cls).items()
            if isinstance(attr, types.FunctionType) and not hasattr(attr, "__wrapped__")
            and _CHECK in attr.__code__.co_names]
    return _CALLING[cls]


def _lazy_copy(method: Method) -> Any:
    """``method`` compiled with its messages lazy, or None (no f-string message, or its source
    cannot be recompiled). Compiled once per class attribute."""
    cached = _COMPILED.get(id(method.attr))
    if cached is not None and cached[0] is method.attr:
        return cached[1]
    copy = None
    try:
        tree = parse(method)
        change = _LazyMessage()
        change.visit(tree)
        if change.changed:
            copy = compile_function(method, tree, {})
    except (SourceUnavailable, SyntaxError, ValueError, TypeError):
        copy = None
    _COMPILED[id(method.attr)] = (method.attr, copy)
    return copy


@contextlib.contextmanager
def lazy_check_messages(model: nn.Module) -> Iterator[None]:
    """For the ``with`` block, the model's transformers methods that build a check's message before
    the check run copies that build it only when the check fails (module docstring)."""
    replacements = [(m, copy) for m in _methods(model) if (copy := _lazy_copy(m)) is not None]
    with bound(replacements):
        yield
