"""AIMET's names for the modules a preparation adds (``style="aimet"``).

:func:`fxprep.compat.aimet.prepare_model` renames the modules fxprep added the way AIMET would have
named them for the same graph: ``module_<fx node name>`` for a functional op, under the module whose
``forward`` made it where AIMET's GraphModule has that path, and ``module_<child>_<k>`` for a reused
module's extra call sites, numbered by fx's own namer. Only the names change.

See docs/handoff/aimet.md ("Under the hood").
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ..core.paths import has_path
from ..reporting.report import Report

# ``operator.iadd`` is recorded by Dynamo (and fxprep's fx tracer); a plain fx trace sees ``a + b``.
_IN_PLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
                                 "iand", "ior", "ixor", "ilshift", "irshift"})
PREFIX = "module_"


def _origin_name(origin: str) -> str:
    """The name fx gives a node calling ``origin`` (``operator.add`` → ``add``, ``Tensor.relu`` → ``relu``)."""
    name = origin.rpartition(".")[2]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    if name in _IN_PLACE_OPERATORS:
        name = name[1:]
    return name


def fx_node_names(gm: fx.GraphModule, original: nn.Module) -> dict[fx.Node, str]:
    """The name ``torch.fx`` would give each node of ``gm`` had it traced the original model."""
    namespace = fx.graph._Namespace()
    to_str = fx.Graph()._target_to_str
    originals = {id(m) for m in original.modules()}
    names: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            candidate = "output"
        elif node.op == "call_module" and "fxprep_unrolled_from" in node.meta:
            candidate = to_str(str(node.meta["fxprep_unrolled_from"]))
        elif node.op == "call_module" and id(gm.get_submodule(str(node.target))) not in originals \
                and "fxprep_origin" in node.meta:
            candidate = to_str(_origin_name(str(node.meta["fxprep_origin"])))
        elif node.op in ("placeholder", "get_attr", "call_module", "call_method"):
            candidate = to_str(str(node.target))
        else:
            candidate = to_str(node.target)
        names[node] = namespace.create_name(candidate, None)
    return names


def _used_paths(gm: fx.GraphModule, added: set[str]) -> set[str]:
    """Module paths AIMET's GraphModule has: every prefix of a target the graph uses (fxprep's own
    additions aside), as ``torch.fx.GraphModule(root, graph)`` creates only those."""
    paths = {""}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and str(node.target) not in added:
            parts = str(node.target).split(".")
            paths.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return paths


def _move(gm: fx.GraphModule, old: str, new: str) -> None:
    parent_path, _, leaf = old.rpartition(".")
    parent = gm.get_submodule(parent_path)
    module = parent._modules.pop(leaf)
    if not gm.add_submodule(new, module):
        raise RuntimeError(f"fxprep: cannot add module at {new!r}")


def _drop_empty_containers(gm: fx.GraphModule, original: nn.Module, paths: set[str]) -> None:
    """Remove plain containers fxprep created that moving modules left empty (deepest first)."""
    originals = {id(m) for m in original.modules()}
    for path in sorted(paths, key=lambda p: -p.count(".")):
        if not path or not has_path(gm, path):
            continue
        module = gm.get_submodule(path)
        if id(module) in originals or type(module) is not nn.Module:
            continue
        if not module._modules and not module._parameters and not module._buffers:
            parent_path, _, leaf = path.rpartition(".")
            del gm.get_submodule(parent_path)._modules[leaf]


def run(gm: fx.GraphModule, *, original: nn.Module, report: Report | None = None) -> fx.GraphModule:
    """Rename the modules fxprep added (functional → module, unrolled copies) to AIMET's names."""
    names = fx_node_names(gm, original)
    originals = {id(m) for m in original.modules()}
    added_nodes = [n for n in gm.graph.nodes if n.op == "call_module"
                   and id(gm.get_submodule(str(n.target))) not in originals]
    added_targets = {str(n.target) for n in added_nodes}
    existing = _used_paths(gm, added_targets)
    renamed: dict[str, str] = {}
    emptied: set[str] = set()
    for node in added_nodes:
        old = str(node.target)
        parent, _, leaf = old.rpartition(".")
        if "fxprep_unrolled_from" in node.meta:
            child = str(node.meta["fxprep_unrolled_from"]).rpartition(".")[2]
            base, _, k = names[node].rpartition("_")
            leaf_new = f"{PREFIX}{child}_{k}" if base and k.isdigit() else f"{PREFIX}{names[node]}"
            new_parent = parent
        elif "fxprep_origin" in node.meta:
            leaf_new = f"{PREFIX}{names[node]}"
            new_parent = parent if parent in existing else ""
        else:
            continue
        new = f"{new_parent}.{leaf_new}" if new_parent else leaf_new
        if new == old:
            continue
        if has_path(gm, new) or has_path(original, new):
            if report is not None:
                report.note(f"AIMET would name '{old}' '{new}', which is taken in the model; kept '{old}'.")
            continue
        _move(gm, old, new)
        node.target = new
        renamed[old] = new
        parts = parent.split(".") if parent else []
        emptied.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    _drop_empty_containers(gm, original, emptied)
    if report is not None:
        for added in report.added:
            added.name = renamed.get(added.name, added.name)
        for unrolled in report.unrolled:
            unrolled.copies = [renamed.get(c, c) for c in unrolled.copies]
        if renamed:
            report.note(f"{len(renamed)} added module(s) renamed to AIMET's names (module_<fx node name>).")
    return gm
