"""AIMET's own module classes for the ops AIMET has classes for (``style="aimet"``).

When ``aimet_torch`` is importable, an :mod:`fxprep.ops` module whose call AIMET's class computes
exactly becomes that class, called with the same arguments; where AIMET's class would compute
something else, fxprep's stays (registered with QuantSim by :mod:`fxprep.compat.aimet_quantsim`). A
``F.conv2d`` on a non-Parameter weight becomes an ``nn.Conv2d`` reading that very tensor as a
buffer.

See docs/handoff/aimet.md ("Under the hood") for the cases kept apart.
"""

from __future__ import annotations

import importlib.util
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..reporting.report import Report
from .functional_to_module import bind


@dataclass(frozen=True)
class Rule:
    """fxprep op class + the callables it may hold → AIMET class name; ``binary``: called as
    ``(x, y)`` exactly, the first a tensor when ``tensor_first``."""

    fxprep: type[ops.BoundOp]
    aimet: str
    fns: tuple[Any, ...]
    binary: bool = False
    tensor_first: bool = False


def _m(*names: str) -> tuple[str, ...]:
    return tuple(f"Tensor.{n}" for n in names)


RULES: tuple[Rule, ...] = (
    Rule(ops.Add, "Add", (operator.add, operator.iadd, torch.add, *_m("add", "__add__", "__radd__", "__iadd__")), binary=True),
    Rule(ops.Mul, "Multiply", (operator.mul, operator.imul, torch.mul, torch.multiply, *_m("mul", "multiply", "__mul__", "__rmul__", "__imul__")),
         binary=True),
    Rule(ops.Sub, "Subtract", (operator.sub, operator.isub, torch.sub, torch.subtract, *_m("sub", "subtract", "__sub__", "__isub__")),
         binary=True, tensor_first=True),
    Rule(ops.Div, "Divide", (operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide,
                             *_m("div", "divide", "true_divide", "__truediv__", "__itruediv__")), tensor_first=True),
    Rule(ops.FloorDiv, "FloorDivide", (operator.floordiv, torch.floor_divide, *_m("floor_divide", "__floordiv__")),
         binary=True, tensor_first=True),
    Rule(ops.Pow, "Pow", (operator.pow, torch.pow, *_m("pow", "__pow__")), binary=True, tensor_first=True),
    Rule(ops.MatMul, "MatMul", (operator.matmul, torch.matmul, torch.mm, *_m("matmul", "mm", "__matmul__")),
         binary=True, tensor_first=True),
    Rule(ops.Bmm, "Bmm", (torch.bmm, *_m("bmm")), tensor_first=True),
    Rule(ops.Baddbmm, "Baddbmm", (torch.baddbmm, *_m("baddbmm")), tensor_first=True),
    Rule(ops.Addmm, "Addmm", (torch.addmm, *_m("addmm")), tensor_first=True),
    Rule(ops.Maximum, "Maximum", (torch.maximum, torch.max, *_m("maximum", "max")), binary=True, tensor_first=True),
    Rule(ops.Minimum, "Minimum", (torch.minimum, torch.min, *_m("minimum", "min")), binary=True, tensor_first=True),
    Rule(ops.Remainder, "Remainder", (torch.remainder, *_m("remainder")), tensor_first=True),
    Rule(ops.Mean, "Mean", (torch.mean, *_m("mean")), tensor_first=True),
    Rule(ops.Sum, "Sum", (torch.sum, *_m("sum")), tensor_first=True),
    Rule(ops.CumSum, "CumSum", (torch.cumsum, *_m("cumsum")), tensor_first=True),
    Rule(ops.Norm, "Norm", (torch.norm, *_m("norm")), tensor_first=True),
    Rule(ops.Amax, "AMax", (torch.amax, *_m("amax")), tensor_first=True),
    Rule(ops.Amin, "AMin", (torch.amin, *_m("amin")), tensor_first=True),
    Rule(ops.Exp, "Exponential", (torch.exp, *_m("exp")), tensor_first=True),
    Rule(ops.Log, "Log", (torch.log, *_m("log")), tensor_first=True),
    Rule(ops.Sqrt, "Sqrt", (torch.sqrt, *_m("sqrt")), tensor_first=True),
    Rule(ops.Rsqrt, "RSqrt", (torch.rsqrt, *_m("rsqrt")), tensor_first=True),
    Rule(ops.Square, "Square", (torch.square, *_m("square")), tensor_first=True),
    Rule(ops.Abs, "Abs", (torch.abs, operator.abs, *_m("abs")), tensor_first=True),
    Rule(ops.Neg, "Neg", (torch.neg, operator.neg, *_m("neg", "__neg__")), tensor_first=True),
    Rule(ops.Where, "Where", (torch.where,)),
    Rule(ops.Interpolate, "Interpolate", (F.interpolate,), tensor_first=True),
    Rule(ops.Interpolate, "GridSample", (F.grid_sample,), tensor_first=True),
    Rule(ops.Pad, "Pad", (F.pad,), tensor_first=True),
    Rule(ops.Pool, "MaxPool2d", (F.max_pool2d,), tensor_first=True),
    Rule(ops.Pool, "AvgPool2d", (F.avg_pool2d,), tensor_first=True),
    Rule(ops.Pool, "AdaptiveAvgPool2d", (F.adaptive_avg_pool2d,), tensor_first=True),
    Rule(ops.FunctionalNorm, "BatchNorm", (F.batch_norm,), tensor_first=True),
    Rule(ops.FunctionalNorm, "GroupNorm", (F.group_norm,), tensor_first=True),
)
_IN_PLACE = frozenset({operator.iadd, operator.imul, operator.isub, operator.itruediv,
                       "Tensor.__iadd__", "Tensor.__imul__", "Tensor.__isub__", "Tensor.__itruediv__"})


