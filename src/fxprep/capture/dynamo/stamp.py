"""Stamping: one captured block graph inlined at every call of an instance that runs the same code.

:func:`inline` replaces a block's ``call_module`` with a copy of the block's graph bound to that
instance's own submodules and tensors; :func:`assemble` builds the prepared ``GraphModule`` the way
:func:`.relift.build` does for a whole-model capture. Anything that does not line up raises
:class:`StampError`, and reuse falls back to the whole-model capture.

See docs/concepts/block-reuse.md ("Under the hood").
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.paths import get_path, has_path, holds
from ..common import graph_module
from ..sites import OpaqueFunction, OpaqueMethod
from .blocks import call_inputs, freeze, shape_kind
from .names import Names
from .relift import _free_name, _Holder, _reorder_like


class StampError(RuntimeError):
    """A block graph could not be inlined where its instance is called (reuse falls back)."""


def _outputs(block: fx.GraphModule, env: dict[fx.Node, Any]) -> Any:
    output = next(n for n in reversed(block.graph.nodes) if n.op == "output")
    flat = output.args[0]
    if not isinstance(flat, (list, tuple)):
        flat = [flat]
    info = block.graph._codegen.pytree_info if isinstance(block.graph._codegen, fx.graph._PyTreeCodeGen) else None
    if info is None or info.out_spec is None:
        raise StampError("the block graph has no output structure")
    mapped = [env[v] if isinstance(v, fx.Node) else v for v in flat]
    return pytree.tree_unflatten(mapped, info.out_spec)


def foreign_attributes(block: fx.GraphModule, first: nn.Module) -> list[str]:
    """The ``get_attr`` targets of ``block`` that are not tensors of the instance it was captured
    from: constants, ``torch.cond`` branch graphs. They may be that instance's own (a tensor in a
    list attribute, a branch calling its leaves), so a graph holding any is not stamped for others."""
    found = []
    for node in block.graph.nodes:
        if node.op != "get_attr":
            continue
        obj = get_path(block, str(node.target))
        try:
            own = get_path(first, str(node.target)) is obj
        except AttributeError:
            own = False
        if not (own and isinstance(obj, torch.Tensor)):
            found.append(str(node.target))
    return found


def block_output_signature(block: fx.GraphModule) -> Any:
    """:func:`.stubs.output_signature` of what ``block`` returns, from its example values."""
    output = next(n for n in reversed(block.graph.nodes) if n.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    values = [v.meta.get("example_value") if isinstance(v, fx.Node) else v for v in flat]
    info = block.graph._codegen.pytree_info if isinstance(block.graph._codegen, fx.graph._PyTreeCodeGen) else None
    if info is None or info.out_spec is None:
        raise StampError("the block graph has no output structure")
    leaves = [("t", shape_kind(v.shape), v.dtype) if isinstance(v, torch.Tensor) else freeze(v) for v in values]
    return (str(info.out_spec), tuple(leaves))


def _same_value_kind(new: Any, old: fx.Node) -> bool:
    """A stamped output against the value the outer graph had for it (Dynamo's example values)."""
    ev_old = old.meta.get("example_value")
    if not isinstance(new, fx.Node):
        return not isinstance(ev_old, torch.Tensor)
    ev_new = new.meta.get("example_value")
    if isinstance(ev_old, torch.Tensor) or isinstance(ev_new, torch.Tensor):
        return (isinstance(ev_old, torch.Tensor) and isinstance(ev_new, torch.Tensor)
                and shape_kind(ev_old.shape) == shape_kind(ev_new.shape) and ev_old.dtype == ev_new.dtype)
    return True


def _rewire(node: fx.Node, value: Any) -> None:
    """Make the users of ``node`` (the block call or an access into its output) read ``value``."""
    if isinstance(value, fx.Node) or not isinstance(value, (tuple, list, dict)):
        if node.users and not _same_value_kind(value, node):
            raise StampError(f"the block's output differs from what the outer graph made of '{node.name}'")
        for user in list(node.users):
            user.replace_input_with(node, value)
        return
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem and user.args[0] is node
                and len(user.args) == 2 and not isinstance(user.args[1], fx.Node)):
            raise StampError(f"the block's output is used as a whole by '{user.name}'")
        try:
            part = value[user.args[1]]
        except (IndexError, KeyError, TypeError) as err:
            raise StampError(f"the block's output has no item {user.args[1]!r}") from err
        _rewire(user, part)
        user.graph.erase_node(user)


