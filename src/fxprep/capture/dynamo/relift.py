"""Re-lifting: Dynamo's graph turned into the module-level graph of the user's model.

:func:`relift` runs the clean-up passes (:mod:`fxprep.passes.dynamo_cleanup`), regroups leaf calls
(:mod:`.regroup`, :mod:`.flag`), gives the graph the original calling convention (argument names,
keyword arguments, ``concrete_args`` baked in) and builds a ``GraphModule`` whose attribute tree
holds the user's own leaf modules and tensors at their original paths (:func:`build`), never
mutating a user module. Tensors that are neither parameters nor buffers become named constants,
reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...core.paths import get_path, holds
from ...passes import dynamo_cleanup
from ..common import LeafPolicy, graph_module
from ..shapes.dims import positional_names
from ..sites import Site
from .cond import relift_conds
from .flag import module_method_calls
from .names import Names, ReliftError, Stacks
from .opaque import BlackBox, drop_size_asserts, relift_opaque, with_opaque
from .regroup import Regrouper

_GLOBAL_SOURCE = re.compile(r"\s*G(\[|___)")  # Dynamo's source of a global: G['name'], G___import_...

ROUTE_META = "fxprep_dynamo_route"


class _Holder:
    """Builds the attribute tree the prepared GraphModule is created from: fresh containers, the
    user's own leaf modules and tensors at their original paths, never mutating a user module."""

    def __init__(self) -> None:
        self.root = nn.Module()
        self.fresh = {id(self.root)}

    def install(self, path: str, obj: Any, persistent: bool = True) -> None:
        *prefix, leaf = path.split(".")
        container = self.root
        atoms = path.split(".")
        for i, atom in enumerate(prefix):
            nxt = container._modules.get(atom)
            if nxt is None:
                nxt = nn.Module()
                self.fresh.add(id(nxt))
                container.add_module(atom, nxt)
            elif id(nxt) not in self.fresh:
                try:
                    reachable = get_path(nxt, ".".join(atoms[i + 1:])) is obj
                except AttributeError:
                    reachable = False
                if reachable:
                    return  # reachable through the user's own module already
                raise ReliftError(f"cannot place {path!r}: {atom!r} is a user module holding something else")
            container = nxt
        existing = container._modules.get(leaf) if isinstance(obj, nn.Module) else getattr(container, leaf, None)
        if existing is obj:
            return
        if isinstance(obj, nn.Module):
            container._modules[leaf] = obj  # replaces a fresh container created for a get_attr
        elif isinstance(obj, nn.Parameter):
            container.register_parameter(leaf, obj)
        elif isinstance(obj, torch.Tensor):
            container.register_buffer(leaf, obj, persistent=persistent)
        else:
            setattr(container, leaf, obj)


def _free_name(taken: set[str], model: nn.Module, base: str) -> str:
    base = re.sub(r"\W", "_", base).strip("_") or "const"
    name, i = f"_fxprep_const_{base}", 0
    while name in taken or hasattr(model, name):
        i += 1
        name = f"_fxprep_const_{base}_{i}"
    taken.add(name)
    return name


