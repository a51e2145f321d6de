"""transformers' run-time checks whose message is built before the check, made lazy during capture.

``torch_compilable_check(cond, f"...")`` builds its f-string message before the call, and formatting
a symbolic size specialises it (a dynamic batch fixed by a message never shown). During capture each
such call in the model's transformers methods runs in a copy (:mod:`.methods`) whose message is a
``lambda``, built only when the check fails; the check itself is traced unchanged.

See docs/shapes.md ("Under the hood").
"""

from __future__ import annotations

import ast
import types
from typing import Any

_CHECK = "torch_compilable_check"


def wanted(code: types.CodeType) -> bool:
    """Whether a function's code calls the check (a cheap test before its source is parsed)."""
    return _CHECK in code.co_names


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


def rewrite(tree: ast.FunctionDef, namespace: dict[str, Any]) -> dict[str, Any] | None:
    """Make every f-string message of the check in ``tree`` lazy, in place; ``{}`` (no helpers)
    when one was, None when there was none."""
    change = _LazyMessage()
    change.visit(tree)
    return {} if change.changed else None
