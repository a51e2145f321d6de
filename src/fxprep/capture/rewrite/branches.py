"""The passes run inside ``torch.cond`` branches, after capture.

A prepared graph keeps a data-dependent branch as :func:`fxprep.cond.cond` over two branch
GraphModules. ``functional_to_module`` only walks the top graph, so without this pass a branch
could still call ``F.linear`` on raw weights while the report claimed "ops left functional: 0".
Each branch gets the same functional → module pass (its additions and leftovers are reported under
the branch's path), then the user's leaf modules a branch calls are also placed at their own path
in the prepared module when that path is free, so ``gm.get_submodule("linear")`` is still the
user's ``nn.Linear``.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ...cond import branch_modules, is_cond
from ...passes import functional_to_module, values
from ...report import Report


def _prefixed(report: Report, path: str, added: int, left: int) -> None:
    for entry in report.added[added:]:
        entry.name = f"{path}.{entry.name}"
    for entry in report.left[left:]:
        entry.node = f"{path}.{entry.node}"
        entry.scope = f"{path}{'.' + entry.scope if entry.scope else ''}"


def _holds_only(container: nn.Module, module: nn.Module) -> bool:
    """Whether ``container`` is a plain stand-in holding only tensors of ``module`` at the same
    names (the re-lifting placed the weights a branch used to take as operands there)."""
    if type(container) is not nn.Module:
        return False
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    held = dict(container.named_parameters()) | dict(container.named_buffers())
    return all(own.get(k) is v for k, v in held.items())


def _leaves_at_root(gm: fx.GraphModule, branch: fx.GraphModule, original: nn.Module | None) -> None:
    if original is None:
        return
    users = {id(m) for m in original.modules()}
    for node in branch.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        module = branch.get_submodule(target)
        try:
            if original.get_submodule(target) is not module:
                continue  # not the user's module at that path: it belongs to the branch only
        except AttributeError:
            continue
        parent, _, leaf = target.rpartition(".")
        holder: nn.Module = gm
        for atom in filter(None, parent.split(".")):
            child = holder._modules.get(atom)
            if child is None:
                child = nn.Module()
                holder.add_module(atom, child)
            elif type(child) is not nn.Module or id(child) in users:
                break  # a user module holds this path: never add to it
            holder = child
        else:
            existing = holder._modules.get(leaf)
            if existing is None or (id(existing) not in users and _holds_only(existing, module)):
                holder._modules[leaf] = module


COND_REASON = "a data-dependent branch: one call choosing between its two module-level branch subgraphs"


def run(gm: fx.GraphModule, *, training: bool, report: Report | None = None,
        original: nn.Module | None = None) -> fx.GraphModule:
    """Convert the functional ops inside every ``cond`` branch of ``gm`` (nested ones included)."""
    for node in list(gm.graph.nodes):
        if not is_cond(node):
            continue
        if report is not None:
            for entry in report.left:
                if entry.node == node.name and entry.target == "fxprep.cond.cond":
                    entry.reason = COND_REASON
        for path, branch in branch_modules(gm, node):
            values.annotate(branch)
            added, left = (len(report.added), len(report.left)) if report is not None else (0, 0)
            functional_to_module.run(branch, training=training, report=report, recompile=False)
            if report is not None:
                _prefixed(report, path, added, left)
            run(branch, training=training, report=report, original=None)
            branch.recompile()
            _leaves_at_root(gm, branch, original)
    return gm
