"""``torch.cond`` in a Dynamo graph, re-lifted like the rest of the graph.

Dynamo's ``cond`` branches inline every module and take weights as extra operands. In each branch,
leaf-module calls are collapsed back into ``call_module`` nodes of the user's modules, weight
operands become ``get_attr`` nodes, and the HOP becomes :func:`fxprep.cond.cond`. Each re-lifted
branch is checked against Dynamo's on random operands; one that does not match keeps Dynamo's form
(reported).

See docs/concepts/control-flow.md ("Under the hood").
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ...cond import cond
from ...core.paths import get_path, has_path, install
from ..common import LeafPolicy
from .names import Frame, Stacks, default_leaf, frames_meta

HOP = getattr(torch.ops.higher_order, "cond", None)


def _one_input(module: nn.Module) -> bool:
    """Whether the module's ``forward`` takes exactly one required argument."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


class _Branch:
    """One branch subgraph being re-lifted (on a copy of its graph)."""

    def __init__(self, branch: fx.GraphModule, params: dict[int, str], stacks: Stacks, policy: LeafPolicy):
        self.original = branch
        self.graph = fx.Graph()
        self.graph.output(self.graph.graph_copy(branch.graph, {}))
        self.params = params
        self.model = stacks.model
        self.names = stacks.names
        self.stacks = stacks
        self.policy = policy
        self.holder = nn.Module()
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.notes: list[str] = []

    def is_leaf(self, module: nn.Module | None) -> bool:
        return module is not None and module is not self.model and (self.policy.reason(module) is not None or default_leaf(module))

    def collapse(self) -> None:
        groups: dict[str, tuple[Frame, list[fx.Node]]] = {}
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            for frame in self.stacks.of(node):
                if self.is_leaf(frame.module):
                    groups.setdefault(frame.key, (frame, []))[1].append(node)
                    break
        for frame, nodes in groups.values():
            self._collapse(frame, nodes)

    def _collapse(self, frame: Frame, nodes: list[fx.Node]) -> None:
        module = frame.module
        name = self.names.module_name(module)
        if module is None or name is None or not _one_input(module):
            self.notes.append(f"'{frame.qualname}' inside a cond branch is left inlined (not a one-input leaf call)")
            return
        members = set(nodes)
        own = {i for i, q in self.params.items() if q.startswith(name + ".")}
        ext_in: dict[fx.Node, None] = {}
        for n in nodes:
            for inp in n.all_input_nodes:
                if inp not in members and not (inp.op == "placeholder" and self.placeholders.index(inp) in own):
                    ext_in.setdefault(inp, None)
        ext_out = [n for n in nodes if any(u not in members for u in n.users)]
        if len(ext_in) != 1 or len(ext_out) != 1:
            self.notes.append(f"'{name}' inside a cond branch is left inlined ({len(ext_in)} inputs, {len(ext_out)} outputs)")
            return
        (x,) = ext_in
        with self.graph.inserting_after(nodes[-1]):
            call = self.graph.call_module(name, (x,))
        call.meta["nn_module_stack"] = frames_meta(self.stacks.of(nodes[0])[: self.stacks.of(nodes[0]).index(frame) + 1])
        call.meta["example_value"] = ext_out[0].meta.get("example_value")
        ext_out[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in members)
        for n in reversed(nodes):
            self.graph.erase_node(n)
        install(self.holder, name, module)

    def localise_params(self) -> None:
        """Parameter operands → ``get_attr`` of the user's tensors; their placeholders go."""
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        for i, qualname in self.params.items():
            ph = self.placeholders[i]
            if ph.users:
                with self.graph.inserting_before(first):
                    attr = self.graph.get_attr(qualname)
                attr.meta = dict(ph.meta)
                ph.replace_all_uses_with(attr)
                install(self.holder, qualname, get_path(self.model, qualname))
            self.graph.erase_node(ph)

    def finish(self) -> fx.GraphModule:
        for node in self.graph.nodes:  # nested branches and anything else the branch reads
            if node.op == "get_attr" and not has_path(self.holder, str(node.target)):
                install(self.holder, str(node.target), get_path(self.original, str(node.target)))
            frames = self.stacks.of(node) if node.meta.get("nn_module_stack") else []
            if frames and not node.meta.get("fxprep_fx_stack"):
                node.meta["nn_module_stack"] = {f.qualname if f.k == 0 else f"{f.qualname}@{f.k}": (f.qualname, f.cls)
                                                for f in frames}
                node.meta["fxprep_fx_stack"] = True
        self.graph.lint()
        return fx.GraphModule(self.holder, self.graph, type(self.original).__name__)