class Stamper:
    """Inlines block graphs into the outer graph and collects what the prepared module must hold."""

    def __init__(self, outer: fx.GraphModule, model: nn.Module):
        self.outer = outer
        self.graph = outer.graph
        self.model = model
        self.objects: dict[str, Any] = {}  # get_attr target -> object, for targets stamped in
        self.constants: list[str] = list(outer.meta.get("fxprep_constants", []))
        self.taken: set[str] = {str(n.target) for n in self.graph.nodes if n.op == "get_attr"}
        # call_module target -> a module a pass made in a block, and the instance it is placed for
        self.added: dict[str, tuple[nn.Module, nn.Module]] = {}
        self.tensors: dict[int, dict[int, str]] = {}  # id(first instance) -> its tensors' paths

    def inline(self, call: fx.Node, block: fx.GraphModule, first: nn.Module, prefix: str,
               instance: nn.Module, made: dict[str, nn.Module] | None = None) -> None:
        """Replace ``call`` (of ``instance``, at ``prefix``) by a copy of ``block``, the graph
        captured from ``first``. ``made``: the block's modules that passes created (functional
        ops turned into modules, :func:`converted_block`), by target: each instance gets its own
        copy, bound to its own tensors."""
        made = made or {}
        if made and id(first) not in self.tensors:
            self.tensors[id(first)] = _tensor_names(first)
        tensors = self.tensors.get(id(first), {})
        flat, _ = call_inputs(call)
        placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(flat):
            raise StampError(f"'{prefix}' is called with {len(flat)} inputs, its block graph takes {len(placeholders)}")
        env: dict[fx.Node, Any] = dict(zip(placeholders, flat))
        outer_stack = dict(call.meta.get("nn_module_stack") or {})
        if outer_stack:  # the call's own frame names the class Dynamo saw during capture
            key = next(reversed(outer_stack))
            outer_stack[key] = (outer_stack[key][0], type(instance))
        self.graph.owning_module = None  # targets are checked by assemble()
        with self.graph.inserting_before(call):
            for node in block.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                new = self.graph.node_copy(node, lambda n: env[n])
                if node.op == "call_module":
                    new.target = f"{prefix}.{node.target}"
                    if node.target in made:
                        self._add(new.target, str(node.target), made[str(node.target)], first, instance, tensors)
                elif node.op == "get_attr":
                    new.target = self._attr(str(node.target), block, first, prefix, instance)
                stack = dict(outer_stack)
                for key, (qual, cls) in (node.meta.get("nn_module_stack") or {}).items():
                    stack[f"{prefix}.{key}" if key else prefix] = (f"{prefix}.{qual}" if qual else prefix, cls)
                if stack:
                    new.meta["nn_module_stack"] = stack
                env[node] = new
        _rewire(call, _outputs(block, env))
        if call.users:
            raise StampError(f"'{call.name}' is still used after inlining")
        self.graph.erase_node(call)

    def _add(self, qual: str, target: str, module: nn.Module, first: nn.Module, instance: nn.Module,
             tensors: dict[int, str]) -> None:
        # the name the pass chose in the first instance must be free in this one too (on the whole
        # graph the pass would have chosen another)
        if qual in self.added and self.added[qual][1] is instance:
            return  # the instance's second call: the module placed for its first
        if qual in self.added or _taken(instance, target, module):
            raise StampError(f"'{qual}' is taken: a module made in the block cannot be placed there")
        new = module if instance is first else _instance_copy(module, instance, tensors)
        if isinstance(new, OpaqueMethod):
            _rebind(new, first, instance, qual[:-len(target) - 1])
        self.added[qual] = (new, instance)

    def _attr(self, target: str, block: fx.GraphModule, first: nn.Module, prefix: str, instance: nn.Module) -> str:
        obj = get_path(block, target)
        try:
            own = get_path(first, target) is obj
        except AttributeError:
            own = False
        if own:  # a tensor of the block: the instance's own one
            try:
                mine = get_path(instance, target)
            except AttributeError as err:
                raise StampError(f"'{prefix}' has no '{target}'") from err
            qual = f"{prefix}.{target}"
            self.objects[qual] = mine
            return qual
        name = _free_name(self.taken, self.model, target.removeprefix("_fxprep_const_"))
        self.objects[name] = obj
        if isinstance(obj, torch.Tensor):
            self.constants.append(name)
        return name

    def assemble(self, route_meta: dict[str, Any]) -> fx.GraphModule:
        """The prepared module over the stamped graph, built like :func:`.relift.build` builds it."""
        names = Names(self.model)
        holder = _Holder()
        for node in self.graph.nodes:
            if node.op == "call_module":
                placed = self.added.get(str(node.target))
                try:
                    module = self.model.get_submodule(str(node.target)) if placed is None else placed[0]
                except AttributeError:
                    # the module calling an opaque method, placed by the outer re-lifting (relift.place_wrappers)
                    module = _outer_module(self.outer, str(node.target))
                holder.install(str(node.target), module)
        for node in self.graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            obj = self.objects[target] if target in self.objects else get_path(self.outer, target)
            if isinstance(obj, torch.Tensor) and id(obj) in names.tensors:
                qual, kind = names.tensors[id(obj)]
                if qual != target:
                    raise StampError(f"'{target}' is known to the model as '{qual}'")
                holder.install(target, obj, persistent=kind != "attribute" and qual not in names.non_persistent)
            elif isinstance(obj, torch.Tensor):
                holder.install(target, obj, persistent=False)
            else:
                holder.install(target, obj)
        self.graph.lint()
        gm = graph_module(holder.root, self.graph, type(self.model).__name__)
        gm.meta.update(route_meta)
        gm.meta["fxprep_constants"] = self.constants
        _reorder_like(gm, self.model)
        return gm


