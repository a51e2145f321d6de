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
(:mod:`.methods`, decorated ``forward`` methods included) whose message is ``lambda: f"..."``;
nothing else in the method changes, so the check itself is traced as before.
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
