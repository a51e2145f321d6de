"""The passes run inside ``torch.cond`` branches, after capture.

A prepared graph keeps a data-dependent branch as :func:`fxprep.cond.cond` over two branch
GraphModules. ``functional_to_module`` only walks the top graph, so without this pass a branch
could still call ``F.linear`` on raw weights while the report claimed "ops left functional: 0".
Each branch gets the same functional → module pass (its additions and leftovers are reported under
the branch's path). Then every call site gets its own module object across the graphs (see
:func:`_one_module_per_call_site`): a leaf called only inside a branch is the user's own module,
found at the branch's path (``cond_true_0.conv``); its weights' canonical state-dict keys stay the
original ones.
"""

from __future__ import annotations

import copy

import torch.fx as fx
from torch import nn

from ...cond import branch_modules, is_cond
from ...passes import functional_to_module, values
from ...passes.naming import add_module, fresh_name
from ...passes.unroll import shared_copy
from ...reporting.report import Report


def _prefixed(report: Report, path: str, added: int, left: int) -> None:
    for entry in report.added[added:]:
        entry.name = f"{path}.{entry.name}"
    for functional in report.left[left:]:
        functional.node = f"{path}.{functional.node}"
        functional.scope = f"{path}{'.' + functional.scope if functional.scope else ''}"


def _branches(gm: fx.GraphModule, prefix: str = "") -> list[tuple[str, fx.GraphModule]]:
    """Every branch graph under ``gm`` (nested ones too) with its path from the top."""
    out = []
    for node in gm.graph.nodes:
        if is_cond(node):
            for path, branch in branch_modules(gm, node):
                full = f"{prefix}{path}"
                out.append((full, branch))
                out += _branches(branch, f"{full}.")
    return out


def _one_module_per_call_site(gm: fx.GraphModule, original: nn.Module | None, share_parameters: bool,
                              report: Report | None) -> None:
    """A module called from the top graph and from a branch, or from two branches, gets one
    module object per call site (parameters shared, as the unroll pass does within one graph).
    Besides per-call-site statistics, this keeps every call site visible to a toolkit walking
    ``named_modules()``, which lists an object once: a branch calling the very object the top
    graph calls would keep calling the original after the toolkit swapped the top one."""
    branches = _branches(gm)
    if not branches:  # the usual case: nothing to look up (an LLM graph has thousands of call sites)
        return
    users = {id(m) for m in original.modules()} if original is not None else set()
    first: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            first.setdefault(id(gm.get_submodule(str(node.target))), str(node.target))
    for path, branch in branches:
        taken: set[str] = set()
        targets = [str(n.target) for n in branch.graph.nodes if n.op == "call_module"]
        for node in branch.graph.nodes:
            if node.op != "call_module":
                continue
            target = str(node.target)
            module = branch.get_submodule(target)
            if id(module) not in first:
                first[id(module)] = f"{path}.{target}"
                continue
            duplicate = shared_copy(module) if share_parameters else copy.deepcopy(module)
            parent_path, _, leaf = target.rpartition(".")
            parent = branch.get_submodule(parent_path) if parent_path else branch
            if targets.count(target) == 1 and id(parent) not in users:
                parent._modules[leaf] = duplicate  # the branch's only call of it: swap the object
            else:
                target = fresh_name(branch, None, parent_path, leaf, taken)
                add_module(branch, target, duplicate)
                node.target = target
            if report is not None:
                report.module_unrolled(first[id(module)], [f"{path}.{target}"], share_parameters)
        branch.recompile()


COND_REASON = "a data-dependent branch: one call choosing between its two module-level branch subgraphs"


def run(gm: fx.GraphModule, *, training: bool, report: Report | None = None, original: nn.Module | None = None,
        convert: bool = True, unroll: bool = True, share_parameters: bool = True) -> fx.GraphModule:
    """Convert the functional ops inside every ``cond`` branch of ``gm`` (nested ones included;
    ``convert``), then (``unroll``) give each call site across the graphs its own module object."""
    if convert:
        _convert(gm, training, report)
    if unroll:
        _one_module_per_call_site(gm, original, share_parameters, report)
    return gm


def _convert(gm: fx.GraphModule, training: bool, report: Report | None) -> None:
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
            _convert(branch, training, report)  # nested branches first: the prefix below covers them too
            if report is not None:
                _prefixed(report, path, added, left)
            branch.recompile()
