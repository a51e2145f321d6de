"""Unroll reused modules: one module per call site.

Quantizers keep per-module statistics, so a module called from two places must become two modules.
The extra call sites get a *shallow* copy: a new module object of the same class whose parameter and
buffer slots hold the very same tensors. Weights stay tied (one optimiser step updates all call
sites), memory does not grow, and ``named_parameters()`` still lists each weight once. Tools that
need independent weights ask for ``share_parameters=False`` and get deep copies.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch.fx as fx
from torch import nn

from ..reporting.report import Report
from .naming import add_module, fresh_name


def shared_copy(module: nn.Module) -> nn.Module:
    """A new module of the same class sharing every parameter, buffer and child of ``module``.

    Only the containers are new (so registering something on the copy does not touch the original);
    the tensors inside them are the original objects.
    """
    new = module.__class__.__new__(module.__class__)
    state = {}
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, OrderedDict, set)):
            value = value.copy()
        state[key] = value
    new.__dict__.update(state)
    return new


def run(gm: fx.GraphModule, *, share_parameters: bool = True, original: nn.Module | None = None,
        report: Report | None = None, recompile: bool = True) -> fx.GraphModule:
    """Give every ``call_module`` node its own module object (identity decides reuse, not names)."""
    calls: dict[int, list[fx.Node]] = {}
    modules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not one per node (LLM graphs: thousands)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = modules.get(str(node.target))
            calls.setdefault(id(module if module is not None else gm.get_submodule(node.target)), []).append(node)
    taken: set[str] = set()
    for nodes in calls.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        module = gm.get_submodule(first.target)
        copies = []
        for node in nodes[1:]:
            parent, _, leaf = str(node.target).rpartition(".")
            name = fresh_name(gm, original, parent, leaf, taken)
            add_module(gm, name, shared_copy(module) if share_parameters else copy.deepcopy(module))
            node.target = name
            node.meta["fxprep_unrolled_from"] = first.target
            copies.append(name)
        if report is not None:
            report.module_unrolled(str(first.target), copies, share_parameters)
    if recompile:
        gm.recompile()
    return gm