def _outer_module(outer: fx.GraphModule, target: str) -> nn.Module:
    try:
        module = outer.get_submodule(target)
    except AttributeError as err:
        raise StampError(f"no submodule '{target}'") from err
    return module


def converted_block(block: fx.GraphModule, convert: Any,
                    first: nn.Module) -> tuple[fx.GraphModule, dict[str, nn.Module]] | None:
    """``block`` (captured from ``first``) run through ``convert(gm, first)`` (a pass rewriting a
    graph module in place: fxprep's functional-to-module conversion), on a copy: so each op of a repeated block is converted once,
    then stamped out, rather than once per layer on the whole graph. Returns the converted copy and
    the modules the pass made, by target; None when one of them cannot be copied per instance
    (one with submodules), and then the block is stamped as captured and converted on the whole graph."""
    graph = copy.deepcopy(block.graph)  # nodes copied, their metadata shared (fx's Graph.__deepcopy__)
    converted = graph_module(block, graph, type(block).__name__)
    converted.meta.update(block.meta)
    convert(converted, first)
    made = modules_not_of(converted, block)
    if any(module._modules for module in made.values()):
        return None
    return converted, made


def modules_not_of(gm: fx.GraphModule, owner: nn.Module) -> dict[str, nn.Module]:
    """The modules ``gm`` calls that are not ``owner``'s own at the same path, by target: those a
    pass or the re-lifting made in a block graph (captured from ``owner``), which each instance it
    is stamped for gets a copy of."""
    made: dict[str, nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        try:
            own = get_path(owner, str(node.target)) is module
        except AttributeError:
            own = False
        if not own:
            made[str(node.target)] = module
    return made


def names_free(made: dict[str, nn.Module], instances: list[nn.Module]) -> bool:
    """Whether every instance has nothing where the block's made modules go (the pass chose the
    names in the first instance; on the whole graph it would choose others where one is taken)."""
    return not any(_taken(instance, target, module) for instance in instances for target, module in made.items())


def _taken(instance: nn.Module, target: str, module: nn.Module) -> bool:
    """Whether ``instance`` has something at ``target``, where ``module`` (made in the block) would go.
    A module calling an opaque method is placed beside that method's name (``mixer.scan``), in a
    container fxprep makes: only a module, parameter or buffer of the user's there takes the name."""
    if not isinstance(module, (OpaqueMethod, OpaqueFunction)):
        return has_path(instance, target)
    return holds(instance, target)


def _tensor_names(root: nn.Module) -> dict[int, str]:
    """Every parameter and buffer of ``root`` by identity, with its path."""
    out: dict[int, str] = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(tensor), name)
    return out


def _rebind(module: OpaqueMethod, first: nn.Module, instance: nn.Module, prefix: str) -> None:
    """Point ``module`` (calling a method of a module inside ``first``, an opaque part of the block)
    at the module in the same place inside ``instance``, found at ``prefix`` in the model."""
    path = next((name for name, m in first.named_modules(remove_duplicate=False) if m is module.owner), None)
    if path is None:
        raise StampError(f"the opaque part '{module.owner_path}.{module.method}' is not inside the block")
    try:
        owner = instance.get_submodule(path)
    except AttributeError as err:
        raise StampError(f"'{prefix}' has no '{path}'") from err
    object.__setattr__(module, "owner", owner)
    module.owner_path = f"{prefix}.{path}" if path else prefix


def _instance_copy(module: nn.Module, instance: nn.Module, tensors: dict[int, str]) -> nn.Module:
    """A copy of ``module`` (made by a pass inside the first instance's block graph) for ``instance``:
    the same class and settings, its own containers, and every tensor of the first instance it held
    (an ``F.linear``'s weight turned into an ``nn.Linear``) replaced by ``instance``'s tensor at the
    same path. Not ``copy.copy``: that pickles a module's state (slow, and a BoundOp names its
    callable on the way)."""
    new = object.__new__(type(module))
    state = {k: v.copy() if isinstance(v, (dict, set, list)) else v for k, v in module.__dict__.items()}
    new.__dict__.update(state)
    for kind in ("_parameters", "_buffers"):
        held = new.__dict__[kind]
        for key, tensor in held.items():
            if tensor is None:
                continue
            path = tensors.get(id(tensor))
            if path is None:
                raise StampError(f"'{type(module).__name__}' holds a tensor that is not the block's own")
            try:
                held[key] = get_path(instance, path)
            except AttributeError as err:
                raise StampError(f"the instance has no '{path}'") from err
    return new


