"""Which nodes carry tensors, and which carry Python values (shapes, ints, flags).

The functional → module pass must turn ``x + y`` on tensors into an ``Add`` module but must leave
``h // p`` on Python ints alone (shape arithmetic is not computation a quantizer could act on). With
example inputs we simply run the graph once and look; without, the kind is inferred from the op.
Results go to ``node.meta["fxprep_kind"]``: ``"tensor"``, ``"other"`` or ``"unknown"``.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..core.inputs import ExampleInputs

TENSOR, OTHER, UNKNOWN = "tensor", "other", "unknown"

# Tensor methods / attributes that return Python values, not tensors.
NON_TENSOR_METHODS = frozenset(
    {
        "size", "dim", "numel", "item", "tolist", "element_size", "stride", "data_ptr", "is_contiguous",
        "nelement", "ndimension", "get_device", "storage_offset", "is_floating_point", "is_complex",
        "__len__", "dim_order", "is_nonzero", "equal",
    }
)
NON_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse", "is_meta"})
NON_TENSOR_FUNCTIONS = frozenset({builtins.len, torch.numel, torch.is_tensor, torch.is_floating_point, torch._assert})


def kind_of_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return TENSOR
    leaves = pytree.tree_leaves(value)
    if leaves and any(isinstance(v, torch.Tensor) for v in leaves):
        return UNKNOWN  # a container of tensors: its getitem children are tensors
    return OTHER


def _static_kind(node: fx.Node, root: torch.nn.Module) -> str:
    if node.op == "placeholder":
        return TENSOR
    if node.op == "get_attr":
        try:
            value = operator.attrgetter(node.target)(root)
        except AttributeError:
            return UNKNOWN
        return kind_of_value(value)
    if node.op == "call_module":
        return TENSOR
    if node.op == "call_method":
        if node.target in NON_TENSOR_METHODS:
            return OTHER
        return TENSOR
    if node.op != "call_function":
        return OTHER
    target = node.target
    input_kinds = [n.meta.get("fxprep_kind", UNKNOWN) for n in node.all_input_nodes]
    if target in NON_TENSOR_FUNCTIONS:
        return OTHER
    if target is builtins.getattr:
        attr = node.args[1] if len(node.args) > 1 else None
        return OTHER if attr in NON_TENSOR_ATTRS else (input_kinds[0] if input_kinds else UNKNOWN)
    if target is operator.getitem:
        container = node.args[0]
        if isinstance(container, fx.Node):
            kind = container.meta.get("fxprep_kind", UNKNOWN)
            return TENSOR if kind in (TENSOR, UNKNOWN) and container.op != "placeholder" or kind == TENSOR else kind
        return UNKNOWN
    module = getattr(target, "__module__", "") or ""
    if module in ("_operator", "operator", "math", "builtins"):
        if TENSOR in input_kinds:
            return TENSOR
        return OTHER if all(k == OTHER for k in input_kinds) else UNKNOWN
    if module.startswith("torch"):
        return TENSOR
    return UNKNOWN


def annotate(gm: fx.GraphModule, example: ExampleInputs | None = None) -> fx.GraphModule:
    """Set ``node.meta['fxprep_kind']`` on every node.

    With ``example`` the graph is run once on a fresh copy of the inputs (state preserved by the
    caller); a node's recorded value wins over inference. A node already carrying a tracer's
    ``example_value`` (Dynamo) is read from it without running anything.
    """
    seen: dict[fx.Node, str] = {}
    if example is not None and not any("example_value" in n.meta for n in gm.graph.nodes):
        seen = _run_and_record(gm, example)
    for node in gm.graph.nodes:
        if node in seen:
            node.meta["fxprep_kind"] = seen[node]
        elif "example_value" in node.meta:
            node.meta["fxprep_kind"] = kind_of_value(node.meta["example_value"])
        else:
            node.meta["fxprep_kind"] = _static_kind(node, gm)
    return gm


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.kinds: dict[fx.Node, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.kinds[n] = kind_of_value(result)
        return result


def _run_and_record(gm: fx.GraphModule, example: ExampleInputs) -> dict[fx.Node, str]:
    fresh = example.fresh_copy()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = list(fresh.args)
    for ph in placeholders[len(args):]:
        if ph.name in fresh.kwargs or ph.target in fresh.kwargs:
            args.append(fresh.kwargs.get(ph.target, fresh.kwargs.get(ph.name)))
        elif ph.args:
            args.append(ph.args[0])
        else:
            return {}
    recorder = _Recorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*args)
    except Exception:  # noqa: BLE001 - fall back to static inference; verification reports real errors
        return {}
    return recorder.kinds
