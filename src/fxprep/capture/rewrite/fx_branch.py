"""A rewritten ``if`` met by the ``torch.fx`` tracer (fxprep's own, or the hybrid one).

``where``: both arms are traced into the graph and joined by ``torch.where``. ``cond``: each arm is
traced into a subgraph of its own, by the *same* tracer (so its leaf policy holds: the user's
leaf modules inside a branch are ``call_module`` nodes), and the graph calls
:func:`fxprep.cond.cond` with the two branch GraphModules. A value an arm
reads from the enclosing graph (a closure, a cached parameter read) becomes an extra operand, as
Dynamo lifts free variables of ``torch.cond`` branches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

from ...cond import cond
from .join import RewriteError, where

BRANCH_ATTR = "_fxprep_branch"  # node.meta: the site key of a cond node fxprep built


def _free_index(root: Any) -> int:
    """The first ``k`` with ``cond_true_k`` / ``cond_false_k`` free on the root (branches built
    earlier in the same trace are parked there)."""
    k = 0
    while hasattr(root, f"cond_true_{k}") or hasattr(root, f"cond_false_{k}"):
        k += 1
    return k


def _trace_arm(tracer: fx.Tracer, fn: Callable[..., Any], operands: tuple[Any, ...], slots: list[int]
               ) -> tuple[fx.Graph, Any]:
    """Trace ``fn`` into a new graph whose inputs are the traced operands (at ``slots``)."""
    outer = tracer.graph
    graph = fx.Graph(tracer_cls=type(tracer))
    tracer.graph = graph
    try:
        args = list(operands)
        for i in slots:
            args[i] = tracer.create_proxy("placeholder", operands[i].node.name, (), {})
        result = fn(*args)
        flat, spec = pytree.tree_flatten(result)
        inputs = {args[i].node for i in slots}
        # torch.cond (export, compile) refuses a branch returning one of its inputs: return a copy.
        flat = [v.clone() if isinstance(v, fx.Proxy) and v.node in inputs else v for v in flat]
        graph.output(tuple(tracer.create_arg(v) for v in flat))
    finally:
        tracer.graph = outer
    return graph, spec


def _foreign(graph: fx.Graph) -> list[fx.Node]:
    """Nodes of other graphs that ``graph``'s nodes use (closures over the enclosing graph)."""
    seen: dict[fx.Node, None] = {}
    for node in graph.nodes:
        for used in node.all_input_nodes:
            if used.graph is not graph:
                seen.setdefault(used, None)
    return list(seen)


def _localise(graph: fx.Graph, lifted: list[fx.Node]) -> None:
    """Give ``graph`` its own copy of foreign ``get_attr`` reads and a placeholder for every other
    lifted value (all branches get the same extra placeholders, in the same order)."""
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    last_ph = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = last_ph[-1] if last_ph else None
    local: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(lifted):
        if node.op == "get_attr":
            with graph.inserting_before(first):
                local[node] = graph.get_attr(str(node.target))
            continue
        ctx = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(first)
        with ctx:
            anchor = local[node] = graph.placeholder(f"lifted_{i}_{node.name}")
    for node in list(graph.nodes):
        for used in list(node.all_input_nodes):
            if used in local:
                node.replace_input_with(used, local[used])


def fx_branch(route: str, key: str, pred: fx.Proxy, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
              operands: tuple[Any, ...]) -> Any:
    """The site traced by the fx tracer that made ``pred`` (see the module docstring)."""
    if route == "where":
        return where(pred, true_fn(*operands), false_fn(*operands))
    tracer = pred.tracer
    slots = [i for i, v in enumerate(operands) if isinstance(v, fx.Proxy)]
    t_graph, t_spec = _trace_arm(tracer, true_fn, operands, slots)
    f_graph, f_spec = _trace_arm(tracer, false_fn, operands, slots)
    if t_spec != f_spec:
        raise RewriteError(f"the branches return different structures ({t_spec} vs {f_spec})")
    lifted = [n for n in dict.fromkeys(_foreign(t_graph) + _foreign(f_graph)) if n.op != "get_attr"]
    attrs = [n for n in dict.fromkeys(_foreign(t_graph) + _foreign(f_graph)) if n.op == "get_attr"]
    root = tracer.root
    targets = []
    k = _free_index(root)
    for graph, side in ((t_graph, "true"), (f_graph, "false")):
        _localise(graph, attrs + lifted)
        graph.lint()
        make = getattr(tracer, "make_graph_module", None)  # fxprep's tracers install opaque parts too
        branch_gm = make(graph, f"cond_{side}") if make is not None else fx.GraphModule(root, graph, f"cond_{side}")
        name = f"cond_{side}_{k}"
        # Parked on the root like fx parks its tensor constants: the capture's GraphModule copies
        # it from there, and the capture restores the root's registries afterwards.
        root._modules[name] = branch_gm
        targets.append(name)
    t_attr = tracer.create_proxy("get_attr", targets[0], (), {})
    f_attr = tracer.create_proxy("get_attr", targets[1], (), {})
    ops = tuple(operands[i] for i in slots) + tuple(fx.Proxy(n, tracer) for n in lifted)
    out = tracer.create_proxy("call_function", cond, (pred, t_attr, f_attr, ops), {})
    out.node.meta["is_wrapped"] = True  # a re-trace by torch.fx keeps it one call
    out.node.meta[BRANCH_ATTR] = key
    n_out = t_spec.num_leaves
    return pytree.tree_unflatten([out[i] for i in range(n_out)], t_spec)