def _key(fn: Any) -> Any:
    return f"Tensor.{fn.name}" if isinstance(fn, ops._MethodCall) else fn


def _call(module: ops.BoundOp, node: fx.Node) -> tuple[Any, Any]:
    """The arguments ``node``'s op makes its call with: the template filled with the node's inputs."""
    return ops.fill_template(module.args, tuple(node.args)), ops.fill_template(module.kwargs, tuple(node.args))


def _rule_for(module: ops.BoundOp) -> Rule | None:
    key = _key(module.fn)
    for rule in RULES:
        if type(module) is rule.fxprep:
            try:
                if key in rule.fns:
                    return rule
            except TypeError:  # an unhashable callable compares by == in tuples: no match
                return None
    return None


# Layers whose output is always a new tensor (never their input, nor a view of it).
_FRESH_LAYERS = (nn.modules.conv._ConvNd, nn.Linear, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
                 nn.Embedding)
_FRESH_OPS = (ops.Add, ops.Sub, ops.Mul, ops.Div, ops.MatMul, ops.Bmm, ops.Concat)


def _unseen_mutation(gm: fx.GraphModule, node: fx.Node) -> bool:
    """For an in-place call: out of place computes the same, because the mutated input is a new
    tensor (a layer's or an out-of-place op's output) that nothing else reads, not even a view."""
    target = node.args[0] if node.args else None
    if not isinstance(target, fx.Node) or set(target.users) != {node} or target.op != "call_module":
        return False
    producer = gm.get_submodule(str(target.target))
    if isinstance(producer, ops.BoundOp):
        return isinstance(producer, _FRESH_OPS) and not getattr(producer, "_is_impure", False)
    return isinstance(producer, _FRESH_LAYERS)


