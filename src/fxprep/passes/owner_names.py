"""A layer made for a module's own raw parameter takes that module's path: ``mlp.gate``, not ``mlp.gate.linear``.

transformers' Mixtral router is a module (``mlp.gate``) holding a ``weight`` Parameter and calling
``F.linear(x, self.weight)`` itself, then a softmax and a top-k. The functional-to-module pass turns
that call into an ``nn.Linear`` sharing the Parameter, named in the router's scope like any added
op (``mlp.gate.linear``), a name the user's model does not have. A toolkit configured by the user's
names (torchao PT2E's ``set_module_name_qconfig("model.layers.0.mlp.gate", None)``, AIMET or NNCF
ignored scopes) then misses the layer. The router has no layer of its own in the prepared graph
(it is traced into, and kept as a plain container of what its forward was turned into), so the
Linear can take its place: the container's children (``softmax``, ``topk``...) move under the
Linear, and the Parameter keeps its path (``mlp.gate.weight``), so ``state_dict()`` is unchanged.

Only where nothing else is at stake: the container is one fxprep created (never a user module),
its Parameters are exactly the layer's (no buffer besides), every module under it is one fxprep
added (a user's block holding a LayerNorm beside its own ``F.linear`` stays the block), and no
node calls the container.
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx
from torch import nn

from ..report import Report

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
           nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.PReLU)


def _takes_owner_place(gm: fx.GraphModule, path: str, called: set[str], made: set[str] | None) -> bool:
    owner_path, _, _ = path.rpartition(".")
    if not owner_path or owner_path in called:
        return False
    children = [f"{owner_path}.{name}" for name in gm.get_submodule(owner_path)._modules]
    if made is not None and not all(child in made for child in children):
        return False  # a block with layers of its own (a user's LayerNorm beside its F.linear) stays a block
    layer = gm.get_submodule(path)
    owner = gm.get_submodule(owner_path)
    if type(owner) is not nn.Module or owner._buffers:  # a user module, or one holding more state
        return False
    mine = {id(p) for p in layer._parameters.values() if p is not None}
    theirs = {id(p) for p in owner._parameters.values() if p is not None}
    return bool(mine) and mine == theirs


def run(gm: fx.GraphModule, *, report: Report | None = None) -> list[tuple[str, str]]:
    """Rename each added layer that stands for its owner's raw parameters to the owner's path (see
    the module docstring). Returns the (old, new) names. Edits ``gm`` in place; the caller recompiles."""
    added = {a.name for a in report.added} if report is not None else None
    made = {a.name for a in report.added if "on module parameters" in a.reason} if report is not None else None
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    called = set(calls)
    renamed = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or (made is not None and node.target not in made):
            continue
        path = str(node.target)
        if not isinstance(gm.get_submodule(path), _LAYERS) or calls[path] != 1:
            continue
        if not _takes_owner_place(gm, path, called, added):
            continue
        owner_path, _, field = path.rpartition(".")
        parent_path, _, owner_field = owner_path.rpartition(".")
        parent, owner, layer = gm.get_submodule(parent_path), gm.get_submodule(owner_path), gm.get_submodule(path)
        for name, child in owner._modules.items():
            if name != field:
                layer._modules[name] = child
        parent._modules[owner_field] = layer
        node.target = owner_path
        called.discard(path)
        called.add(owner_path)
        renamed.append((path, owner_path))
        if report is not None:
            for entry in report.added:
                if entry.name == path:
                    entry.name = owner_path
    return renamed
