"""Functional → module: every tensor-computing functional call becomes a ``call_module``.

Matching is by target identity, never by node name, and arguments are bound exactly
(:class:`fxprep.ops.BoundOp`). In order: a functional on a module's own weights becomes the real
``torch.nn`` layer sharing them, an activation or dropout becomes its ``torch.nn`` twin, and
anything else tensor-valued becomes a named op module. Views, Python arithmetic, input checks and
non-torch functions stay functional, the last listed in the report.

See docs/concepts/names.md ("Under the hood").
"""

from __future__ import annotations

import functools
import inspect
import keyword
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
from .input_checks import check_only
from .naming import add_module, code_scope, fresh_name, scope_of
from .op_table import (
    ACTIVATION_FUNCTIONS,
    ACTIVATION_METHODS,
    DROPOUT_SPECS,
    DROPOUTS,
    NAMED_FUNCTIONS,
    NAMED_METHODS,
    is_allowed_functional,
    remaining_compute_ops,
)
from .values import OTHER

__all__ = ["Replacement", "is_allowed_functional", "mutates_input", "remaining_compute_ops", "replacement_for", "run"]


# --- binding ------------------------------------------------------------------------------------
@functools.cache
def _signature(spec: str) -> inspect.Signature:
    namespace: dict[str, Any] = {}
    exec(f"def f({spec}): pass", {}, namespace)  # noqa: S102 - fixed strings from this module only
    return inspect.signature(namespace["f"])


