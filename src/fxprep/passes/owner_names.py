"""A layer made for a module's own raw parameter takes that module's path: ``mlp.gate``, not
``mlp.gate.linear``.

A module that calls ``F.linear`` on its own ``weight`` (Mixtral's router) is traced into, and the
functional-to-module pass makes an ``nn.Linear`` named in its scope. Where nothing else is at stake
(the container is fxprep's, its Parameters are exactly the layer's, nothing else calls it), the
Linear takes the container's place and the op modules it held move beside it, so toolkits configured
by the user's names find the layer and ``state_dict()`` is unchanged.

See docs/concepts/names.md ("Under the hood").
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx
from torch import nn

from ..reporting.report import Report
from .naming import fresh_name

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
    # The same Parameters under the same names: the layer's ``weight`` must be the owner's ``weight``
    # (a block's ``F.linear(x, self.proj)`` would move ``blk.proj`` to ``blk.weight``: a key the
    # user's state_dict does not have).
    mine = {name: id(p) for name, p in layer._parameters.items() if p is not None}
    theirs = {name: id(p) for name, p in owner._parameters.items() if p is not None}
    return bool(mine) and mine == theirs


def run(gm: fx.GraphModule, *, original: nn.Module | None = None, report: Report | None = None) -> list[tuple[str, str]]:
    """Rename each added layer that stands for its owner's raw parameters to the owner's path, and
    the op modules beside it in the owner to ``<owner>_<op>`` (see the module docstring); new names
    are also free in ``original``. Returns the (old, new) names. Edits ``gm`` in place; the caller recompiles."""
    added = {a.name for a in report.added} if report is not None else None
    made = {a.name for a in report.added if "on module parameters" in a.reason} if report is not None else None
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    called = set(calls)
    renamed: list[tuple[str, str]] = []
    taken: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or (made is not None and node.target not in made) or node.target not in calls:
            continue
        path = str(node.target)
        if not isinstance(gm.get_submodule(path), _LAYERS) or calls[path] != 1:
            continue
        if not _takes_owner_place(gm, path, called, added):
            continue
        owner_path, _, field = path.rpartition(".")
        parent_path, _, owner_field = owner_path.rpartition(".")
        parent, owner, layer = gm.get_submodule(parent_path), gm.get_submodule(owner_path), gm.get_submodule(path)
        moved = {path: owner_path}
        for name, child in list(owner._modules.items()):
            if name == field:
                continue
            new = fresh_name(gm, original, parent_path, f"{owner_field}_{name}", taken)
            parent._modules[new.rpartition(".")[2]] = child
            moved[f"{owner_path}.{name}"] = new
        parent._modules[owner_field] = layer
        for other in gm.graph.nodes:
            if other.op in ("call_module", "get_attr"):
                other.target = _moved(str(other.target), moved)
        called = {_moved(c, moved) for c in called}
        renamed.extend(moved.items())
        if report is not None:
            for entry in report.added:
                entry.name = _moved(entry.name, moved)
    return renamed


def _moved(target: str, moved: dict[str, str]) -> str:
    """``target`` after the moves (a moved module's own submodules and tensors move with it)."""
    for old, new in moved.items():
        if target == old:
            return new
        if target.startswith(f"{old}.") and old != next(iter(moved)):  # the layer itself has no children
            return new + target[len(old):]
    return target
