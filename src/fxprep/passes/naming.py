"""Readable, deterministic, collision-free names for the modules passes add.

A new module lives under the scope it came from (``layer1.0.add``, ``layer1.0.relu_1``). A name is
taken only if neither the prepared module nor the original model has anything at that path, so a
user's own ``relu_1`` attribute (even one the graph never touches) is never shadowed.
"""

from __future__ import annotations

import re

import torch.fx as fx
from torch import nn

from ..paths import has_path


def scope_of(node: fx.Node) -> str:
    """Qualified name of the module whose forward produced ``node`` ('' for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


_CLEAN = re.compile(r"[^0-9a-zA-Z_]+")


def base_name(text: str) -> str:
    text = _CLEAN.sub("_", text).strip("_").lower()
    if not text or text[0].isdigit():
        text = f"op_{text}"
    return text


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
