"""What each functional op becomes: the tables the functional → module pass reads.

* the allow-list of ops that may stay functional in a prepared graph (views, metadata, tensor
  constructors): :func:`is_allowed_functional`, and :func:`remaining_compute_ops` to find the rest;
* activations with a ``torch.nn`` twin (:data:`ACTIVATIONS`) and dropouts (:data:`DROPOUTS`);
* the named :class:`~fxprep.ops.BoundOp` classes (``Add``, ``MatMul``, ...) by function and by
  Tensor method name (:data:`NAMED_FUNCTIONS`, :data:`NAMED_METHODS`).

To convert a new functional op, add it here (a ``torch.nn`` twin to :data:`ACTIVATIONS`, anything
else to the named table, with an ``fxprep.ops`` class if tools should recognise it by class);
the matching code in :mod:`.functional_to_module` does not change.
"""

from __future__ import annotations

import builtins
import collections
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..runtime.wrap import TENSOR_CONSTRUCTORS
from .input_checks import check_only
from .values import OTHER

VIEW_AND_METADATA_METHODS = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "flatten", "unflatten",
        "squeeze", "unsqueeze", "expand", "expand_as", "contiguous", "split", "split_with_sizes", "chunk",
        "unbind", "narrow", "select", "movedim", "moveaxis", "swapaxes", "swapdims", "size", "dim", "numel",
        "to", "type", "type_as", "float", "half", "double", "int", "long", "bool", "bfloat16", "short",
        "char", "byte", "cpu", "cuda", "detach", "detach_", "clone", "repeat", "tile", "flip", "roll",
        "index_select", "gather", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "zero_",
        "fill_", "item", "tolist", "requires_grad_", "get_device", "stride", "is_contiguous", "nelement",
        "ndimension", "element_size", "data_ptr", "storage_offset", "unfold", "diagonal", "tril", "triu",
        "__getitem__", "__setitem__", "__len__", "as_strided", "copy_", "masked_select", "nonzero",
        "repeat_interleave", "flatten_", "dim_order", "is_floating_point",
    }
)
VIEW_AND_METADATA_FUNCTIONS = frozenset(
    f
    for f in [
        operator.getitem, operator.setitem, builtins.getattr, builtins.len, torch._assert, collections.OrderedDict,
        torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.t, torch.squeeze,
        torch.unsqueeze, torch.split, torch.chunk, torch.unbind, torch.narrow, torch.select,
        torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.unflatten,
        torch.broadcast_to, torch.broadcast_tensors, torch.tensor_split, torch.index_select,
        torch.gather, torch.flip, torch.roll, torch.tile, torch.repeat_interleave, torch.clone,
        torch.detach, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
        torch.rand_like, torch.randn_like, torch.diagonal, torch.tril, torch.triu, torch.meshgrid,
        torch.nonzero, torch.masked_select, torch.numel, torch.is_tensor, torch.is_floating_point,
        torch.atleast_1d, torch.atleast_2d, torch.atleast_3d, torch.ravel, torch.column_stack,
        torch.fx._symbolic_trace._assert_is_none, F.unfold, F.fold, F.pixel_shuffle, F.pixel_unshuffle,
        F.channel_shuffle, torch.channel_shuffle, torch.pixel_shuffle, torch.pixel_unshuffle,
        *[getattr(torch, n) for n in TENSOR_CONSTRUCTORS if hasattr(torch, n)],
    ]
)


def is_allowed_functional(node: fx.Node) -> bool:
    """True when ``node`` may stay a function call in a prepared graph (view, metadata, constructor)."""
    if node.op == "call_method":
        return node.target in VIEW_AND_METADATA_METHODS
    if node.op == "call_function":
        try:
            return node.target in VIEW_AND_METADATA_FUNCTIONS
        except TypeError:  # unhashable target
            return False
    return True


def remaining_compute_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """Tensor-valued function/method calls outside the allow-list (what a prepared graph should lack),
    but the input checks (:func:`.input_checks.check_only`: kept as calls on purpose, listed apart)."""
    checks = check_only(gm.graph)
    return [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
        and n.meta.get("fxprep_kind") != OTHER
        and not is_allowed_functional(n)
        and n not in checks
    ]

