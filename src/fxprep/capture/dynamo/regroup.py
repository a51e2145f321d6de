"""The regroup route: collapse each inlined leaf call back into one ``call_module``.

Needs no private flag: Dynamo inlines every module, and the nodes of each leaf call (found by their
``nn_module_stack`` key, ``"<key>@k"`` for the k-th call of a reused module) are collapsed into one
``call_module`` of the user's module. The call's arguments (several inputs, keyword arguments,
non-tensor flags such as ``need_weights=False``) and output structure come from one eager run
(:mod:`.record`), tied to graph nodes by identity (model inputs, parameters, other leaves'
outputs), then shape, then value. Leaves that compute nothing (``nn.Identity``) are re-inserted
where they were called. The same regrouping turns user-named leaves (``module_classes_to_exclude``,
transformers' ``LlamaRMSNorm``) into modules on the flag route too, since Dynamo always inlines
modules outside ``torch.nn``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ..common import LeafPolicy
from .flag import direct_call
from .names import Frame, Group, ReliftError, Stacks, default_leaf, frames_meta, read_part
from .record import Call, TensorSpec, record_calls, record_values

_CONSTANT_TYPES = (type(None), bool, int, float, str, complex, torch.dtype, torch.device, torch.memory_format,
                   torch.layout, type(Ellipsis))


def _is_fx_constant(value: Any) -> bool:
    if isinstance(value, _CONSTANT_TYPES):
        return True
    if isinstance(value, slice):
        return all(_is_fx_constant(v) for v in (value.start, value.stop, value.step))
    if type(value) in (tuple, list):
        return all(_is_fx_constant(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _is_fx_constant(v) for k, v in value.items())
    return False


def _fake_shape(node: fx.Node) -> tuple[Any, ...] | None:
    ev = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(ev, torch.Tensor):
        return None
    out = []
    for s in ev.shape:
        if isinstance(s, int):
            out.append(s)
        else:
            hint = getattr(getattr(s, "node", None), "hint", None)
            out.append(hint if hint is not None else s)
    return tuple(out)


def _fake_dtype(node: fx.Node) -> torch.dtype | None:
    ev = node.meta.get("example_value", node.meta.get("val"))
    return ev.dtype if isinstance(ev, torch.Tensor) else None


def _matches(node: fx.Node, t: TensorSpec) -> bool:
    shape = _fake_shape(node)
    return shape is not None and shape == t.shape and _fake_dtype(node) == t.dtype


def _is_size(node: fx.Node) -> bool:
    """Whether ``node`` holds a size (an ``int`` or a symbolic one), not a tensor."""
    return isinstance(node.meta.get("example_value"), (int, torch.SymInt))


class Regrouper:
    """Collapses leaf calls into ``call_module`` nodes of the user's modules (both routes).

    ``inputs`` are the graph nodes of the flattened capture call (None for a non-tensor input);
    ``stacks`` resolves frames to the model's modules (it holds the model and its names).
    """

    def __init__(self, dgm: fx.GraphModule, policy: LeafPolicy, stacks: Stacks, call: ExampleInputs,
                 inputs: list[fx.Node | None]):
        self.dgm = dgm
        self.graph = dgm.graph
        self.model = stacks.model
        self.policy = policy
        self.names = stacks.names
        self.stacks = stacks
        self.call = call
        self.inputs = inputs
        self.notes: list[str] = []
        self.extra_leaves: dict[str, str] = {}
        self.targets: dict[fx.Node, str] = {}  # call_module node -> user qualname
        self.produced: dict[tuple[int, int], fx.Node] = {}  # (call seq, flat output index) -> node
        self.placed: dict[int, fx.Node] = {}  # call seq -> its call_module node
        self._values: dict[fx.Node, TensorSpec] | None = None  # example values, recorded on first need
        self._wanted: set[fx.Node] = set()  # the nodes whose values a tie could need
        self._pristine = fx.Graph()  # the graph as captured (nodes only), for those values
        self._pristine_map: dict[fx.Node, fx.Node] = {}
        self.next_start: dict[int, float] = {}  # call seq -> where the next placed call starts
        self.order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(self.graph.nodes)}

    def is_leaf(self, module: nn.Module | None) -> bool:
        if module is None or module is self.model:
            return False
        return self.policy.reason(module) is not None or default_leaf(module)

    def _note_leaf(self, module: nn.Module | None) -> None:
        reason = self.policy.reason(module) if module is not None else None
        name = self.names.module_name(module)
        if reason is not None and name:
            self.extra_leaves[name] = reason

    def outermost_leaves(self) -> dict[int, nn.Module]:
        out: dict[int, nn.Module] = {}

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if self.is_leaf(child):
                    out.setdefault(id(child), child)
                else:
                    visit(child)

        visit(self.model)
        return out

    # -- analysis ------------------------------------------------------------------------------
    def groups(self) -> tuple[list[Group], list[fx.Node]]:
        """Leaf groups to collapse, in graph order, and the leaf calls Dynamo already made
        ``call_module`` nodes (flag route)."""
        groups: dict[str, Group] = {}
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            frames = self.stacks.of(node)
            for i, frame in enumerate(frames):
                if self.is_leaf(frame.module):
                    group = groups.get(frame.key)
                    if group is None:
                        group = groups[frame.key] = Group(frame.key, frames[: i + 1], [])
                    group.nodes.append(node)
                    break
        collapse, direct = [], []
        for group in groups.values():
            call = direct_call(group, self.stacks)
            if call is not None:
                direct.append(call)
            else:
                collapse.append(group)
        return collapse, direct

    def run(self) -> None:
        groups, direct = self.groups()
        for node in direct:
            frame = self.stacks.of(node)[-1]
            name = self.names.module_name(frame.module) if frame.module is not None else None
            if name is None:
                raise ReliftError(f"call_module {node.target} ({frame.source}) is not a submodule of the model")
            self.targets[node] = name
            self._note_leaf(frame.module)
        policy_leaves = any(self.policy.reason(m) is not None for m in self.model.modules() if m is not self.model)
        if not groups and not policy_leaves:
            return  # flag route, nothing inlined: Dynamo's call_module nodes are all there is
        # Which leaf calls to record eagerly: all of them when Dynamo inlined everything (regroup
        # route); on the flag route only the inlined ones and the policy's (a leaf whose call left no
        # node can only be one of those), which keeps memory flat on big inputs.
        outermost = self.outermost_leaves()
        if any("fxprep_opaque" not in n.meta for n in direct):  # opaque parts' calls are on every route
            leaves = {id(g.leaf.module): g.leaf.module for g in groups if g.leaf.module is not None}
            leaves.update({k: m for k, m in outermost.items() if self.policy.reason(m) is not None})
        else:
            leaves = dict(outermost)
            for g in groups:  # a leaf reached outside the module tree (e.g. kept in a plain list)
                if g.leaf.module is not None:
                    leaves.setdefault(id(g.leaf.module), g.leaf.module)
        calls = record_calls(self.model, leaves, self.call, self.names)
        units: dict[int, list[Any]] = {}
        for g in groups:
            units.setdefault(id(g.leaf.module), []).append(g)
        for node in direct:
            units.setdefault(id(self.stacks.of(node)[-1].module), []).append(node)
        pairs: dict[int, tuple[Call, Any]] = {}
        for mid, recs in calls.items():
            for rec, unit in self._pair(recs, units.get(mid, [])):
                pairs[rec.seq] = (rec, unit)
        # Example values only for the nodes matching could need: what groups read and return, and
        # same-shaped candidates for the inputs of calls that left no node and for arguments a group
        # never reads.
        wanted: set[fx.Node] = set(self.inputs_nodes())
        for g in groups:
            wanted.update(self._ext_inputs(g.nodes))
            wanted.update(self._ext_outputs(g.nodes))
        probes = [t for rec, unit in pairs.values() if unit is None
                  for t in pytree.tree_leaves((rec.args, rec.kwargs)) if isinstance(t, TensorSpec)]
        for rec, unit in pairs.values():  # an argument no node of the group reads (a layer's position_ids)
            if isinstance(unit, Group):
                read = self._ext_inputs(unit.nodes)
                probes.extend(t for t in pytree.tree_leaves((rec.args, rec.kwargs))
                              if isinstance(t, TensorSpec) and not any(_matches(n, t) for n in read))
        if probes:
            wanted.update(n for n in self.graph.nodes if any(_matches(n, t) for t in probes))
        self._wanted = wanted
        # The rewriting below changes the graph; a tie found later is broken with values of the
        # graph as captured, so keep a copy of it (nodes only, no tensors) until then.
        self._pristine.output(self._pristine.graph_copy(self.dgm.graph, self._pristine_map))
        upcoming = float(len(self.order))
        for seq in sorted(pairs, reverse=True):
            self.next_start[seq] = upcoming
            unit = pairs[seq][1]
            if isinstance(unit, Group):
                upcoming = self.order[unit.nodes[0]]
            elif isinstance(unit, fx.Node):
                upcoming = self.order[unit]
        for seq in sorted(pairs):
            rec, unit = pairs[seq]
            if isinstance(unit, fx.Node):
                self._register_direct(rec, unit)
            elif isinstance(unit, Group):
                self._collapse(rec, unit)
            else:
                self._insert_empty(rec)

    def value(self, node: fx.Node) -> TensorSpec | None:
        """The example value of ``node``, to break a tie between same-shaped candidates. The graph
        is run (one more forward) only the first time a tie needs it: most models have none."""
        if self._values is None:
            copy = fx.GraphModule(self.dgm, self._pristine)
            wanted = {self._pristine_map[n] for n in self._wanted if n in self._pristine_map}
            values = record_values(copy, self.model, self.call, wanted)
            self._values = {old: values[new] for old, new in self._pristine_map.items() if new in values}
        return self._values.get(node)

    def inputs_nodes(self) -> list[fx.Node]:
        return [n for n in self.inputs if n is not None]

    def _pair(self, recs: list[Call], units: list[Any]) -> list[tuple[Call, Any]]:
        """Eager calls of one module ↔ its groups in the graph (None: the call left no node)."""

        def frame_of(u: Any) -> Frame:
            return u.leaf if isinstance(u, Group) else self.stacks.of(u)[-1]

        def first(u: Any) -> float:
            return self.order[u.nodes[0]] if isinstance(u, Group) else self.order[u]

        units = sorted(units, key=first)
        if len(units) == len(recs):
            return list(zip(recs, units))
        bases = {frame_of(u).base for u in units}
        by_k = {frame_of(u).k: u for u in units}
        if len(bases) <= 1 and len(by_k) == len(units) and all(k < len(recs) for k in by_k):
            return [(rec, by_k.get(i)) for i, rec in enumerate(recs)]
        name = self.names.module_name(recs[0].module)
        if self.policy.reason(recs[0].module) is not None:
            raise ReliftError(f"the {len(recs)} call(s) of '{name}' could not be paired with the captured graph")
        self.notes.append(
            f"module '{name}' was called {len(recs)} time(s) but its calls could not be paired with the "
            f"captured graph; they are left inlined."
        )
        return []

    # -- binding -------------------------------------------------------------------------------
    @staticmethod
    def _ext_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
        members = set(nodes)
        seen: dict[fx.Node, None] = {}
        for n in nodes:
            for inp in n.all_input_nodes:
                if inp not in members and inp.op != "get_attr":
                    seen.setdefault(inp, None)
        return list(seen)

    @staticmethod
    def _ext_outputs(nodes: list[fx.Node]) -> list[fx.Node]:
        members = set(nodes)
        return [n for n in nodes if any(u not in members for u in n.users)]

    def _by_origin(self, rec: Call, index: int) -> fx.Node | None:
        if index >= len(rec.arg_origin):
            return None
        kind, value = rec.arg_origin[index]
        if kind == "input" and value < len(self.inputs):
            return self.inputs[value]
        if kind == "tensor":
            return self._get_attr(value)
        if kind == "call":
            return self.produced.get(value)
        return None

    def _tensor_node(self, rec: Call, index: int, t: TensorSpec, candidates: list[fx.Node],
                     used: set[fx.Node], window: tuple[float, float]) -> fx.Node | None:
        node = self._by_origin(rec, index)
        if node is not None and (node in candidates or not candidates):
            return node
        # Identity says which tensor object was passed, but an in-place op (``out += x``) may have
        # changed it since: the graph node the call actually reads wins.
        pool = [c for c in candidates if c not in used and _matches(c, t)]
        if len(pool) > 1:
            pool = [c for c in pool if t.same_values(self.value(c))] or pool
            if len(pool) > 1:
                self.notes.append(
                    f"leaf '{self.names.module_name(rec.module)}': {len(pool)} same-shaped values could be argument "
                    f"{index}; bound by order of use (no example values to tell them apart)."
                )
        if pool:
            return pool[0]
        if node is not None:
            return node
        # An argument the call never reads inside the graph: the latest node before the call that
        # holds this very value (nodes since the previous leaf call first).
        lo, hi = window
        earlier = [n for n in self.graph.nodes if self.order.get(n, hi) < hi and n.op != "output"
                   and _matches(n, t) and t.same_values(self.value(n))]
        recent = [n for n in earlier if self.order.get(n, -1.0) >= lo]
        return (recent or earlier)[-1] if earlier else None

    def _get_attr(self, qualname: str) -> fx.Node:
        anchor = next(iter(self.graph.nodes))
        for n in self.graph.nodes:
            if n.op != "placeholder":
                break
            anchor = n
        with self.graph.inserting_after(anchor):
            node = self.graph.get_attr(qualname)
        node.meta["fxprep_user_attr"] = qualname
        self.order[node] = self.order.get(anchor, 0.0) + 0.001
        return node

    def _bind(self, rec: Call, candidates: list[fx.Node], window: tuple[float, float]) -> tuple[Any, Any] | None:
        flat, spec = pytree.tree_flatten((rec.args, rec.kwargs))
        used: set[fx.Node] = set()
        out: list[Any] = []
        index = 0
        by_id: dict[int, fx.Node] = {}  # the same tensor object passed twice (MHA's x, x, x)
        for leaf in flat:
            if isinstance(leaf, TensorSpec):
                node = by_id.get(rec.arg_ids[index]) or self._tensor_node(rec, index, leaf, candidates, used, window)
                if node is not None:
                    by_id.setdefault(rec.arg_ids[index], node)
                index += 1
                if node is None:
                    return None
                used.add(node)
                out.append(node)
            elif _is_fx_constant(leaf):
                out.append(leaf)
            else:
                return None
        args, kwargs = pytree.tree_unflatten(out, spec)
        return tuple(args), dict(kwargs)

    def _output_paths(self, rec: Call, outs: list[fx.Node]) -> tuple[dict[fx.Node, int], list[Any]] | None:
        if isinstance(rec.output, TensorSpec):
            leaves: list[tuple[Any, TensorSpec]] = [((), rec.output)]
        else:
            leaves = [(tuple(p), t) for p, t in pytree.tree_flatten_with_path(rec.output)[0] if isinstance(t, TensorSpec)]
        result: dict[fx.Node, int] = {}
        taken: set[int] = set()
        for node in outs:
            pool = [i for i, (_, t) in enumerate(leaves) if i not in taken and _matches(node, t)]
            if len(pool) > 1:
                pool = [i for i in pool if leaves[i][1].same_values(self.value(node))] or pool
            if not pool:
                return None
            taken.add(pool[0])
            result[node] = pool[0]
        return result, [p for p, _ in leaves]

    # -- rewriting -----------------------------------------------------------------------------
    def _register_direct(self, rec: Call, node: fx.Node) -> None:
        self.placed[rec.seq] = node
        if isinstance(rec.output, TensorSpec):
            self.produced[(rec.seq, 0)] = node
            return
        if isinstance(rec.output, (tuple, list)):
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                    idx = user.args[1]
                    if 0 <= idx < len(rec.output) and isinstance(rec.output[idx], TensorSpec):
                        flat_index = sum(isinstance(x, TensorSpec) for x in pytree.tree_leaves(list(rec.output)[:idx]))
                        self.produced[(rec.seq, flat_index)] = user

    def _window(self, seq: int) -> tuple[float, float]:
        prev = [s for s in self.placed if s < seq]
        lo = self.order[self.placed[max(prev)]] if prev else -1.0
        return lo, self.next_start.get(seq, float(len(self.order)))

    def _give_up(self, rec: Call, problem: str) -> None:
        name = self.names.module_name(rec.module)
        reason = self.policy.reason(rec.module)
        if reason is not None:
            raise ReliftError(f"module '{name}' ({reason}) could not be kept as one call: {problem}")
        self.notes.append(f"leaf '{name}' could not be regrouped into one call ({problem}); it is left inlined.")

    def _collapse(self, rec: Call, group: Group) -> None:
        nodes = group.nodes
        name = self.names.module_name(rec.module)
        if name is None:
            return self._give_up(rec, "it is not a submodule of the model")
        ext_in = self._ext_inputs(nodes)
        ext_out = self._ext_outputs(nodes)
        last = max(nodes, key=lambda n: self.order[n])
        lo, _ = self._window(rec.seq)
        bound = self._bind(rec, ext_in, (lo, self.order[nodes[0]]))
        if bound is None:
            return self._give_up(rec, "its arguments could not be tied to graph values")
        args, kwargs = bound
        arg_nodes: set[fx.Node] = set()
        fx.node.map_arg((args, kwargs), arg_nodes.add)
        # a size the trace read once outside and reuses inside (``size = hidden_states.shape``) is
        # computed again by the module itself from its arguments when it is called
        missing = [n for n in ext_in if n not in arg_nodes and not _is_size(n)]
        if missing:
            return self._give_up(rec, f"it reads values it is not given as arguments ({', '.join(m.name for m in missing)})")
        if any(self.order.get(n, -1.0) > self.order[last] for n in arg_nodes):
            return self._give_up(rec, "an argument is computed after the call")
        matched = self._output_paths(rec, ext_out)
        if matched is None:
            return self._give_up(rec, "values it computes are used outside it but are not part of its output")
        paths, leaf_paths = matched
        with self.graph.inserting_after(last):
            call = self.graph.call_module(name, args, kwargs)
        call.meta["nn_module_stack"] = frames_meta(group.frames)
        call.meta["fxprep_regrouped"] = True
        if isinstance(rec.output, TensorSpec) and len(ext_out) == 1:
            call.meta["example_value"] = ext_out[0].meta.get("example_value")
        self.targets[call] = name
        self.order[call] = self.order[last] + 0.5
        self.placed[rec.seq] = call
        self._note_leaf(rec.module)
        if isinstance(rec.output, TensorSpec):
            self.produced[(rec.seq, 0)] = call
        parent = frames_meta(group.frames[:-1])
        members = set(nodes)
        cursor = call
        for node in ext_out:
            value: fx.Node = call
            for key in leaf_paths[paths[node]]:
                with self.graph.inserting_after(cursor):
                    value = read_part(self.graph, value, key)
                value.meta["nn_module_stack"] = dict(parent)
                self.order[value] = self.order[call] + 0.01
                cursor = value
            if value is not call:
                value.meta["example_value"] = node.meta.get("example_value")
            node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in members)
            self.produced[(rec.seq, paths[node])] = value
        for node in reversed(nodes):
            if node.users:
                raise ReliftError(f"node {node.name} of '{name}' is still used after regrouping")
            self.graph.erase_node(node)
        return None

    def _insert_empty(self, rec: Call) -> None:
        """A leaf call that left no node (``nn.Identity``): put the call back where it happened."""
        name = self.names.module_name(rec.module)
        index = rec.output_is_arg[0] if isinstance(rec.output, TensorSpec) and rec.output_is_arg else None
        if name is None or index is None:
            return self._give_up(rec, "it left no node in the captured graph and does not return its input")
        window = self._window(rec.seq)
        flat_args = [t for t in pytree.tree_leaves((rec.args, rec.kwargs)) if isinstance(t, TensorSpec)]
        source = self._tensor_node(rec, index, flat_args[index], [], set(), window)
        bound = self._bind(rec, [source] if source is not None else [], window) if source is not None else None
        if source is None or bound is None:
            return self._give_up(rec, "it left no node in the captured graph and its input could not be found")
        args, kwargs = bound
        arg_nodes: list[fx.Node] = []
        fx.node.map_arg((args, kwargs), arg_nodes.append)
        prev = [s for s in self.placed if s < rec.seq]
        anchors = [*arg_nodes] + ([self.placed[max(prev)]] if prev else [])
        after = max(anchors, key=lambda n: self.order.get(n, 0.0))
        with self.graph.inserting_after(after):
            call = self.graph.call_module(name, args, kwargs)
        position = self.order.get(after, 0.0)
        self.order[call] = position + 0.25
        call.meta["nn_module_stack"] = self._frames_for_module(rec.module)
        call.meta["example_value"] = source.meta.get("example_value")
        call.meta["fxprep_regrouped"] = True
        self.targets[call] = name
        self.placed[rec.seq] = call
        self.produced[(rec.seq, 0)] = call
        self._note_leaf(rec.module)
        for user in list(source.users):
            if user is not call and self.order.get(user, -1.0) > position:
                user.replace_input_with(source, call)
        return None

    def _frames_for_module(self, module: nn.Module) -> dict[str, tuple[str, type]]:
        qualname = self.names.module_name(module) or ""
        out: dict[str, tuple[str, type]] = {}
        parts = qualname.split(".") if qualname else []
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            m = self.model.get_submodule(path)
            out[f"fxprep:{path}"] = (f"L['self'].{path}", type(m))
        return out
