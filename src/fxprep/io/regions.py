"""Process-state regions in a loaded graph: autocast entered and left in balanced pairs.

A save's graph may hold ``with torch.autocast(...):`` regions (timm's EfficientViT keeps float32
islands), which Dynamo records as an ``_enter_autocast`` call and an ``_exit_autocast`` call of its
result (fxprep's functional → module pass makes them ``Functional`` op modules). Entering without
leaving would switch autocast for the whole process at the module's first call: the user's later
float32 ``mm`` would return bfloat16. So :func:`check_state_regions` checks, before anything runs,
that every region a graph opens it closes exactly once (issue 28), with the arguments written into
the graph (a device type and dtype torch.autocast knows: issue 63). A region whose inside raises is
still left: :mod:`fxprep.runtime.modes` puts the mode back after such a run, at load and at each call. Every
other process-state changer is simply not on the allow-list (:mod:`.reviewed`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import SerializationError
from ..runtime import modes
from . import allowlist

# the device types an autocast region of a save may name (torch.amp.autocast's own), and its dtypes
_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia"})
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def autocast_role(node: fx.Node, root: nn.Module) -> tuple[str, Any] | None:
    """("enter", its arguments) or ("exit", the value it closes) for an autocast enter/exit call, as a
    function call or as an op module calling one (the functional → module pass makes them
    ``Functional`` ops)."""
    call = modes.call_of(node, root)
    if call is None:
        return None
    fn, args, kwargs = call
    if fn is allowlist.AUTOCAST_ENTER:
        return "enter", (args, kwargs)
    if fn is allowlist.AUTOCAST_EXIT:
        return "exit", args[0] if len(args) == 1 and not kwargs else None
    return None


def _check_enter(node: fx.Node, arguments: Any) -> None:
    """An enter's arguments as torch.autocast takes them, written into the graph: a device type
    torch.autocast knows, a floating dtype (or None), and literal flags. A region entered with a
    device or dtype computed by the graph could not be checked here, nor left by :mod:`fxprep.runtime.modes`."""
    args, kwargs = arguments
    values = dict(zip(("device_type", "dtype", "enabled", "cache_enabled"), args), **kwargs)
    device, dtype = values.get("device_type"), values.get("dtype")
    ok = (len(args) <= 4 and set(values) <= {"device_type", "dtype", "enabled", "cache_enabled"}
          and isinstance(device, str) and device in _DEVICES and (dtype is None or dtype in _DTYPES)
          and type(values.get("enabled", True)) is bool and values.get("cache_enabled") in (None, True, False))
    if not ok:
        raise SerializationError(f"refusing to load: the autocast region opened at node {node.name!r} is entered with "
                                 f"arguments torch.autocast does not take as written there ({str(values)[:120]}).")


def check_state_regions(graph: fx.Graph, root: nn.Module) -> None:
    """Autocast regions (``with torch.autocast(...):`` in the model, kept by Dynamo as an enter and an
    exit call) must be balanced: each enter's result is passed to exactly one exit, later in the
    graph, and to nothing else; each exit closes an enter. A save whose graph enters autocast without
    leaving it would switch autocast on for the rest of the process at its first call (the user's
    later float32 ``mm`` returning bfloat16)."""
    enters: dict[fx.Node, int] = {}
    roles = {node: autocast_role(node, root) for node in graph.nodes}
    for node, role in roles.items():
        if role is None:
            continue
        if role[0] == "enter":
            _check_enter(node, role[1])
            enters[node] = 0
            if any((roles.get(user) or ("",))[0] != "exit" for user in node.users):
                raise SerializationError(f"refusing to load: the autocast region opened at node {node.name!r} is used "
                                         f"by something other than its exit.")
        else:
            if not isinstance(role[1], fx.Node) or role[1] not in enters:
                raise SerializationError(f"refusing to load: node {node.name!r} leaves an autocast region it did not enter.")
            enters[role[1]] += 1
    unbalanced = [n.name for n, exits in enters.items() if exits != 1]
    if unbalanced:
        raise SerializationError(
            f"refusing to load: the autocast region(s) entered at {unbalanced[:5]} are not left exactly once; a call "
            f"would leave autocast switched for the whole process.")
