"""Dotted attribute paths in module trees (``'layers.0.mlp.weight'``): read, test, place.

A graph names what it uses by path (``call_module`` and ``get_attr`` targets). Capture, stamping
and the naming passes all resolve such paths or put objects at them; they must agree on how: a
submodule is found in ``_modules`` first (an attribute miss on a module raises inside
``nn.Module.__getattr__``, slow in a loop over layers), containers made on the way are plain
``nn.Module``s, tensors are registered as parameters or buffers the way ``torch.fx`` does, and a
module of the user's is never written into.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn


def get_path(root: Any, path: str) -> Any:
    """``root.a.b.c`` for ``path`` ``'a.b.c'``; raises ``AttributeError`` where a step is missing."""
    return operator.attrgetter(path)(root)


def has_path(root: Any, path: str) -> bool:
    """Whether ``root`` has anything at ``path``, without raising from inside ``__getattr__``."""
    *steps, last = path.split(".")
    obj: Any = root
    for atom in steps:
        if isinstance(obj, nn.Module) and atom in obj._modules:
            obj = obj._modules[atom]
        elif hasattr(obj, atom):
            obj = getattr(obj, atom)
        else:
            return False
    if isinstance(obj, nn.Module) and type(obj).__getattr__ is nn.Module.__getattr__:
        return (last in obj._modules or last in obj._parameters or last in obj._buffers or last in obj.__dict__
                or hasattr(type(obj), last))
    return hasattr(obj, last)


def holds(root: nn.Module, path: str) -> bool:
    """Whether ``root`` has a submodule, parameter or buffer at ``path`` (a method or a plain
    attribute there does not count: a container fxprep makes may take that name)."""
    for find in (root.get_submodule, root.get_parameter, root.get_buffer):
        try:
            find(path)
            return True
        except AttributeError:
            continue
    return False


def install(holder: nn.Module, path: str, obj: Any) -> None:
    """Put ``obj`` at ``path`` in ``holder``, creating plain containers on the way.

    Never inside a module that is not a plain container (one of the user's): where the path runs
    through one that already holds ``obj`` there, nothing is needed; anything else raises
    ``ValueError``, since placing it would change the user's model."""
    *prefix, leaf = path.split(".")
    container = holder
    for i, atom in enumerate(prefix):
        nxt = container._modules.get(atom)
        if nxt is None:
            nxt = nn.Module()
            container.add_module(atom, nxt)
        elif type(nxt) is not nn.Module:
            rest = ".".join(prefix[i + 1:] + [leaf])
            if has_path(nxt, rest) and get_path(nxt, rest) is obj:
                return
            raise ValueError(f"cannot place {path!r}: '{'.'.join(prefix[:i + 1])}' is a module of the model "
                             f"({type(nxt).__name__}), which is never written into")
        container = nxt
    if isinstance(obj, nn.Module):
        container.add_module(leaf, obj)
    elif isinstance(obj, nn.Parameter):
        container.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        container.register_buffer(leaf, obj)
    else:
        setattr(container, leaf, obj)
