"""Opaque parts on the Dynamo path: a module, method or function Dynamo calls without tracing into.

Three steps: the parts' outputs are recorded by an eager run (:mod:`.recording`); during the capture
each part is patched with a shim that Dynamo writes as one ``call_function`` returning fake tensors
of the recorded shapes (:class:`BlackBox`); the graph is re-lifted so each such call is a
``call_module`` of the user's own module or an :class:`~fxprep.capture.sites.OpaqueMethod` /
``OpaqueFunction`` (:func:`relift_opaque`). Nothing of fxprep is left in the graph at that point.

See docs/concepts/opaque-parts.md ("Under the hood") for the details and costs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ..common import LeafPolicy
from ..sites import FUNCTIONS, Site, mutable
from .names import Names, ReliftError, read_part
from .recording import MARK, Recorded, TensorMeta, graphable, is_mark, patched, real_callable, record_sites

OPAQUE_PREFIX = "fxprep_opaque_"  # the name of every function an opaque part is in Dynamo's graph


# --- during capture -------------------------------------------------------------------------------
def _is_fake(tree: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(v, FakeTensor) for v in pytree.tree_leaves(tree))


@dataclass
class Unbacked:
    """The example values behind the unbacked sizes fake outputs were given (for later matching)."""

    values: dict[Any, tuple[int, int | None]] = field(default_factory=dict)


def _fake_outputs(rec: Recorded, args: tuple[Any, ...], kwargs: dict[str, Any], unbacked: Unbacked,
                  own_grad: bool = False) -> tuple[Any, ...]:
    """Fake tensors like ``rec``'s outputs, sized from the call's inputs where the eager runs say
    the size is an input's, with fresh unbacked sizes where it followed the data.

    A floating-point output has a gradient where eager would give it one: in the grad mode Dynamo
    traces the call in (the model's own ``no_grad`` regions included), when an input has one or the
    part has parameters that do (``own_grad``: an excluded layer's weights). An excluded layer's
    output without one in the graph made the layer after it another call than its twins, and block
    reuse captured it apart. It is made by an operation (a clone), not a leaf, so that an in-place
    update of it downstream traces as it runs eagerly. An output computed from neither (a mask from
    the hidden states' dtype alone) gets one too, where eager gives none; it is the same for every
    call of the part, so twins stay twins, and no operation in the graph depends on it."""
    fake_mode = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
    inputs = [v for v in pytree.tree_leaves((args, kwargs))]
    grad = torch.is_grad_enabled() and (own_grad or any(isinstance(v, torch.Tensor) and v.requires_grad
                                                        for v in inputs))
    known: dict[tuple[int, int | None], Any] = {}
    for k, value in enumerate(inputs):
        shape = rec.inputs[k] if k < len(rec.inputs) else None
        if not isinstance(value, torch.Tensor) or shape is None or len(shape) != value.dim():
            continue
        shape2 = rec.inputs2[k] if rec.inputs2 is not None and k < len(rec.inputs2) else None
        for d, size in enumerate(value.shape):
            second = shape2[d] if shape2 is not None and len(shape2) == len(shape) else None
            known.setdefault((shape[d], second), size)
    out = []
    metas = [m for m in rec.leaves if isinstance(m, TensorMeta)]
    for j, meta in enumerate(metas):
        second_shape = rec.shapes2[j] if rec.shapes2 is not None and j < len(rec.shapes2) else None
        sizes: list[Any] = []
        like = _shaped_like(rec, inputs, meta.shape, second_shape)
        if like is not None:  # an output shaped like an input (a scan's output): that input's sizes, dim by dim
            sizes = list(like.shape)
        for d, size in enumerate(meta.shape if like is None else ()):
            second = second_shape[d] if second_shape is not None and len(second_shape) == len(meta.shape) else None
            if (size, second) in known:
                sizes.append(known[(size, second)])
            elif second is None or second == size or fake_mode is None or fake_mode.shape_env is None:
                sizes.append(size)
            else:
                symbol = fake_mode.shape_env.create_unbacked_symint()
                torch._check(symbol >= 0)
                unbacked.values[symbol.node.expr] = (size, second)
                known[(size, second)] = symbol
                sizes.append(symbol)
        if all(isinstance(s, int) for s in sizes) and meta.stride is not None:
            made = torch.empty_strided(sizes, meta.stride, dtype=meta.dtype, device=meta.device)
        else:
            made = torch.empty(sizes, dtype=meta.dtype, device=meta.device)
        out.append(made.requires_grad_().clone() if grad and (made.is_floating_point() or made.is_complex()) else made)
    return tuple(out)


def _shaped_like(rec: Recorded, inputs: list[Any], shape: tuple[int, ...],
                 second: tuple[int, ...] | None) -> torch.Tensor | None:
    """The input tensor the eager runs gave exactly ``shape`` (and ``second`` in the perturbed run),
    when there is one. Matching sizes one by one is ambiguous where a declared size equals a fixed
    one (8 tokens beside a head dimension of 8: Falcon-H1's scan returned its input's layout with
    the head dimension taken for the length, and the length was lost); an output laid out as an
    input is read dimension by dimension from that input."""
    for k, value in enumerate(inputs):
        recorded = rec.inputs[k] if k < len(rec.inputs) else None
        if not isinstance(value, torch.Tensor) or recorded != shape or value.dim() != len(shape):
            continue
        other = rec.inputs2[k] if rec.inputs2 is not None and k < len(rec.inputs2) else None
        if second is None or other is None or other == second:
            return value
    return None


def _propagate_real(fake: tuple[Any, ...], run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Under real-tensor propagation (the values capture, :mod:`.values`), give ``fake`` (an opaque
    part's fake outputs) the part's real outputs: the part runs eagerly on its inputs' real values.

    Without this, Dynamo would carry ``torch.empty``'s garbage as their real values, and a decision
    downstream (Qwen2.5-VL's attention splitting by ``cu_seqlens.tolist()`` computed in the opaque
    window index) would be taken on garbage, or fail, and the layers reading it would stay opaque
    too. An output whose real size contradicts a fixed fake size keeps no real value."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    fake_mode = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
    if fake_mode is None or not getattr(fake_mode, "propagate_real_tensors", False):
        return
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if any(isinstance(v, FakeTensor) and v.real_tensor is None for v in leaves):
        return  # an input without real values (itself an opaque part's, unpropagated): nothing to run on
    reals = [v.real_tensor if isinstance(v, FakeTensor) else v for v in leaves]
    real_args, real_kwargs = pytree.tree_unflatten(reals, spec)
    with unset_fake_temporarily(), torch.no_grad():
        try:
            outputs = _run_opaque(run, (real_args, real_kwargs), {})
        except Exception:  # noqa: BLE001 - a part that fails on these values keeps garbage; the checks refuse it later
            return
    if len(outputs) != len(fake):
        return
    shape_env = fake_mode.shape_env
    for out, value in zip(fake, outputs):
        if not isinstance(out, FakeTensor) or out.dim() != value.dim():
            continue
        sizes = []
        for size, real_size in zip(out.shape, value.shape):
            if isinstance(size, torch.SymInt):
                sizes.append((size, real_size))
            elif size != real_size:
                break
        else:
            # a fake with a symbolic size was made contiguous (_fake_outputs): its real value must be laid out
            # alike, or a view the fake allows fails on the real one (Qwen3.5's scan returns a transposed view);
            # copied outside the fake mode, whose copy would be a fake tensor (a fake's real value must be real)
            if sizes and not value.is_contiguous():
                with unset_fake_temporarily():
                    value = value.contiguous()
            out.real_tensor = value
            for size, real_size in sizes:
                expr = size.node.expr
                if shape_env is not None and expr.is_Symbol and free_unbacked_symbols(size) and \
                        hasattr(shape_env, "set_real_tensor_prop_unbacked_vals"):
                    shape_env.set_real_tensor_prop_unbacked_vals(expr, real_size)


def _matching(records: list[Recorded], index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recorded:
    """The recorded call a traced call stands for: the one at the same position, unless the inputs
    say otherwise (Dynamo took a path the eager run did not, or block reuse captures one block
    alone, whose calls are not at the model's positions): then the first whose input sizes agree,
    else the first whose input ranks do."""
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves((args, kwargs))]

    def fits(rec: Recorded, exact: bool) -> bool:
        if len(rec.inputs) != len(shapes):
            return False
        for recorded, shape in zip(rec.inputs, shapes):
            if recorded is None or shape is None:
                if recorded is not shape:
                    return False
                continue
            if len(recorded) != len(shape):
                return False
            if exact and any(type(n) is int and n != r for n, r in zip(shape, recorded)):
                return False
        return True

    for exact in (True, False):
        if index < len(records) and fits(records[index], exact):
            return records[index]
        for rec in records:
            if fits(rec, exact):
                return rec
    if records:
        return records[min(index, len(records) - 1)]
    raise ReliftError("an opaque part was called during capture but never in the eager run")


_RUNNING = [0]  # opaque parts running eagerly right now (their inner module calls are no graph's)


def running_opaque() -> bool:
    """Whether an opaque part is running eagerly: a module call now happens inside it, so the
    re-lifting's recording run must not look for that call in the graph."""
    return _RUNNING[0] > 0


def _run_opaque(real: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _RUNNING[0] += 1
    try:
        return real(*args, **kwargs)
    finally:
        _RUNNING[0] -= 1


class SiteCall:
    """The allow-in-graph function and the shim of one site, for one capture attempt."""

    def __init__(self, site: Site, records: list[Recorded], real: Any, unbacked: Unbacked, own_grad: bool):
        self.site = site
        self.records = records
        self.real = real
        self.unbacked = unbacked
        self.own_grad = own_grad  # the part has parameters with a gradient (:func:`_fake_outputs`)
        self.count = [0]
        self.function = self._make_function()

    def _make_function(self) -> Any:
        records, real, unbacked, own_grad = self.records, self.real, self.unbacked, self.own_grad

        def run(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
            args, kwargs = mutable((args, kwargs))
            objects = records[min(index, len(records) - 1)].objects
            args = tuple(objects.get(k, a) if is_mark(a) else a for k, a in enumerate(args))
            kwargs = {k: objects.get(k, v) if is_mark(v) else v for k, v in kwargs.items()}
            out = real(*args, **kwargs)
            return tuple(v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor))

        def opaque_call(index: int, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
            if _is_fake((args, kwargs)):
                fake = _fake_outputs(_matching(records, index, args, kwargs), args, kwargs, unbacked, own_grad)
                _propagate_real(fake, functools.partial(run, index), args, kwargs)
                return fake
            return run(index, args, kwargs)

        opaque_call.__name__ = opaque_call.__qualname__ = f"{OPAQUE_PREFIX}{self.site.qualname.replace('.', '_') or 'root'}"
        return torch.compiler.allow_in_graph(opaque_call)

    def shim(self) -> Any:
        """What the site's name points to during capture.

        Dynamo traces this function at every call of the site (a decoder stack's layers: once per
        layer), so what it can decide from the recording is decided here, outside the trace: which
        arguments the recorded call could not carry (``marks``) and whether it returned one tensor
        (``single``). Calls past the recorded ones read their arguments' types while traced."""
        function, records, real, count = self.function, self.records, self.real, self.count
        marks = [(tuple(k for k in rec.objects if isinstance(k, int)), tuple(k for k in rec.objects if isinstance(k, str)))
                 for rec in records]
        single = [rec.spec.is_leaf() and len(rec.leaves) == 1 and isinstance(rec.leaves[0], TensorMeta) for rec in records]

        def shim(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                return _run_opaque(real, args, kwargs)
            index = count[0]
            count[0] = index + 1
            if index >= len(marks):
                args = tuple(a if graphable(a) else f"{MARK}{k}" for k, a in enumerate(args))
                kwargs = {k: v if graphable(v) else f"{MARK}{k}" for k, v in kwargs.items()}
            else:
                marked_args, marked_kwargs = marks[index]
                if marked_args:
                    args = tuple(f"{MARK}{k}" if k in marked_args else a for k, a in enumerate(args))
                if marked_kwargs:
                    kwargs = {k: f"{MARK}{k}" if k in marked_kwargs else v for k, v in kwargs.items()}
                if single[index]:
                    return function(index, *args, **kwargs)[0]
            tensors = function(index, *args, **kwargs)
            rec = records[min(index, len(records) - 1)]
            values = iter(tensors)
            leaves = [next(values) if isinstance(v, TensorMeta) else v for v in rec.leaves]
            return pytree.tree_unflatten(leaves, rec.spec)

        return shim


def _own_grad(site: Site, model: nn.Module) -> bool:
    """Whether the module a site belongs to (the excluded module, or the owner of a method) has a
    parameter with a gradient; a function has none of its own."""
    owner = site.owner(model) if site.func is None else None
    return isinstance(owner, nn.Module) and any(p.requires_grad for p in owner.parameters())


class BlackBox:
    """The opaque sites of one capture: their recordings, and the calls installed during capture."""

    def __init__(self, model: nn.Module, sites: list[Site], records: dict[Site, list[Recorded]]):
        self.model = model
        self.sites = [s for s in sites if records.get(s)]
        self.records = records
        self.unbacked = Unbacked()
        self.calls: dict[Any, SiteCall] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every site patched with its shim (fresh functions and call counters each time)."""
        calls = [SiteCall(s, self.records[s], real_callable(s, self.model), self.unbacked, _own_grad(s, self.model))
                 for s in self.sites]
        self.calls = {c.function: c for c in calls}
        with patched(self.model, {c.site: c.shim() for c in calls}, classes=True):
            yield

    def rewind(self) -> None:
        """Count every site's calls from the first again: each Dynamo trace replays the recorded
        calls in order, and one trace before this one (block reuse's outer capture, given up) may
        have counted some."""
        for call in self.calls.values():
            call.count[0] = 0

    def within(self, prefix: str, block: nn.Module) -> BlackBox:
        """This box as seen from the block at ``prefix`` (``block``, the module there), for block
        reuse's capture of that block alone: its sites inside the block with paths relative to it,
        function sites (whose calls are named after their caller anyway) with the block's path left
        out, the sites elsewhere dropped. The same installed calls and recordings: a call the block
        makes is found in :attr:`calls` with its site rebased."""
        rebased: dict[Site, Site] = {}
        for site in self.sites:
            inner = site.path.startswith(f"{prefix}.")
            if site.func is not None:
                moved = Site(site.path[len(prefix) + 1:] if inner else "", site.method, None, site.func)
                FUNCTIONS.setdefault(moved, FUNCTIONS[site])
                rebased[site] = moved
            elif inner or (site.path == prefix and not site.is_module):  # a part inside, or a method of the block
                rebased[site] = dataclasses.replace(site, path=site.path[len(prefix) + 1:])
        view = BlackBox(block, list(rebased.values()), {new: self.records[old] for old, new in rebased.items()})
        view.unbacked = self.unbacked
        for function, call in self.calls.items():
            if call.site in rebased:
                moved_call = copy.copy(call)
                moved_call.site = rebased[call.site]
                view.calls[function] = moved_call
        return view

    def calls_in(self, gm: fx.GraphModule) -> list[Site]:
        """The sites Dynamo's graph ``gm`` calls (nodes of their allow-in-graph functions)."""
        found = [self.calls[n.target].site for n in gm.graph.nodes
                 if n.op == "call_function" and n.target in self.calls]
        return list(dict.fromkeys(found))

    def __bool__(self) -> bool:
        return bool(self.sites)


# Leaf-policy reasons that make a module a black box for Dynamo. Modules that are leaves because they
# carry hooks are traced (their hooks must run inside the traced code, e.g. transformers' output
# recorders) and regrouped; they become opaque only if Dynamo fails inside them.
BLACK_BOX_REASONS = ("modules_to_exclude", "module_classes_to_exclude", "marked with fxprep.opaque", "TorchScript module")


def excluded_sites(model: nn.Module, policy: LeafPolicy) -> list[Site]:
    """The outermost modules the leaf policy excludes (``torch.nn`` layers aside: Dynamo records
    those as calls already), as sites."""
    from .names import default_leaf

    out: list[Site] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if policy.reason(child) in BLACK_BOX_REASONS and not default_leaf(child):
                out.append(Site(path))
            else:
                visit(child, f"{path}.")

    visit(model, "")
    return out


def inside(site: Site, sites: list[Site]) -> bool:
    """Whether ``site`` only runs inside another site's opaque module."""
    for other in sites:
        if other is site or not other.is_module or other == site:
            continue
        if site.path == other.path or site.path.startswith(f"{other.path}."):
            return True
    return False


class OpaquePolicy(LeafPolicy):
    """The leaf policy with the opaque module sites as leaves too, so re-lifting neither looks for
    their inner modules in the graph nor regroups around them."""

    def __init__(self, policy: LeafPolicy, opaque: set[int]):
        super().__init__(policy.modules, policy.classes)
        self.opaque = opaque

    def reason(self, module: nn.Module) -> str | None:
        if id(module) in self.opaque:
            return super().reason(module) or "opaque part"
        return super().reason(module)


def with_opaque(policy: LeafPolicy, box: BlackBox | None) -> LeafPolicy:
    if not box:
        return policy
    return OpaquePolicy(policy, {id(box.model.get_submodule(s.path)) for s in box.sites if s.is_module})


def black_box(model: nn.Module, policy: LeafPolicy, sites: list[Site], call: ExampleInputs,
              cache: dict[Site, list[Recorded]] | None = None) -> BlackBox:
    """The black box of one capture: the excluded modules and ``sites`` (outermost ones only),
    recorded on ``call`` (recordings already in ``cache`` are reused, new ones added to it)."""
    wanted = excluded_sites(model, policy) + [s for s in sites]
    wanted = [s for s in dict.fromkeys(wanted) if not inside(s, wanted)]
    cache = {} if cache is None else cache
    missing = [s for s in wanted if s not in cache]
    if missing:
        cache.update(record_sites(model, call, missing))
    return BlackBox(model, wanted, cache)


# --- re-lifting -----------------------------------------------------------------------------------
def _carried(dgm: fx.GraphModule, graph: fx.Graph, node: fx.Node, rec: Recorded, names: Names) -> None:
    """The arguments Dynamo's graph could not carry (a config, a module) back in the call: a
    ``get_attr`` of the very object the eager run passed (a submodule by its qualified name)."""

    def restore(key: int | str, value: Any) -> Any:
        if not is_mark(value) or key not in rec.objects:
            return value
        obj = rec.objects[key]
        qualname = names.module_name(obj) if isinstance(obj, nn.Module) else None
        if qualname is None:
            qualname = f"_fxprep_argument_{len([n for n in graph.nodes if n.op == 'get_attr'])}"
            while hasattr(dgm, qualname):
                qualname += "_"
            setattr(dgm, qualname, obj)
        with graph.inserting_before(node):
            attr = graph.get_attr(qualname)
        if names.module_name(obj) is not None:
            attr.meta["fxprep_user_attr"] = qualname
        return attr

    node.args = tuple(restore(k, a) for k, a in enumerate(node.args))
    node.kwargs = {k: restore(k, v) for k, v in node.kwargs.items()}


def relift_opaque(dgm: fx.GraphModule, box: BlackBox | None, names: Names,
                  owner: Callable[[fx.Node], nn.Module] | None = None) -> tuple[dict[fx.Node, str], dict[str, Site]]:
    """Each opaque call in Dynamo's graph → a ``call_module`` with the call's own arguments, its
    tensors read from the output by path. Returns the new nodes' targets (a module site's
    qualified name, else a placeholder name to place) and, for method and function sites, which
    site each placeholder name stands for. ``owner(node)``: the module whose code made a node; a
    function site's call is named after it (:meth:`~fxprep.capture.sites.Site.called_from`)."""
    targets: dict[fx.Node, str] = {}
    wrappers: dict[str, Site] = {}
    if not box:
        return targets, wrappers
    graph = dgm.graph
    for node in list(graph.nodes):
        call = box.calls.get(node.target) if node.op == "call_function" else None
        if call is None:
            continue
        site = call.site
        caller = names.module_name(owner(node)) if owner is not None and site.func is not None else None
        if caller is not None and caller != site.path:
            site = site.called_from(caller)
        index = node.args[0]
        rec = call.records[min(int(index), len(call.records) - 1)]
        name = site.path if site.is_module else f"fxprep_opaque::{site.qualname}"
        # The node's own target is a module of Dynamo's graph module, so that graph still runs (the
        # regrouper runs it to break ties); ``targets`` says what it is in the user's model.
        holder = f"_fxprep_opaque_{len(targets)}"
        dgm.add_module(holder, site.eager_module(box.model))
        with graph.inserting_before(node):
            new = graph.create_node("call_module", holder, tuple(node.args[1:]), dict(node.kwargs),
                                    name=re.sub(r"\W", "_", site.qualname) or "opaque")
        _carried(dgm, graph, new, rec, names)
        new.meta = dict(node.meta)
        new.meta["fxprep_opaque"] = site.qualname
        stack = dict(node.meta.get("nn_module_stack") or {})
        parent = dict(list(stack.items())[:-1]) if site.is_module and stack else stack
        single = len(rec.paths) == 1 and not rec.paths[0]
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
                raise ReliftError(f"the output of opaque part '{site.qualname}' is used as a whole")
            path = rec.paths[user.args[1]] if user.args[1] < len(rec.paths) else None
            if path is None:
                raise ReliftError(f"opaque part '{site.qualname}' returned fewer tensors than recorded")
            value = new
            cursor = new
            for key in path:
                with graph.inserting_after(cursor):
                    value = read_part(graph, value, key)
                value.meta["nn_module_stack"] = dict(parent)
                cursor = value
            if value is not new or single:
                value.meta["example_value"] = user.meta.get("example_value")
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)
        if not site.is_module:
            wrappers[name] = site
        targets[new] = name
    return targets, wrappers


_ASSERTS = tuple(
    op for op in (getattr(torch.ops.aten, "_assert_scalar", None), getattr(torch.ops.aten, "sym_constrain_range_for_size", None))
    if op is not None
)


def drop_size_asserts(dgm: fx.GraphModule) -> None:
    """Remove the run-time asserts Dynamo adds on the unbacked sizes of opaque outputs (``u0 >= 0``)
    and the size reads only they used: facts about sizes the eager code produces, not checks of the
    user's, and not tensor compute a toolkit should see."""
    graph = dgm.graph
    targets = {getattr(op, "default", op) for op in _ASSERTS}
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.target not in targets:
            continue
        text = " ".join(str(a) for a in node.args[1:])
        if text and not all(tok.startswith("u") for tok in re.findall(r"\b[a-z]\d+\b", text)):
            continue  # mentions a backed (input) size: the user's own check, kept
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        while inputs:
            n = inputs.pop()
            if not n.users and _size_arithmetic(n):
                inputs.extend(n.all_input_nodes)
                graph.erase_node(n)


def _size_arithmetic(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("size", "numel", "stride", "dim")
    if node.op != "call_function":
        return False
    module = getattr(node.target, "__module__", None) or ""
    return (module in ("_operator", "operator") and node.target is not operator.getitem) or \
        getattr(node.target, "__name__", "").startswith("sym_") or "aten.sym_" in str(node.target)


__all__ = ["OPAQUE_PREFIX", "BlackBox", "OpaquePolicy", "with_opaque", "black_box", "drop_size_asserts", "excluded_sites",
           "inside", "running_opaque", "relift_opaque"]