def build(dgm: fx.GraphModule, stacks: Stacks, targets: dict[fx.Node, str], pytree_info: Any, notes: list[str],
          wrappers: dict[str, Site] | None = None) -> fx.GraphModule:
    """The prepared module over ``dgm``'s re-lifted graph (``stacks``: the model's frames resolver,
    holding the model and its names; ``targets``: each ``call_module`` node's qualified name)."""
    model, names = stacks.model, stacks.names
    graph = dgm.graph
    holder = _Holder()
    taken: set[str] = set()
    constants: list[str] = []
    readers: set[str] = set()
    # Modules first, so tensors under them are found through the user's module.
    for node in graph.nodes:
        if node.op != "call_module" or (wrappers and targets.get(node) in wrappers):
            continue
        target = targets.get(node)
        if target is None:
            frames = stacks.of(node)
            module = frames[-1].module if frames else None
            target = names.module_name(module) if module is not None else None
            if target is None:
                raise ReliftError(f"call_module {node.target} does not map to a submodule of the model")
        node.target = target
        holder.install(target, model.get_submodule(target))
    if wrappers:
        place_wrappers(graph, model, holder, targets, wrappers)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        user = node.meta.pop("fxprep_user_attr", None)
        obj = get_path(model, user) if user is not None else get_path(dgm, str(node.target))
        if isinstance(obj, nn.Module) and (qual := names.module_name(obj)) is not None:  # an opaque part's argument
            node.target = qual
            holder.install(qual, obj)
        elif isinstance(obj, torch.Tensor) and id(obj) in names.tensors:
            qual, kind = names.tensors[id(obj)]
            node.target = qual
            holder.install(qual, obj, persistent=kind != "attribute" and qual not in names.non_persistent)
        elif isinstance(obj, torch.Tensor):
            new = _free_name(taken, model, str(node.target))
            frames = stacks.of(node)
            readers.add(frames[-1].qualname if frames else "")
            node.target = new
            holder.install(new, obj, persistent=False)
            constants.append(new)
        else:
            new = str(node.target)
            if hasattr(model, new) or new in taken:
                new = _free_name(taken, model, new)
            taken.add(new)
            node.target = new
            holder.install(new, obj)
    for node in graph.nodes:
        frames = stacks.of(node) if node.meta.get("nn_module_stack") else []
        # a module held in a global (the kernels package's wrapper of transformers' apply_rotary_pos_emb)
        # is no module of the model: its frame would name the op after Dynamo's mangled global, and
        # differently in a block captured alone (prefixed with the block's path) than in the model
        frames = [f for f in frames if f.module is not None or not _GLOBAL_SOURCE.match(str(f.source))]
        if frames:
            stack: dict[str, tuple[str, type]] = {}
            for f in frames:
                stack[f.qualname if f.k == 0 else f"{f.qualname}@{f.k}"] = (f.qualname, f.cls)
            node.meta["nn_module_stack"] = stack
        elif node.meta.get("nn_module_stack"):
            del node.meta["nn_module_stack"]
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph._codegen = torch.fx.graph._PyTreeCodeGen(pytree_info)
    graph.lint()
    gm = graph_module(holder.root, graph, type(model).__name__)
    if constants:
        notes.append(
            f"{len(constants)} tensor(s) that are neither parameters nor buffers of the model were baked into "
            f"the graph as constants ({', '.join(constants[:5])}{'...' if len(constants) > 5 else ''}; read in "
            f"{', '.join(repr(r) for r in sorted(readers)[:5])})."
        )
    gm.meta["fxprep_constants"] = constants
    _reorder_like(gm, model)
    return gm


def place_wrappers(graph: fx.Graph, model: nn.Module, holder: _Holder, targets: dict[fx.Node, str],
                   wrappers: dict[str, Site]) -> None:
    """Install the module that calls each opaque method or function site: under its owner's path
    when the owner is a container fxprep made (``rpn.filter_proposals``), else at the root under a
    flat name (the owner is the user's own module, which must not gain a child)."""
    placed: dict[str, str] = {}
    for node in graph.nodes:
        name = targets.get(node) if node.op == "call_module" else None
        if name not in wrappers:
            continue
        if name not in placed:
            site = wrappers[name]
            module = site.eager_module(model)
            tail = (site.qualname[len(site.path) + 1:] if site.path else site.qualname).replace(".", "_")
            preferred = f"{site.path}.{tail}" if site.path else tail
            flat = re.sub(r"\W", "_", site.qualname)
            for candidate in (preferred, flat, *(f"{flat}_{i}" for i in range(1, 100))):
                if _free_path(holder, model, candidate):
                    try:
                        holder.install(candidate, module)
                    except ReliftError:
                        continue
                    placed[name] = candidate
                    break
            else:
                raise ReliftError(f"no free name for opaque part '{site.qualname}'")
        node.target = placed[name]
        _rename(node, re.sub(r"\W", "_", placed[name]))


def _free_path(holder: _Holder, model: nn.Module, path: str) -> bool:
    """Nothing is at ``path`` in the holder, and no module or tensor of the model has that name."""
    try:
        get_path(holder.root, path)
        return False
    except AttributeError:
        pass
    return not holds(model, path)


