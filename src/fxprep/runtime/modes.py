"""Process modes a graph enters, left on every path: an op that raises inside a region does not leave
the region's mode on for the whole process.

A graph runs ``torch.autocast`` regions (and other mode switches) as plain enter and exit calls, so
an op raising in between would leave the mode on. :func:`entered` finds from the graph which modes
it can enter; :func:`snapshot` reads them before a run and :func:`restore` puts them back after a
run that raised. :class:`fxprep.runtime.prepared.PreparedModule` and :mod:`fxprep.io.selfcheck` use
it. This module depends only on :mod:`fxprep.ops`.

See docs/security.md ("Global state: modes left on every path").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import ops

AUTOCAST_ENTER = torch.amp.autocast_mode._enter_autocast
AUTOCAST_EXIT = torch.amp.autocast_mode._exit_autocast
GRAD_TOGGLES = frozenset({torch._C._set_grad_enabled})
GRAD = "grad"  # the mode key of grad mode; autocast's are its device types ("cpu", "cuda")


def call_of(node: fx.Node, root: nn.Module) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """(callable, args, kwargs) of a ``call_function`` node, or of a ``call_module`` node of an op
    module (its argument template filled with the node's arguments); None for anything else."""
    if node.op == "call_function":
        return node.target, tuple(node.args), dict(node.kwargs)
    if node.op != "call_module" or not isinstance(node.target, str):
        return None
    try:
        module = root.get_submodule(node.target)
    except AttributeError:
        return None
    if not isinstance(module, ops.BoundOp):
        return None
    return module.fn, ops.filled(tuple(module.args), node.args), ops.filled(dict(module.kwargs), node.args)


def _mode_of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if fn is AUTOCAST_ENTER:
        device = args[0] if args else kwargs.get("device_type")
        return device if isinstance(device, str) else "cpu"
    if any(fn is toggle for toggle in GRAD_TOGGLES):  # by identity: a callable need not hash
        return GRAD
    return None


def entered(root: nn.Module) -> tuple[str, ...]:
    """The modes ``root``'s graphs (its own and nested ones) can enter: autocast's device types and
    ``"grad"``, sorted; empty for a graph that switches none (the common case: nothing to do per call)."""
    found: set[str] = set()
    for module in root.modules():
        if isinstance(module, ops.BoundOp):  # an op module: its callable and literal arguments (no lookups)
            mode = _mode_of(module.fn, tuple(module.args), dict(module.kwargs))
        elif isinstance(module, fx.GraphModule) and isinstance(module.__dict__.get("_graph"), fx.Graph):
            for node in module.__dict__["_graph"].nodes:
                if node.op == "call_function" and (mode := _mode_of(node.target, tuple(node.args), dict(node.kwargs))):
                    found.add(mode)
            continue
        else:
            continue
        if mode is not None:
            found.add(mode)
    return tuple(sorted(found))


def _autocast(device: str) -> tuple[bool, torch.dtype] | None:
    try:
        return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except (RuntimeError, ValueError, TypeError):  # a device type this torch has no autocast for
        return None


def _nesting() -> int:
    """autocast's nesting level (torch has no getter: one step up and back, which changes nothing)."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


def snapshot(modes: tuple[str, ...]) -> tuple[Any, ...]:
    """The state of ``modes`` (as :func:`entered` names them) now, for :func:`restore`."""
    devices = tuple((m, _autocast(m)) for m in modes if m != GRAD)
    return (torch.is_grad_enabled() if GRAD in modes else None, devices, torch.is_autocast_cache_enabled(),
            _nesting() if devices else 0)


def restore(state: tuple[Any, ...]) -> None:
    """Put back what :func:`snapshot` read, as the regions' own exits would have (see the module
    docstring); nothing that was not read is touched."""
    grad, devices, cache, nesting = state
    if grad is not None and torch.is_grad_enabled() != grad:
        torch._C._set_grad_enabled(grad)
    if not devices:
        return
    for device, before in devices:
        if before is not None and _autocast(device) != before:
            torch.set_autocast_enabled(device, before[0])
            torch.set_autocast_dtype(device, before[1])
    level = _nesting()
    while level > nesting:
        level = torch.autocast_decrement_nesting()
        if level == 0:
            torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(cache)
