"""Process-state regions in a loaded graph: autocast entered and left in balanced pairs.

A save's graph may hold ``with torch.autocast(...):`` regions (timm's EfficientViT keeps float32
islands), which Dynamo records as an ``_enter_autocast`` call and an ``_exit_autocast`` call of its
result (fxprep's functional → module pass makes them ``Functional`` op modules). Entering without
leaving would switch autocast for the whole process at the module's first call: the user's later
float32 ``mm`` would return bfloat16. So :func:`check_state_regions` checks, before anything runs,
that every region a graph opens it closes exactly once (issue 28). Every other process-state
changer is simply not on the reviewed allow-list (:mod:`.reviewed`).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from .. import ops
from ..errors import SerializationError
from . import allowlist


def autocast_role(node: fx.Node, root: nn.Module) -> tuple[str, Any] | None:
    """("enter", None) or ("exit", the value it closes) for an autocast enter/exit call, as a function
    call or as an op module calling one (the functional → module pass makes them ``Functional`` ops)."""
    if node.op == "call_function":
        fn, closes = node.target, (node.args[0] if len(node.args) == 1 and not node.kwargs else None)
    elif node.op == "call_module":
        module = root.get_submodule(node.target)
        if not isinstance(module, ops.BoundOp):
            return None
        fn = module.fn
        slot = module.args[0] if len(module.args) == 1 and not module.kwargs else None
        closes = (node.args[slot.index] if isinstance(slot, ops.Slot) and slot.index < len(node.args) and not node.kwargs
                  else None)
    else:
        return None
    if fn is allowlist.AUTOCAST_ENTER:
        return "enter", None
    if fn is allowlist.AUTOCAST_EXIT:
        return "exit", closes
    return None


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