def _reorder_like(gm: fx.GraphModule, model: nn.Module) -> None:
    """Order the containers fxprep created like the original's, so ``state_dict()`` keys come in
    the original order too."""
    for name, module in gm.named_modules():
        if module is not gm and type(module) is not nn.Module:
            continue
        try:
            original = model.get_submodule(name) if name else model
        except AttributeError:
            continue
        for attr in ("_parameters", "_buffers", "_modules"):
            items = getattr(module, attr)
            ref = {k: i for i, k in enumerate(getattr(original, attr))}
            ordered = sorted(items.items(), key=lambda kv: ref.get(kv[0], len(ref)))
            items.clear()
            items.update(ordered)


def unreferenced_parameters(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """Parameters of ``model`` that ``gm`` neither reads (get_attr) nor holds in a called leaf."""
    used: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = get_path(gm, str(node.target))
            if isinstance(obj, torch.Tensor):
                used.add(id(obj))
        elif node.op == "call_module":
            used.update(id(p) for p in gm.get_submodule(str(node.target)).parameters())
    return [name for name, p in model.named_parameters() if id(p) not in used]


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _first_tensor(call: ExampleInputs) -> tuple[int, torch.Tensor] | None:
    for i, leaf in enumerate(pytree.tree_leaves((call.args, call.kwargs))):
        if isinstance(leaf, torch.Tensor):
            return i, leaf
    return None


@dataclass
class LiftTarget:
    """What a Dynamo graph is re-lifted against: the module Dynamo captured (the model, or one
    block of it with block reuse), its leaf policy, the two calls, the route taken, and the notes
    the re-lifting adds to (for the report)."""

    model: nn.Module
    policy: LeafPolicy
    capture_call: ExampleInputs  # what Dynamo was called with (``concrete_args`` included)
    prepared_call: ExampleInputs  # how the prepared module will be called
    route: str  # "flag" or "regroup" (:mod:`.export`)
    notes: list[str] = field(default_factory=list)


def relift(dgm: fx.GraphModule, target: LiftTarget, box: BlackBox | None = None, *,
           device_literals: bool = True, decided: bool = False) -> tuple[fx.GraphModule, dict[str, str]]:
    """Turn Dynamo's graph into the module-level one of ``target`` (see the module docstring).

    ``box``: the parts Dynamo called without tracing into.
    Returns the module and the extra leaves with reasons. ``device_literals=False`` leaves device
    literals as they are (block reuse replaces them once, on the assembled graph:
    :func:`follow_input_device`). ``decided``: the capture decided values read from data from the
    example, and the run-time asserts on unbacked sizes are those decisions' checks
    (:mod:`fxprep.decisions`): every one is kept, also where opaque parts are re-lifted."""
    model, capture_call, prepared_call, notes = target.model, target.capture_call, target.prepared_call, target.notes
    graph = dgm.graph
    names = Names(model)
    stacks = Stacks(model, names)
    info = graph._codegen.pytree_info if isinstance(graph._codegen, torch.fx.graph._PyTreeCodeGen) else None
    if info is None:
        raise ReliftError("Dynamo graph has no pytree signature")
    graph.owning_module = None  # targets change meaning here: checks come back in _build
    placeholders = _placeholders(graph)
    flat_capture = pytree.tree_flatten_with_path((capture_call.args, capture_call.kwargs))[0]
    if len(placeholders) != len(flat_capture):
        raise ReliftError(f"Dynamo graph has {len(placeholders)} inputs for {len(flat_capture)} flattened arguments")

    dynamo_cleanup.remove_grad_toggles(dgm, enabled_at_capture=torch.is_grad_enabled(), notes=notes)
    dynamo_cleanup.rewrite_sym_ops(dgm)
    dynamo_cleanup.portable_tensor_checks(dgm)
    dynamo_cleanup.setitem_as_method(dgm)
    dynamo_cleanup.fold_numpy_constants(dgm)
    dynamo_cleanup.restore_autograd_functions(dgm, stacks.owner)
    dynamo_cleanup.remove_noise(dgm)
    opaque_calls, wrappers = relift_opaque(dgm, box, names, stacks.owner)  # opaque parts → call_module
    if opaque_calls and not decided:
        drop_size_asserts(dgm)
    policy = with_opaque(target.policy, box)

    # Leaf calls: re-target Dynamo's call_module nodes, collapse inlined leaves.
    method_calls = module_method_calls(dgm, names, stacks)
    regrouper = Regrouper(dgm, policy, stacks, capture_call, list(placeholders))
    regrouper.run()
    for node, name in [*method_calls.items(), *opaque_calls.items()]:
        if not getattr(node, "_erased", False):  # not collapsed into an enclosing leaf
            regrouper.targets.setdefault(node, name)
    notes.extend(regrouper.notes)

    # Inputs: keep those of the prepared call; bake concrete_args in.
    prepared_flat = pytree.tree_flatten_with_path((prepared_call.args, prepared_call.kwargs))[0]
    prepared_paths = {pytree.keystr(p) for p, _ in prepared_flat}
    kept: list[fx.Node] = []
    for node, (path, value) in zip(placeholders, flat_capture):
        if pytree.keystr(path) in prepared_paths:
            kept.append(node)
            continue
        if node.users and isinstance(value, torch.Tensor):
            with graph.inserting_after(node):
                const = graph.get_attr(f"_fxprep_concrete_{node.name}")
            setattr(dgm, str(const.target), value)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
        elif node.users:
            for user in list(node.users):
                user.replace_input_with(node, value)
        graph.erase_node(node)
    if len(kept) != len(prepared_flat):
        raise ReliftError("inputs of the prepared call do not match the captured graph's inputs")
    orig_args = positional_names(model, len(prepared_call.args)) + list(prepared_call.kwargs)
    for node, (path, _) in zip(kept, prepared_flat):
        _rename(node, _input_name(path, orig_args, len(prepared_call.args)))
    in_spec = pytree.tree_structure((prepared_call.args, prepared_call.kwargs))
    pytree_info = torch.fx.graph._PyTreeInfo(orig_args, in_spec, info.out_spec)

    if device_literals:
        follow_input_device(dgm, kept, prepared_call, notes)
    gm = build(dgm, stacks, regrouper.targets, pytree_info, notes, wrappers)
    relift_conds(gm, stacks, policy, notes)  # torch.cond branches: leaves → call_module
    gm.meta[ROUTE_META] = target.route
    return gm, regrouper.extra_leaves


def follow_input_device(gm: fx.GraphModule, placeholders: list[fx.Node], prepared_call: ExampleInputs,
                        notes: list[str]) -> None:
    """Device literals equal to the first input tensor's device read that input's device instead
    (``placeholders``: the graph's inputs, in the order of the prepared call's flattened arguments)."""
    first = _first_tensor(prepared_call)
    anchor = placeholders[first[0]] if first is not None else None
    device = first[1].device if first is not None else None
    dynamo_cleanup.replace_device_literals(gm, anchor, device, notes=notes)


def _input_name(path: tuple[Any, ...], orig_args: list[str], n_positional: int) -> str:
    """``x``, ``input_ids``, ``pair_0``: a readable name for a flattened input."""
    parts: list[str] = []
    if len(path) >= 2 and isinstance(path[0], pytree.SequenceKey):
        first = path[1]
        if path[0].idx == 0 and isinstance(first, pytree.SequenceKey) and first.idx < n_positional:
            parts.append(orig_args[first.idx])
        elif isinstance(first, pytree.MappingKey):
            parts.append(str(first.key))
        for key in path[2:]:
            parts.append(str(getattr(key, "idx", getattr(key, "key", getattr(key, "name", "")))))
    name = re.sub(r"\W", "_", "_".join(parts)) or "input"
    return name if not name[0].isdigit() else f"input_{name}"


def _rename(node: fx.Node, name: str) -> None:
    try:
        node._rename(name)
        if node.op == "placeholder":
            node.target = node.name
    except Exception:  # noqa: BLE001 - a cosmetic nicety only
        pass