@dataclass(frozen=True)
class Activation:
    """An activation with a ``torch.nn`` twin. ``spec_f`` is ``F.<name>``'s signature, ``spec`` the
    ``torch.<name>`` / ``Tensor.<name>`` one; ``ctor`` maps bound arguments to constructor kwargs
    (None when the call cannot be expressed by the module)."""

    name: str
    module: type[nn.Module]
    spec: str
    ctor: Callable[[dict[str, Any]], dict[str, Any] | None]
    spec_f: str | None = None


def _inplace(b: dict[str, Any]) -> dict[str, Any]:
    return {"inplace": bool(b["inplace"])}


def _none(b: dict[str, Any]) -> dict[str, Any]:
    return {}


def _softmax_ctor(b: dict[str, Any]) -> dict[str, Any] | None:
    return None if b.get("dtype") is not None else {"dim": b["dim"]}


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in [
        Activation("relu", nn.ReLU, "input, inplace=False", _inplace),
        Activation("relu6", nn.ReLU6, "input, inplace=False", _inplace),
        Activation("gelu", nn.GELU, "input, approximate='none'", lambda b: {"approximate": b["approximate"]}),
        Activation("silu", nn.SiLU, "input, inplace=False", _inplace),
        Activation("sigmoid", nn.Sigmoid, "input", _none),
        Activation("tanh", nn.Tanh, "input", _none),
        Activation("hardswish", nn.Hardswish, "input, inplace=False", _inplace),
        Activation("hardsigmoid", nn.Hardsigmoid, "input, inplace=False", _inplace),
        Activation("leaky_relu", nn.LeakyReLU, "input, negative_slope=0.01, inplace=False",
                   lambda b: {"negative_slope": b["negative_slope"], "inplace": bool(b["inplace"])}),
        Activation("elu", nn.ELU, "input, alpha=1.0, inplace=False", lambda b: {"alpha": b["alpha"], "inplace": bool(b["inplace"])}),
        Activation("selu", nn.SELU, "input, inplace=False", _inplace),
        Activation("celu", nn.CELU, "input, alpha=1.0, inplace=False", lambda b: {"alpha": b["alpha"], "inplace": bool(b["inplace"])}),
        Activation("mish", nn.Mish, "input, inplace=False", _inplace),
        Activation("softplus", nn.Softplus, "input, beta=1.0, threshold=20.0", lambda b: {"beta": b["beta"], "threshold": b["threshold"]}),
        Activation("hardtanh", nn.Hardtanh, "input, min_val=-1.0, max_val=1.0, inplace=False",
                   lambda b: {"min_val": b["min_val"], "max_val": b["max_val"], "inplace": bool(b["inplace"])}),
        Activation("logsigmoid", nn.LogSigmoid, "input", _none),
        Activation("softsign", nn.Softsign, "input", _none),
        Activation("tanhshrink", nn.Tanhshrink, "input", _none),
        Activation("glu", nn.GLU, "input, dim=-1", lambda b: {"dim": b["dim"]}),
        Activation("threshold", nn.Threshold, "input, threshold, value, inplace=False",
                   lambda b: {"threshold": b["threshold"], "value": b["value"], "inplace": bool(b["inplace"])}),
        Activation("hardshrink", nn.Hardshrink, "input, lambd=0.5", lambda b: {"lambd": b["lambd"]}),
        Activation("softshrink", nn.Softshrink, "input, lambd=0.5", lambda b: {"lambd": b["lambd"]}),
        Activation("softmax", nn.Softmax, "input, dim=None, dtype=None", _softmax_ctor,
                   spec_f="input, dim=None, _stacklevel=3, dtype=None"),
        Activation("log_softmax", nn.LogSoftmax, "input, dim=None, dtype=None", _softmax_ctor,
                   spec_f="input, dim=None, _stacklevel=3, dtype=None"),
        Activation("softmin", nn.Softmin, "input, dim=None, dtype=None", _softmax_ctor,
                   spec_f="input, dim=None, _stacklevel=3, dtype=None"),
    ]
}

# target → (activation, is the functional form, is in place)
ACTIVATION_FUNCTIONS: dict[Any, tuple[Activation, bool, bool]] = {}
ACTIVATION_METHODS: dict[str, tuple[Activation, bool]] = {}
for _a in ACTIVATIONS.values():
    for _ns, _is_f in ((F, True), (torch, False), (torch.special, False)):
        for _suffix, _inpl in (("", False), ("_", True)):
            _fn = getattr(_ns, _a.name + _suffix, None)
            if callable(_fn) and _fn not in ACTIVATION_FUNCTIONS:
                ACTIVATION_FUNCTIONS[_fn] = (_a, _is_f, _inpl)
    for _suffix, _inpl in (("", False), ("_", True)):
        if hasattr(torch.Tensor, _a.name + _suffix):
            ACTIVATION_METHODS[_a.name + _suffix] = (_a, _inpl)

