"""Readable, deterministic, collision-free names for the modules passes add.

A quantization configuration refers to added modules by name, so each name says where the op is in
the model's code and is the same on every run: ``<owner module path>.<function>.<op>``, numbered in
graph order when repeated, and never shadowing anything in the prepared module or the original
model.

See docs/concepts/names.md for the rules and examples.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..core.frames import frames_of
from ..core.paths import has_path, holds

_MANGLED = re.compile(r"(^|\.)(G___|L__|L\[|G\[)")


def _entries(node: fx.Node) -> list[tuple[str, Any]]:
    """The node's module stack, outermost first: (qualified name, class)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        out.append((path if isinstance(path, str) else "", cls))
    return out


def _is_model_path(path: str, original: nn.Module | None) -> bool:
    """Whether ``path`` names a module of the user's model (not a module Dynamo met elsewhere)."""
    if _MANGLED.search(path):
        return False
    if original is None or not path:
        return True
    try:
        original.get_submodule(path)
    except AttributeError:
        return False
    return True


def owner_of(node: fx.Node, original: nn.Module | None = None) -> tuple[str, Any]:
    """(qualified name, class) of the user's module whose forward produced ``node``: the innermost
    entry of its module stack that is a module of ``original`` (``""`` and the root's class, or
    None, when there is none)."""
    for path, cls in reversed(_entries(node)):
        if _is_model_path(path, original):
            return path, cls
    return "", type(original) if original is not None else None


def scope_of(node: fx.Node, original: nn.Module | None = None) -> str:
    """Qualified name of the module whose forward produced ``node`` ('' for the root)."""
    return owner_of(node, original)[0]


_PLUMBING = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl", "wrapper", "wrapped", "inner",
                       "decorate_context"})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FXPREP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _forward_code(cls: Any) -> Any:
    forward = getattr(cls, "forward", None) if isinstance(cls, type) else None
    if forward is None:
        return None
    return getattr(inspect.unwrap(forward), "__code__", None)


def function_of(node: fx.Node, owner_cls: Any) -> str | None:
    """The function the owner's ``forward`` called that made ``node`` (the outermost one under
    ``forward``, skipping torch's own Python, fxprep's and call plumbing), or None when ``node`` was
    made in ``forward`` itself or the stack does not say (no frames recorded, the owner's not among them)."""
    code = _forward_code(owner_cls)
    frames = frames_of(node) if code is not None else []
    at = [i for i, (file, func) in enumerate(frames) if func == code.co_name and file == code.co_filename]
    if not at:
        return None
    for file, func in frames[at[-1] + 1:]:
        if func.startswith("<") or func in _PLUMBING or file.startswith(_TORCH_DIR):
            continue
        if file.startswith(_FXPREP_DIR) and file != code.co_filename:
            continue
        return func
    return None


_CLEAN = re.compile(r"[^0-9a-zA-Z_]+")


def base_name(text: str) -> str:
    text = _CLEAN.sub("_", text).strip("_").lower()
    if not text or text[0].isdigit():
        text = f"op_{text}"
    return text


def code_scope(gm: fx.GraphModule, original: nn.Module | None, node: fx.Node, base: str,
               functions: set[str]) -> tuple[str, str]:
    """(scope, base) of the module a pass adds for ``node``: ``(owner.function, op)``, or
    ``(owner, function_op)`` where ``owner.function`` is taken by something other than a function
    container this pass made (``functions``, which it extends)."""
    owner, cls = owner_of(node, original)
    function = function_of(node, cls)
    if function is None:
        return owner, base
    name = base_name(function)
    scope = f"{owner}.{name}" if owner else name
    if scope in functions:
        return scope, base
    free = not (original is not None and holds(original, scope)) and not has_path(gm, scope)
    if free and _plain_or_absent(gm, owner):
        functions.add(scope)
        return scope, base
    return owner, f"{name}_{base_name(base)}"


def _plain_or_absent(gm: fx.GraphModule, path: str) -> bool:
    """Whether a container may be made under ``path`` in ``gm``: the root, a plain container, or nothing yet."""
    if not path or not has_path(gm, path):
        return True
    try:
        return type(gm.get_submodule(path)) is nn.Module
    except AttributeError:
        return False


def fresh_name(gm: fx.GraphModule, original: nn.Module | None, scope: str, base: str, taken: set[str]) -> str:
    """``scope.base``, else ``scope.base_1``, ``scope.base_2`` ... whichever is free everywhere."""
    base = base_name(base)
    prefix = f"{scope}." if scope else ""
    i = 0
    while True:
        candidate = f"{prefix}{base}" if i == 0 else f"{prefix}{base}_{i}"
        if (
            candidate not in taken
            and not has_path(gm, candidate)
            and (original is None or not has_path(original, candidate))
        ):
            taken.add(candidate)
            return candidate
        i += 1


def add_module(gm: fx.GraphModule, qualname: str, module: nn.Module) -> None:
    """``gm.add_submodule`` that reports failure loudly (it returns False on a clash)."""
    if not gm.add_submodule(qualname, module):
        raise RuntimeError(f"fxprep: cannot add module at {qualname!r}")