def _aimet_call(gm: fx.GraphModule, module: ops.BoundOp, node: fx.Node,
                custom: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    """AIMET's module and the arguments to call it with, or None when it would compute otherwise."""
    if isinstance(module, ops.Concat):
        return _concat(module, node, custom)
    if isinstance(module, ops.FunctionalConv) and module.fn is F.conv2d:
        return _dynamic_conv(module, node, custom)
    rule = _rule_for(module)
    if rule is None or getattr(custom, rule.aimet, None) is None:
        return None
    args, kwargs = _call(module, node)
    if rule.binary and (len(args) != 2 or kwargs):
        return None
    if rule.tensor_first and not (args and isinstance(args[0], fx.Node)):
        return None
    if rule.aimet == "Where" and len(args) != 3:
        return None
    if _key(module.fn) in _IN_PLACE and not _unseen_mutation(gm, node):
        return None
    if rule.fxprep in (ops.Maximum, ops.Minimum) and not (len(args) == 2 and all(isinstance(a, fx.Node) for a in args)):
        return None  # torch.max(x, dim) is a reduction, not AIMET's element-wise Maximum
    return getattr(custom, rule.aimet)(), tuple(args), dict(kwargs)


def _concat(module: ops.BoundOp, node: fx.Node, custom: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    if module.fn not in (torch.cat, torch.concat, torch.concatenate):
        return None
    args, kwargs = _call(module, node)
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if not isinstance(tensors, (tuple, list)) or not all(isinstance(t, fx.Node) for t in tensors) or not isinstance(dim, int):
        return None
    if set(kwargs) - {"tensors", "dim", "axis"}:
        return None
    return custom.Concat(dim), tuple(tensors), {}


def _dynamic_conv(module: ops.BoundOp, node: fx.Node, custom: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    bound = bind("input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1",
                  *_call(module, node))
    if bound is None or any(isinstance(bound[k], fx.Node) for k in ("stride", "padding", "dilation", "groups")):
        return None
    layer = custom.DynamicConv2d(bound["stride"], bound["padding"], bound["dilation"], bound["groups"])
    call = (bound["input"], bound["weight"]) + ((bound["bias"],) if bound["bias"] is not None else ())
    return layer, call, {}


def _tensor_attr(gm: fx.GraphModule, value: Any) -> torch.Tensor | None:
    if isinstance(value, fx.Node) and value.op == "get_attr":
        try:
            obj = operator.attrgetter(str(value.target))(gm)
        except AttributeError:
            return None
        return obj if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter) else None
    return None


def _conv_on_buffer(gm: fx.GraphModule, module: ops.BoundOp, node: fx.Node) -> tuple[nn.Module, tuple[Any, ...]] | None:
    """``F.conv2d(x, self.some_buffer)`` → an ``nn.Conv2d`` whose weight (and bias) are that buffer."""
    if not isinstance(module, ops.FunctionalConv) or module.fn is not F.conv2d:
        return None
    bound = bind("input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1",
                  *_call(module, node))
    if bound is None or any(isinstance(bound[k], fx.Node) for k in ("stride", "padding", "dilation", "groups")):
        return None
    weight = _tensor_attr(gm, bound["weight"])
    bias = _tensor_attr(gm, bound["bias"]) if bound["bias"] is not None else None
    if weight is None or weight.dim() != 4 or (bound["bias"] is not None and bias is None):
        return None
    groups = bound["groups"]
    layer = nn.Conv2d(weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]), stride=bound["stride"],
                      padding=bound["padding"], dilation=bound["dilation"], groups=groups, bias=False, device="meta")
    del layer.weight
    layer.register_buffer("weight", weight)  # the model's own tensor, read where it lives: nothing copied
    if bias is not None:
        del layer.bias
        layer.register_buffer("bias", bias)
    return layer, (bound["input"],)


def aimet_available() -> bool:
    """Whether ``aimet_torch`` is installed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("aimet_torch") is not None


def run(gm: fx.GraphModule, *, report: Report | None = None,
        custom_modules: Callable[[], Any] | None = None) -> fx.GraphModule:
    """Swap fxprep op modules for AIMET's classes where they compute exactly the same thing.

    ``custom_modules`` returns AIMET's ``aimet_torch.nn.modules.custom`` (default: imported when
    ``aimet_torch`` is installed; without it only the buffer-conv rule applies)."""
    custom: Any = None
    if custom_modules is not None:
        custom = custom_modules()
    elif aimet_available():
        import aimet_torch.nn.modules.custom as aimet_custom  # noqa: PLC0415 - optional, and slow to import

        custom = aimet_custom
    names = {a.name: a for a in report.added} if report is not None else {}
    swapped = 0
    kwargs: dict[str, Any]
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, ops.BoundOp):
            continue
        conv = _conv_on_buffer(gm, module, node)
        if conv is not None:
            new, args, kwargs = conv[0], conv[1], {}
        elif custom is not None:
            found = _aimet_call(gm, module, node, custom)
            if found is None:
                continue
            new, args, kwargs = found
        else:
            continue
        parent, _, leaf = str(node.target).rpartition(".")
        setattr(gm.get_submodule(parent), leaf, new)
        before = node.all_input_nodes
        node.args, node.kwargs = args, kwargs
        for unused in [n for n in before if n.op == "get_attr" and not n.users]:
            gm.graph.erase_node(unused)
        swapped += 1
        if str(node.target) in names:
            names[str(node.target)].cls = type(new).__name__
    if report is not None and swapped:
        report.note(f"{swapped} op module(s) are AIMET's own classes (aimet_torch custom modules / nn.Conv2d), as "
                    f"AIMET's prepare_model makes them.")
    return gm