DROPOUTS: dict[Any, type[nn.Module]] = {
    F.dropout: nn.Dropout, F.dropout1d: nn.Dropout1d, F.dropout2d: nn.Dropout2d, F.dropout3d: nn.Dropout3d,
    F.alpha_dropout: nn.AlphaDropout, F.feature_alpha_dropout: nn.FeatureAlphaDropout,
}
# F.alpha_dropout / F.feature_alpha_dropout default to training=False, the others to True: a call
# that leaves ``training`` out must be bound with *its own* default.
DROPOUT_SPECS: dict[Any, str] = {
    fn: f"input, p=0.5, training={fn not in (F.alpha_dropout, F.feature_alpha_dropout)}, inplace=False"
    for fn in DROPOUTS
}


# --- named BoundOp table ------------------------------------------------------------------------
def _fns(*names: str, ns: Any = torch) -> list[Any]:
    return [getattr(ns, n) for n in names if hasattr(ns, n)]


_TABLE: list[tuple[str | None, type[ops.BoundOp], list[Any], list[str]]] = [
    ("add", ops.Add, [torch.add, operator.add, operator.iadd], ["add", "add_", "__add__", "__radd__", "__iadd__"]),
    ("sub", ops.Sub, [torch.sub, torch.subtract, torch.rsub, operator.sub, operator.isub],
     ["sub", "sub_", "subtract", "__sub__", "__rsub__", "__isub__"]),
    ("mul", ops.Mul, [torch.mul, torch.multiply, operator.mul, operator.imul], ["mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__"]),
    ("div", ops.Div, [torch.div, torch.divide, torch.true_divide, operator.truediv, operator.itruediv],
     ["div", "div_", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__"]),
    ("floordiv", ops.FloorDiv, [torch.floor_divide, operator.floordiv, operator.ifloordiv], ["floor_divide", "__floordiv__", "__rfloordiv__"]),
    ("remainder", ops.Remainder, [torch.remainder, torch.fmod, operator.mod], ["remainder", "fmod", "__mod__"]),
    ("pow", ops.Pow, [torch.pow, torch.float_power, operator.pow, operator.ipow], ["pow", "pow_", "float_power", "__pow__", "__rpow__"]),
    ("neg", ops.Neg, [torch.neg, torch.negative, operator.neg], ["neg", "neg_", "negative", "__neg__"]),
    ("abs", ops.Abs, [torch.abs, torch.absolute, operator.abs], ["abs", "abs_", "absolute"]),
    ("exp", ops.Exp, _fns("exp", "exp2", "expm1") + _fns("exp2", "expm1", ns=torch.special), ["exp", "exp_", "exp2", "expm1"]),
    ("log", ops.Log, _fns("log", "log2", "log10", "log1p") + _fns("log1p", ns=torch.special),
     ["log", "log_", "log2", "log10", "log1p"]),
    ("sqrt", ops.Sqrt, [torch.sqrt], ["sqrt", "sqrt_"]),
    ("rsqrt", ops.Rsqrt, [torch.rsqrt], ["rsqrt", "rsqrt_"]),
    ("square", ops.Square, [torch.square], ["square", "square_"]),
    ("reciprocal", ops.Reciprocal, [torch.reciprocal], ["reciprocal", "reciprocal_"]),
    ("clamp", ops.Clamp, _fns("clamp", "clip", "clamp_min", "clamp_max"),
     ["clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max", "clamp_min_", "clamp_max_"]),
    ("maximum", ops.Maximum, _fns("maximum", "fmax"), ["maximum", "fmax"]),
    ("minimum", ops.Minimum, _fns("minimum", "fmin"), ["minimum", "fmin"]),
    (None, ops.Compare,
     [*_fns("eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isclose", "greater", "less"),
      operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge],
     ["eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isclose", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]),
    (None, ops.Logical,
     [*_fns("logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor"),
      operator.and_, operator.or_, operator.xor, operator.invert, operator.inv, operator.iand, operator.ior],
     ["logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "__and__", "__or__", "__xor__", "__invert__"]),
    (None, ops.Unary,
     _fns("sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc",
          "erfinv", "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "lerp", "addcmul", "addcdiv", "hypot", "logit",
          "signbit", "heaviside", "xlogy", "nan_to_num", "copysign", "deg2rad", "rad2deg")
     + _fns("erf", "erfc", "erfinv", "logit", "round", "xlogy", "sinc", "i0", ns=torch.special),
     ["sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "erf", "erfc", "erfinv", "floor", "ceil", "round",
      "trunc", "frac", "sign", "sgn", "lerp", "addcmul", "addcdiv", "logit", "nan_to_num", "sin_", "cos_", "floor_", "round_"]),
    ("matmul", ops.MatMul, [torch.matmul, torch.mm, torch.mv, operator.matmul, torch.dot, torch.inner, torch.outer],
     ["matmul", "mm", "mv", "dot", "__matmul__", "__rmatmul__"]),
    ("bmm", ops.Bmm, [torch.bmm], ["bmm"]),
    ("baddbmm", ops.Baddbmm, [torch.baddbmm], ["baddbmm", "baddbmm_"]),
    ("addmm", ops.Addmm, _fns("addmm", "addmv", "addbmm"), ["addmm", "addmm_", "addmv"]),
    ("einsum", ops.Einsum, [torch.einsum], []),
    ("cat", ops.Concat, _fns("cat", "concat", "concatenate"), []),
    ("stack", ops.Stack, _fns("stack", "hstack", "vstack", "dstack"), []),
    ("sum", ops.Sum, [torch.sum, torch.nansum], ["sum", "nansum"]),
    ("mean", ops.Mean, [torch.mean, torch.nanmean], ["mean", "nanmean"]),
    ("norm", ops.Norm, [torch.norm, torch.linalg.norm, torch.linalg.vector_norm, torch.linalg.matrix_norm, F.normalize], ["norm"]),
    ("cumsum", ops.CumSum, [torch.cumsum], ["cumsum", "cumsum_"]),
    ("amax", ops.Amax, [torch.amax, torch.max], ["amax", "max"]),
    ("amin", ops.Amin, [torch.amin, torch.min], ["amin", "min"]),
    (None, ops.Reduce,
     _fns("prod", "var", "std", "logsumexp", "argmax", "argmin", "any", "all", "var_mean", "std_mean", "topk", "sort",
          "argsort", "cumprod", "median", "mode", "count_nonzero", "aminmax"),
     ["prod", "var", "std", "logsumexp", "argmax", "argmin", "any", "all", "topk", "sort", "argsort", "cumprod", "median"]),
    ("where", ops.Where, [torch.where], ["where"]),
    ("masked_fill", ops.MaskedFill, [torch.masked_fill], ["masked_fill", "masked_fill_"]),
    (None, ops.FunctionalLinear, [F.linear, F.bilinear], []),
    (None, ops.FunctionalConv, [F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d], []),
    (None, ops.FunctionalNorm,
     [F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.local_response_norm, *_fns("rms_norm", ns=F),
      *_fns("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm")], []),
    (None, ops.FunctionalEmbedding, [F.embedding, F.embedding_bag], []),
    ("prelu", ops.PReLUOp, [F.prelu, torch.prelu], ["prelu"]),
    (None, ops.Interpolate, [F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear, F.grid_sample, F.affine_grid], []),
    # Dynamo inlines the Python F.pad / F.rms_norm wrappers and records the builtins they call
    ("pad", ops.Pad, [F.pad, *_fns("pad", ns=torch._C._nn)], []),
    # Every pooling function of F (max/avg/adaptive/lp/fractional/unpool, their ``_with_indices`` forms
    # that ``return_indices=True`` dispatches to, and the private halves of ``boolean_dispatch``).
    (None, ops.Pool,
     [*_fns(*sorted(n for n in dir(F) if "pool" in n and not n.startswith(("_check", "_unpool"))), ns=F),
      *_fns("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
            "max_pool1d_with_indices", "max_pool2d_with_indices")], []),
    ("scaled_dot_product_attention", ops.ScaledDotProductAttention, [F.scaled_dot_product_attention], []),
]

NAMED_FUNCTIONS: dict[Any, tuple[str | None, type[ops.BoundOp]]] = {}
NAMED_METHODS: dict[str, tuple[str | None, type[ops.BoundOp]]] = {}
for _key, _cls, _functions, _methods in _TABLE:
    for _f in _functions:
        NAMED_FUNCTIONS.setdefault(_f, (_key, _cls))
    for _m in _methods:
        NAMED_METHODS.setdefault(_m, (_key, _cls))
