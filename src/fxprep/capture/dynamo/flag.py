"""The flag route: Dynamo emits ``call_module`` for ``torch.nn`` leaves itself.

With ``torch._dynamo.config.install_free_tensors_for_export = False`` (a private flag announced as
temporary: feature-detected in :mod:`.export`, never version-pinned) Dynamo keeps ``torch.nn``
leaves as ``call_module`` nodes with their exact arguments. They only need re-targeting onto the
user's modules. This module recognises the two shapes such calls take in Dynamo's graph; whatever
the flag route leaves inlined (user-named leaves) goes through the regroup route's machinery.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch import nn

from ...core.paths import get_path
from .names import Group, Names, Stacks, frames_meta


def direct_call(group: Group, stacks: Stacks) -> fx.Node | None:
    """The ``call_module`` node that is the whole of ``group``, if Dynamo made one.

    Dynamo files the ``getitem`` that unpacks a leaf's tuple output (``nn.MultiheadAttention``'s
    ``out, _ = attn(x, x, x)``) under the leaf's own stack entry. Such a group is still one call:
    it needs no eager recording (which costs a forward), only the accesses moved to the caller's
    stack.
    """
    calls = [n for n in group.nodes if n.op == "call_module" and len(stacks.of(n)) == len(group.frames)]
    if len(calls) != 1:
        return None
    call = calls[0]
    accesses = [n for n in group.nodes if n is not call]
    if not all(n.op == "call_function" and n.target is operator.getitem and n.args[0] is call for n in accesses):
        return None
    parent = frames_meta(group.frames[:-1])
    for n in accesses:
        n.meta["nn_module_stack"] = dict(parent)
    return call


def module_method_calls(dgm: fx.GraphModule, names: Names, stacks: Stacks) -> dict[fx.Node, str]:
    """``get_attr(module).forward(x)`` (Dynamo's form for some ``torch.nn`` subclasses that keep the
    parent's forward, e.g. transformers' ``PoolFormerGroupNorm(nn.GroupNorm)``) → ``call_module``."""
    graph = dgm.graph
    found: dict[fx.Node, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in ("forward", "__call__") or not node.args:
            continue
        owner = node.args[0]
        if not isinstance(owner, fx.Node) or owner.op != "get_attr":
            continue
        obj = get_path(dgm, str(owner.target))
        if not isinstance(obj, nn.Module):
            continue
        name = names.module_name(obj)
        if name is None:
            frames = [f for f in stacks.of(node) if f.module is not None and type(f.module) is type(obj)]
            name = names.module_name(frames[-1].module) if frames else None
        if name is None:
            continue
        with graph.inserting_before(node):
            call = graph.call_module(name, tuple(node.args[1:]), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        found[call] = name
    return found