def bind(spec: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``{parameter: value}`` of a call bound to the signature ``spec`` (defaults applied), or None."""
    try:
        bound = _signature(spec).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)



# --- replacement ----------------------------------------------------------------------------------
@dataclass
class Replacement:
    """What one node becomes: a module, the inputs it is called with, and why."""

    module: nn.Module
    inputs: list[Any]
    name: str
    reason: str


def _template(args: Any, inputs: list[Any]) -> Any:
    """Copy ``args`` replacing each Node by a Slot (appending the node to ``inputs``)."""
    if isinstance(args, fx.Node):
        inputs.append(args)
        return ops.Slot(len(inputs) - 1)
    if isinstance(args, tuple):  # fx's immutable containers become plain ones
        return tuple(_template(a, inputs) for a in args)
    if isinstance(args, list):
        return [_template(a, inputs) for a in args]
    if isinstance(args, dict):
        return {k: _template(v, inputs) for k, v in args.items()}
    if isinstance(args, slice):
        return slice(_template(args.start, inputs), _template(args.stop, inputs), _template(args.step, inputs))
    return args


def _bound_op(cls: type[ops.BoundOp], fn: Callable[..., Any], node: fx.Node, name: str, reason: str) -> Replacement:
    inputs: list[Any] = []
    args = _template(tuple(node.args), inputs)
    kwargs = _template(dict(node.kwargs), inputs)
    return Replacement(cls(fn, args, kwargs), inputs, name, reason)


def _parameter(gm: fx.GraphModule, value: Any) -> nn.Parameter | None:
    """The module Parameter a get_attr node reads, or None for anything else."""
    if isinstance(value, fx.Node) and value.op == "get_attr":
        try:
            obj = operator.attrgetter(value.target)(gm)
        except AttributeError:
            return None
        return obj if isinstance(obj, nn.Parameter) else None
    return None


def _params_or_none(gm: fx.GraphModule, *values: Any) -> list[nn.Parameter | None] | None:
    """Each value as a Parameter (None stays None); None overall if any value is something else."""
    out: list[nn.Parameter | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        p = _parameter(gm, v)
        if p is None:
            return None
        out.append(p)
    return out


def _only_input_is_first(bound: dict[str, Any], first: str = "input") -> bool:
    return isinstance(bound.get(first), fx.Node) and not any(
        isinstance(v, fx.Node) for k, v in bound.items() if k != first
    ) and not any(_contains_node(v) for k, v in bound.items() if k != first)


def _contains_node(value: Any) -> bool:
    found = []
    fx.node.map_arg(value, lambda n: found.append(n))
    return bool(found)


_OWNED_LAYER_METHODS: dict[str, Any] = {"prelu": F.prelu}


def _owned_layer(gm: fx.GraphModule, node: fx.Node) -> Replacement | None:
    """``F.linear``/``conv``/``norm``/``embedding``/``prelu`` on module Parameters → the real layer."""
    t, args, kwargs = node.target, tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        # ``x.prelu(self.weight)``: the Tensor method binds like the function, ``self`` being the input
        t = _OWNED_LAYER_METHODS.get(str(t))
        if t is None:
            return None

    if t is F.linear:
        b = bind("input, weight, bias=None", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"], b["bias"])
        if not b or not ps or not isinstance(b["input"], fx.Node):
            return None
        w, bias = ps
        if w is None:
            return None
        layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta", dtype=w.dtype)
        return _sharing(layer, {"weight": w, "bias": bias}, "linear", b["input"])
    if t in _CONVS or t in _TRANSPOSED_CONVS:
        return _owned_conv(gm, t, args, kwargs)
    if t is F.layer_norm or t is F.group_norm:
        return _owned_norm(gm, t, args, kwargs)
    if t is F.embedding:
        b = bind("input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"])
        if not b or not ps or not isinstance(b["input"], fx.Node) or _contains_node(
            [b["padding_idx"], b["max_norm"], b["norm_type"]]
        ):
            return None
        (w,) = ps
        if w is None:
            return None
        layer = nn.Embedding(w.shape[0], w.shape[1], padding_idx=b["padding_idx"], max_norm=b["max_norm"],
                             norm_type=b["norm_type"], scale_grad_by_freq=b["scale_grad_by_freq"], sparse=b["sparse"],
                             device="meta")
        return _sharing(layer, {"weight": w}, "embedding", b["input"])
    if t in (F.prelu, torch.prelu):
        b = bind("input, weight", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"])
        if not b or not ps or not isinstance(b["input"], fx.Node):
            return None
        (w,) = ps
        if w is None:
            return None
        layer = nn.PReLU(w.numel(), device="meta")
        return _sharing(layer, {"weight": w}, "prelu", b["input"])
    return None


def _sharing(layer: nn.Module, weights: dict[str, nn.Parameter | None], name: str, x: Any) -> Replacement:
    """``layer`` (built on ``meta``) holding the user's own Parameter objects: nothing is copied."""
    for attr, p in weights.items():
        setattr(layer, attr, p)
    return Replacement(layer, [x], name, f"F.{name} on module parameters → nn.{type(layer).__name__} sharing them")


_CONVS = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_TRANSPOSED_CONVS = {F.conv_transpose1d: nn.ConvTranspose1d, F.conv_transpose2d: nn.ConvTranspose2d,
                     F.conv_transpose3d: nn.ConvTranspose3d}


def _owned_conv(gm: fx.GraphModule, t: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Replacement | None:
    """``F.conv*`` / ``F.conv_transpose*`` on module Parameters with literal hyper-parameters."""
    if t in _CONVS:
        b = bind("input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"], b["bias"])
        if not b or not ps or not isinstance(b["input"], fx.Node) or _contains_node(
            [b["stride"], b["padding"], b["dilation"], b["groups"]]
        ):
            return None
        w, bias = ps
        if w is None:
            return None
        groups = b["groups"]
        layer = _CONVS[t](
            w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), stride=b["stride"], padding=b["padding"],
            dilation=b["dilation"], groups=groups, bias=bias is not None, device="meta", dtype=w.dtype,
        )
        return _sharing(layer, {"weight": w, "bias": bias}, t.__name__, b["input"])
    b = bind("input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1", args, kwargs)
    ps = b and _params_or_none(gm, b["weight"], b["bias"])
    if not b or not ps or not isinstance(b["input"], fx.Node) or _contains_node(
        [b["stride"], b["padding"], b["output_padding"], b["dilation"], b["groups"]]
    ):
        return None
    w, bias = ps
    if w is None:
        return None
    groups = b["groups"]
    layer = _TRANSPOSED_CONVS[t](
        w.shape[0], w.shape[1] * groups, tuple(w.shape[2:]), stride=b["stride"], padding=b["padding"],
        output_padding=b["output_padding"], groups=groups, bias=bias is not None, dilation=b["dilation"],
        device="meta", dtype=w.dtype,
    )
    return _sharing(layer, {"weight": w, "bias": bias}, t.__name__, b["input"])