def _random_like(node: fx.Node) -> Any:
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        raise ValueError("no example value")
    shape = [int(getattr(getattr(s, "node", None), "hint", s)) for s in value.shape]
    gen = torch.Generator().manual_seed(len(shape) + 7)
    if value.is_floating_point():
        return torch.randn(shape, dtype=value.dtype, generator=gen)
    if value.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 3, shape, dtype=value.dtype, generator=gen)


def _same(original: fx.GraphModule, new: fx.GraphModule, operands: list[Any], kept: list[int]) -> bool | None:
    """Whether both branches compute the same on random operands (None: cannot tell)."""
    try:
        inputs = [_random_like(n) if not isinstance(v, torch.Tensor) else v for n, v in operands]
        with torch.no_grad():
            a = original(*inputs)
            b = new(*[inputs[i] for i in kept])
    except Exception:  # noqa: BLE001 - random operands may be out of a branch's domain
        return None
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
        and torch.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True) for x, y in zip(flat_a, flat_b)
    )


def relift_conds(gm: fx.GraphModule, stacks: Stacks, policy: LeafPolicy, notes: list[str]) -> None:
    """Re-lift every ``torch.cond`` of ``gm`` (and of its branches) in place (``stacks``: the
    model's frames resolver, holding the model and its names)."""
    names = stacks.names
    if HOP is None:
        return
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not HOP or len(node.args) != 4:
            continue
        pred, t_attr, f_attr, operands = node.args
        if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (t_attr, f_attr)):
            continue
        operands = list(operands)
        params: dict[int, str] = {}
        values: list[tuple[fx.Node, Any]] = []
        for i, op in enumerate(operands):
            obj = get_path(gm, str(op.target)) if isinstance(op, fx.Node) and op.op == "get_attr" else None
            values.append((op, obj))
            if isinstance(obj, torch.Tensor) and id(obj) in names.tensors:
                params[i] = names.tensors[id(obj)][0]
        new_branches = []
        for attr in (t_attr, f_attr):
            original = gm.get_submodule(str(attr.target))
            branch = _Branch(original, params, stacks, policy)
            branch.collapse()
            branch.localise_params()
            lifted = branch.finish()
            relift_conds(lifted, stacks, policy, notes)
            placeholders = [n for n in original.graph.nodes if n.op == "placeholder"]
            kept = [i for i in range(len(operands)) if i not in params]
            same = _same(original, lifted, list(zip(placeholders, [v for _, v in values])), kept)
            if same is False:
                notes.append(f"a torch.cond branch ({attr.target}) could not be re-lifted to module level exactly; "
                             f"it keeps Dynamo's functional form")
                break
            notes.extend(branch.notes)
            new_branches.append(lifted)
        else:
            for attr, lifted in zip((t_attr, f_attr), new_branches):
                setattr(gm, str(attr.target), lifted)
            kept_ops = tuple(op for i, op in enumerate(operands) if i not in params)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(cond, (pred, t_attr, f_attr, kept_ops))
            new.meta = dict(node.meta)
            new.meta["is_wrapped"] = True
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            for op in operands:
                if isinstance(op, fx.Node) and op.op == "get_attr" and not op.users:
                    gm.graph.erase_node(op)
    gm.graph.lint()
    gm.recompile()
