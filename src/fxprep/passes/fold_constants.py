"""Shape-only computations folded into buffers: what depends on no input value and no dynamic size.

Chains that compute the same tensor on every call (transformers' causal mask, position ids, rotary
tables) trip re-tracing toolkits and attract quantizers. :func:`run` folds each chain whose result
depends on no input value, no dynamic size and no saved weight into a non-persistent buffer read by
``get_attr``, so ``state_dict()`` is unchanged; the chain is removed, with the checks that read only
it.

See docs/concepts/retraceable.md ("Under the hood") for what counts as constant.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .input_checks import is_assert
from .shape_prop import has_symbolic_size, known_value

CONSTANT_CHECK = "fxprep_constant_check"  # node meta: an assert on constants only, removed by run()

_METADATA_ATTRS = {"device", "dtype", "is_cuda", "is_floating_point", "layout"}
_SIZE_ATTRS = {"shape", "ndim"}
_SIZE_METHODS = {"size", "dim", "numel", "get_device"}
_RANDOM = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "dropout", "uniform")


def _static_shape(node: Any, static_shapes: bool) -> bool:
    if static_shapes or not isinstance(node, fx.Node):
        return True
    value = known_value(node)
    return isinstance(value, torch.Tensor) and not has_symbolic_size(value)


def _random_or_mutating(target: Any) -> bool:
    name = getattr(target, "__name__", str(target))
    return name.endswith("_") and not name.endswith("__") or any(r in name for r in _RANDOM) \
        or target is operator.setitem


def _foldable_attr(gm: fx.GraphModule, target: str) -> bool:
    """A get_attr read of a tensor that is not state the user loads: a non-persistent buffer or a
    plain constant (never a Parameter or a buffer in ``state_dict``)."""
    owner_path, _, field = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_path)
    except AttributeError:
        return False
    value = getattr(owner, field, None)
    if isinstance(value, nn.Parameter):
        return False
    if isinstance(value, torch.Tensor) and field in owner._buffers:
        return field in owner._non_persistent_buffers_set
    return isinstance(value, torch.Tensor)


def _stateless_module(module: nn.Module) -> bool:
    if next(module.parameters(), None) is not None:
        return False
    if any(name not in m._non_persistent_buffers_set for m in module.modules() for name in m._buffers):
        return False
    return not isinstance(module, nn.modules.dropout._DropoutNd | nn.Dropout)


def constant_nodes(gm: fx.GraphModule, *, static_shapes: bool = False) -> set[fx.Node]:
    """The nodes whose result is the same on every call (see the module docstring);
    ``static_shapes``: every size is the example's, recorded or not."""
    constant: set[fx.Node] = set()

    def inputs_constant(node: fx.Node) -> bool:
        return all(n in constant for n in node.all_input_nodes)

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or has_symbolic_size(known_value(node)):
            continue
        if node.op == "get_attr":
            if _foldable_attr(gm, str(node.target)):
                constant.add(node)
            continue
        target = node.target
        if node.op == "call_function" and target is getattr and len(node.args) == 2:
            attr = node.args[1]
            if attr in _METADATA_ATTRS or attr in _SIZE_ATTRS and _static_shape(node.args[0], static_shapes):
                constant.add(node)
                continue
        if node.op == "call_method" and target in _SIZE_METHODS and _static_shape(node.args[0], static_shapes):
            constant.add(node)
            continue
        if node.op == "call_method" and target in _METADATA_ATTRS:
            constant.add(node)
            continue
        if node.op == "call_module":
            if _stateless_module(gm.get_submodule(str(target))) and node.all_input_nodes and inputs_constant(node):
                constant.add(node)
            continue
        if node.op in ("call_function", "call_method") and not _random_or_mutating(target) and inputs_constant(node):
            if node.all_input_nodes or node.op == "call_function":  # torch.arange(8) reads no node
                constant.add(node)
    return constant


def foldable(gm: fx.GraphModule, *, static_shapes: bool = False) -> list[fx.Node]:
    """Constant nodes whose result a live node (or the output) uses: the ones to turn into buffers
    (``static_shapes`` as for :func:`constant_nodes`). Each must have produced a tensor (known once
    the graph has run: see :func:`run`)."""
    constant = constant_nodes(gm, static_shapes=static_shapes)
    frontier = []
    for node in gm.graph.nodes:
        if node in constant and node.op != "get_attr" and any(u not in constant for u in node.users):
            frontier.append(node)
        if node in constant and is_assert(node):
            node.meta[CONSTANT_CHECK] = True
    return frontier


def run(gm: fx.GraphModule, values: dict[fx.Node, Any], *, holder: str = "fxprep_constants") -> list[str]:
    """Replace each node of ``values`` whose value is a tensor by a read of a new non-persistent
    buffer ``<holder>.<node name>`` holding it; remove what then has no users. Returns the buffer
    names. ``values`` comes from :func:`fxprep.passes.shape_prop.run` with ``keep=foldable(gm)``.
    Edits ``gm.graph`` in place; the caller recompiles."""
    folded = []
    inlined = False
    checks = [n for n in gm.graph.nodes if n.meta.pop(CONSTANT_CHECK, False) and not n.users]
    for node in checks:  # held for the example, the same on every call: not kept alive (fx calls asserts impure)
        gm.graph.erase_node(node)
    constants = gm.get_submodule(holder) if hasattr(gm, holder) else None
    for node, value in values.items():
        literal = _literal(value)
        if literal is not None:  # a size computed from static shapes: written into its users
            node.replace_all_uses_with(literal)  # type: ignore[arg-type]
            inlined = True
            continue
        if not isinstance(value, torch.Tensor) or value.requires_grad:
            continue
        if constants is None:
            constants = nn.Module()
            gm.add_module(holder, constants)
        name = node.name
        while hasattr(constants, name):  # a node named "to" or "float" must not shadow nn.Module's methods
            name = f"{name}_"
        constants.register_buffer(name, value.detach(), persistent=False)
        with gm.graph.inserting_before(node):
            read = gm.graph.get_attr(f"{holder}.{name}")
        read.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "example_value")}
        node.replace_all_uses_with(read)
        folded.append(f"{holder}.{name}")
    if folded or inlined or checks:
        remove_dead_code(gm)
    return folded


def _literal(value: Any) -> Any:
    """``value`` as a literal fx can write in a node's arguments (an int, a float, a tuple of
    them: ``torch.Size`` as a plain tuple), or None. Re-tracers fail on ``torch.Size([s0, s1])``
    of traced sizes; the literal is what a static capture writes."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, tuple | list) and value and all(isinstance(v, bool | int | float) for v in value):
        return tuple(value) if isinstance(value, tuple) else list(value)
    return None


def writes(node: fx.Node) -> bool:
    """Whether ``node`` has an effect besides its result: fx's own impure ops, and writes into a
    tensor (``t.__setitem__(i, v)``, ``t.index_put_(...)``, in-place methods) that fx's dead-code
    elimination would drop because nothing reads their result (MoE code fills ``torch.empty_like``
    this way)."""
    if node.is_impure():
        return True
    name = getattr(node.target, "__name__", str(node.target))
    if node.op in ("call_method", "call_function"):
        return node.target is operator.setitem or name == "__setitem__" or name.endswith("_") and not name.endswith("__")
    return False


def remove_dead_code(gm: fx.GraphModule) -> None:
    """fx's dead-code elimination, keeping every node that writes (see :func:`writes`)."""
    gm.graph.eliminate_dead_code(is_impure_node=writes)