def _owned_norm(gm: fx.GraphModule, t: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Replacement | None:
    """``F.layer_norm`` / ``F.group_norm`` on module Parameters with literal shapes and eps."""
    if t is F.layer_norm:
        b = bind("input, normalized_shape, weight=None, bias=None, eps=1e-05", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"], b["bias"])
        if not b or not ps or not isinstance(b["input"], fx.Node) or _contains_node([b["normalized_shape"], b["eps"]]):
            return None
        w, bias = ps
        if w is None and bias is not None:
            return None
        layer = nn.LayerNorm(b["normalized_shape"], eps=b["eps"], elementwise_affine=w is not None,
                             bias=bias is not None, device="meta")
        return _sharing(layer, {"weight": w, "bias": bias} if w is not None else {}, "layer_norm", b["input"])
    if t is F.group_norm:
        b = bind("input, num_groups, weight=None, bias=None, eps=1e-05", args, kwargs)
        ps = b and _params_or_none(gm, b["weight"], b["bias"])
        if not b or not ps or ps[1] is None or not isinstance(b["input"], fx.Node) or _contains_node([b["num_groups"], b["eps"]]):
            return None
        w, bias = ps
        if w is None:
            return None
        layer = nn.GroupNorm(b["num_groups"], w.shape[0], eps=b["eps"], affine=True, device="meta")
        return _sharing(layer, {"weight": w, "bias": bias}, "group_norm", b["input"])
    return None


def _activation(node: fx.Node) -> Replacement | None:
    if node.op == "call_function":
        try:
            entry = ACTIVATION_FUNCTIONS.get(node.target)
        except TypeError:
            return None
        if entry is None:
            return None
        act, is_f, inplace = entry
        spec = act.spec_f if (is_f and act.spec_f) else act.spec
        args = tuple(node.args)
    else:
        m_entry = ACTIVATION_METHODS.get(node.target)  # type: ignore[arg-type]
        if m_entry is None:
            return None
        act, inplace = m_entry
        spec = act.spec
        args = tuple(node.args)
    b = bind(spec, args, dict(node.kwargs))
    if b is None or not _only_input_is_first(b):
        return None
    ctor = act.ctor(b)
    if ctor is None:
        return None
    if inplace:
        if "inplace" not in inspect.signature(act.module).parameters:
            return None  # e.g. sigmoid_: no nn twin that mutates; the BoundOp path keeps it exact
        ctor["inplace"] = True
    return Replacement(act.module(**ctor), [b["input"]], act.name, f"{_describe_target(node)} → nn.{act.module.__name__}")


def _dropout(node: fx.Node, training: bool) -> Replacement | None:
    if node.op != "call_function":
        return None
    try:
        cls = DROPOUTS.get(node.target)
    except TypeError:
        return None
    if cls is not None:
        b = bind(DROPOUT_SPECS[node.target], tuple(node.args), dict(node.kwargs))
        if b is None or not _only_input_is_first(b) or bool(b["training"]) != training:
            return None  # training fixed in the source: a Dropout BoundOp keeps it fixed (reported)
        return Replacement(cls(p=b["p"], inplace=bool(b["inplace"])), [b["input"]], node.target.__name__,
                           f"{_describe_target(node)} → nn.{cls.__name__} (follows .train()/.eval())")
    if node.target in (F.rrelu, F.rrelu_):
        # random in training (like dropout): nn.RReLU follows the mode when the call did
        b = bind("input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False", tuple(node.args),
                  dict(node.kwargs))
        if b is None or not _only_input_is_first(b) or bool(b["training"]) != training:
            return None
        inplace = bool(b["inplace"]) or node.target is F.rrelu_
        return Replacement(nn.RReLU(b["lower"], b["upper"], inplace=inplace), [b["input"]], "rrelu",
                           f"{_describe_target(node)} → nn.RReLU (follows .train()/.eval())")
    sd = _stochastic_depth_target()
    if sd is not None and node.target is sd:
        b = bind("input, p, mode, training=True", tuple(node.args), dict(node.kwargs))
        if b is None or not _only_input_is_first(b) or bool(b["training"]) != training:
            return None
        from torchvision.ops import StochasticDepth

        return Replacement(StochasticDepth(b["p"], b["mode"]), [b["input"]], "stochastic_depth",
                           "torchvision stochastic_depth → StochasticDepth (follows .train()/.eval())")
    return None


def _stochastic_depth_target() -> Any:
    import sys

    mod = sys.modules.get("torchvision.ops.stochastic_depth")
    return getattr(mod, "stochastic_depth", None) if mod else None


def _describe_target(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return ops.qualified_name(node.target)


def _short_name(node: fx.Node, key: str | None) -> str:
    """Base of the new module's attribute name. ``operator.and_`` / ``or_`` / ``not_`` would strip
    to a Python keyword, and ``self.and(x)`` is a syntax error in the generated forward."""
    if key:
        name = key
    elif node.op == "call_method":
        name = str(node.target).strip("_")
    else:
        name = getattr(node.target, "__name__", "op").strip("_")
    return f"{name}_op" if keyword.iskeyword(name) else name


def _named(node: fx.Node) -> Replacement | None:
    if node.op == "call_method":
        entry = NAMED_METHODS.get(node.target)  # type: ignore[arg-type]
        fn: Callable[..., Any] = ops.method_call(str(node.target))
    else:
        try:
            entry = NAMED_FUNCTIONS.get(node.target)
        except TypeError:
            entry = None
        fn = node.target  # type: ignore[assignment]
    if entry is None:
        return None
    key, cls = entry
    if cls in (ops.Amax, ops.Amin) and _is_binary_max_min(node):
        # torch.max(a, b) / a.min(b) is the element-wise maximum / minimum, not a reduction
        key, cls = ("maximum", ops.Maximum) if cls is ops.Amax else ("minimum", ops.Minimum)
    if cls is ops.FunctionalLinear or cls is ops.FunctionalConv:
        reason = f"{_describe_target(node)} with weights passed as inputs → {cls.__name__}"
    else:
        reason = f"{_describe_target(node)} → {cls.__name__}"
    return _bound_op(cls, fn, node, _short_name(node, key), reason)


def _is_binary_max_min(node: fx.Node) -> bool:
    """``max``/``min`` called with a second *tensor* (``other``) rather than a ``dim``."""
    if str(getattr(node.target, "__name__", node.target)) not in ("max", "min"):
        return False
    other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    return isinstance(other, fx.Node) and other.meta.get("fxprep_kind") != OTHER


_TORCH_PACKAGES = ("torch", "torchvision", "torchaudio")


def _is_torch_callable(target: Any) -> bool:
    """Defined in torch (or torchvision/torchaudio): a package merely *named* like it
    (``torch_utils``, a user's ``torchmodels``) is user code, and its functions stay calls."""
    module = getattr(target, "__module__", "") or ""
    return module.partition(".")[0] in _TORCH_PACKAGES


def _special(node: fx.Node, training: bool) -> Replacement | None:
    """Activations with dtype, fixed-mode dropout, autograd Functions, other torch ops."""
    target = node.target
    if node.op == "call_function":
        autograd_fn = getattr(target, "autograd_function", None)
        if autograd_fn is not None:
            return _bound_op(ops.AutogradFunction, target, node, autograd_fn.__name__,  # type: ignore[arg-type]
                             f"autograd.Function {autograd_fn.__name__} → AutogradFunction (its backward still runs)")
        if target is getattr(torch.ops.higher_order, "autograd_function_apply", None):
            # Dynamo's form of a custom autograd.Function: (fwd_body, bwd_body, *inputs), one call
            return _bound_op(ops.AutogradFunction, target, node, "autograd_function",  # type: ignore[arg-type]
                             "autograd_function_apply (Dynamo's autograd.Function) → AutogradFunction "
                             "(its backward still runs)")
        try:
            act = ACTIVATION_FUNCTIONS.get(target)
        except TypeError:
            act = None
        if act is not None:
            cls = ops.Softmax if act[0].name in ("softmax", "log_softmax", "softmin") else ops.Activation
            reason = f"{_describe_target(node)} with arguments nn.{act[0].module.__name__} cannot hold → {cls.__name__}"
            return _bound_op(cls, target, node, act[0].name, reason)  # type: ignore[arg-type]
        if target in DROPOUTS:
            return _bound_op(ops.Dropout, target, node, target.__name__,  # type: ignore[union-attr]
                             f"{_describe_target(node)} with training fixed in the source (not self.training) → Dropout, mode fixed")
        if target in (F.rrelu, F.rrelu_):
            return _bound_op(ops.Activation, target, node, "rrelu",  # type: ignore[arg-type]
                             f"{_describe_target(node)} with training fixed in the source → Activation, mode fixed")
        if _is_torch_callable(target) or target in ops._OPERATOR_NAMES:
            return _bound_op(ops.Functional, target, node, _short_name(node, None), f"{_describe_target(node)} → Functional")  # type: ignore[arg-type]
        return None
    m_act = ACTIVATION_METHODS.get(target)  # type: ignore[arg-type]
    if m_act is not None:
        cls = ops.Softmax if m_act[0].name in ("softmax", "log_softmax", "softmin") else ops.Activation
        return _bound_op(cls, ops.method_call(str(target)), node, m_act[0].name, f"Tensor.{target} → {cls.__name__}")
    if hasattr(torch.Tensor, str(target)):
        return _bound_op(ops.Functional, ops.method_call(str(target)), node, _short_name(node, None), f"Tensor.{target} → Functional")
    return None


def replacement_for(gm: fx.GraphModule, node: fx.Node, training: bool) -> Replacement | None:
    """The module ``node`` becomes, or None when it stays functional."""
    if node.op not in ("call_function", "call_method") or is_allowed_functional(node):
        return None
    if node.meta.get("fxprep_kind") == OTHER:
        return None  # Python-value arithmetic (shapes, flags): never a module
    return (
        _owned_layer(gm, node)
        or _activation(node)
        or _dropout(node, training)
        or _named(node)
        or _special(node, training)
    )


_INPLACE_OPERATORS = frozenset(
    getattr(operator, n) for n in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
                                   "iand", "ior", "ixor", "ilshift", "irshift")
)


def mutates_input(node: fx.Node) -> bool:
    """True for in-place calls: ``x.add_(y)``, ``torch.relu_(x)``, ``operator.iadd``, ``inplace=True``."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = str(node.target)
        if name.startswith("__i") and name.endswith("__"):  # x.__iadd__(y)
            return getattr(operator, name[2:-2], None) in _INPLACE_OPERATORS
    elif node.op == "call_function":
        try:
            if node.target in ops._OPERATOR_NAMES:  # operator.and_ / or_ / not_ are not in place
                return node.target in _INPLACE_OPERATORS
        except TypeError:
            return False
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def _left_reason(node: fx.Node) -> str:
    target = node.target
    if getattr(target, "__fxprep_opaque__", False):
        return "function marked fxprep.opaque: kept as one call"
    if node.meta.get("is_wrapped"):
        return "function registered with torch.fx.wrap: kept as one call"
    return "not a torch op fxprep knows how to turn into a module: kept as a call"


UNREPORTED = "fxprep_unreported"  # node meta: (class name, reason) of a conversion not yet in a report


def run(gm: fx.GraphModule, *, training: bool = False, original: nn.Module | None = None,
        report: Report | None = None, recompile: bool = True) -> fx.GraphModule:
    """Replace every tensor-computing functional node of ``gm`` by a ``call_module``.

    ``training`` is the mode the graph was captured in (decides which dropouts follow the module
    mode). ``original`` is the user's model, consulted so new names never collide with its
    attributes. Nodes must carry ``meta['fxprep_kind']`` (see :mod:`fxprep.passes.values`).
    Without a ``report``, each module added is marked on its node and reported by the run over
    the graph the node is later copied into (a repeated block converted once, then stamped out).
    """
    taken: set[str] = set()
    functions: set[str] = set()  # the function containers this run made (naming.code_scope)
    used_attrs: set[fx.Node] = set()
    checks = check_only(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and UNREPORTED in node.meta:  # converted in a block before it was stamped out
            cls_name, reason = node.meta.pop(UNREPORTED)
            if report is not None:
                report.module_added(str(node.target), cls_name, reason)
            continue
        if node in checks:
            if report is not None and node.meta.get("fxprep_kind") != OTHER and not is_allowed_functional(node):
                report.input_check(node.name, _describe_target(node), scope_of(node, original),
                                   "only checks the inputs (its results feed an assert alone): kept as a call")
            continue
        rep = replacement_for(gm, node, training)
        if rep is None:
            if node.op in ("call_function", "call_method") and not is_allowed_functional(node) \
                    and node.meta.get("fxprep_kind") != OTHER and report is not None:
                report.left_functional(node.name, _describe_target(node), scope_of(node, original), _left_reason(node))
            continue
        if mutates_input(node) or getattr(rep.module, "inplace", False) is True:
            # fx's dead-code elimination keeps a call_module only if the module says it is impure:
            # ``x.add_(y)`` whose result is unused must survive ``graph.eliminate_dead_code()``.
            rep.module._is_impure = True
        scope, base = code_scope(gm, original, node, rep.name, functions)
        qualname = fresh_name(gm, original, scope, base, taken)
        add_module(gm, qualname, rep.module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(qualname, tuple(rep.inputs), {})
        new.meta = dict(node.meta)
        new.meta["fxprep_origin"] = _describe_target(node)
        if report is None:  # reported when the graph it is stamped into is converted (block reuse)
            new.meta[UNREPORTED] = (type(rep.module).__name__, rep.reason)
        node.replace_all_uses_with(new)
        used_attrs.update(n for n in node.all_input_nodes if n.op == "get_attr")
        gm.graph.erase_node(node)
        if report is not None:
            report.module_added(qualname, type(rep.module).__name__, rep.reason)
    for attr_node in used_attrs:
        if not attr_node.users:
            gm.graph.erase_node(attr_node)  # the Parameter stays on the module; only the read goes
    gm.graph.lint()
    if recompile:  # the orchestrator recompiles once after all passes
        gm.recompile()
    return gm
