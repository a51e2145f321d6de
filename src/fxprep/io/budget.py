"""What a loaded graph would allocate by itself: constructor calls with literal sizes, counted
statically.

Before the self-check runs, :func:`literal_allocations` reads every node (op modules' argument
templates and nested graphs included) and counts what each constructor with literal sizes would
allocate, folding plain integer arithmetic on literals first; :func:`declared_bytes` sums them,
counting only the largest view. Sizes that depend on the inputs are left to the probe budget and to
:mod:`.peak`.

See docs/security.md ("Under the hood") for the rules and a worked example.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import ops
from . import allowlist

_UNKNOWN_ITEMSIZE = 4  # a method on a tensor whose dtype is not written in the call: float32's
_HUGE = 2**256  # folded integers are clamped here: a literal can name no more than that


class _Unknown:
    """A value that depends on the inputs (or on anything not folded here)."""


UNKNOWN = _Unknown()


# --- reading sizes -----------------------------------------------------------------------------------
def _ints(value: Any) -> list[int] | None:
    """A literal size: an int or a sequence of ints (None where any part is not a literal)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(type(v) is int for v in items):  # bool, float, tensors, nodes, UNKNOWN: not a literal size
        return None
    return list(items)


def _numel(dims: list[int] | None, keep: bool = False) -> int | None:
    """Elements of a tensor of ``dims`` (``keep``: -1 keeps an input's size, at least 1 counted)."""
    if dims is None:
        return None
    return math.prod(1 if (keep and d == -1) else max(d, 0) for d in dims)


def _size(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, key: str = "size") -> list[int] | None:
    """The size of ``fn(*size)`` / ``fn(size)`` / ``fn(size=...)`` from position ``at`` on."""
    if key in kwargs:
        return _ints(kwargs[key])
    if len(args) > at and isinstance(args[at], (list, tuple)):
        return _ints(args[at])
    return _ints(tuple(args[at:]))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, key: str, default: Any = UNKNOWN) -> Any:
    return kwargs[key] if key in kwargs else args[at] if len(args) > at else default


def _itemsize(kwargs: dict[str, Any], default: int | None = None) -> int:
    dtype = kwargs.get("dtype")
    if isinstance(dtype, torch.dtype):
        return max(dtype.itemsize, 1)
    return default if default is not None else torch.get_default_dtype().itemsize


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) and math.isfinite(value) else None


# --- one rule per kind of constructor: (args, kwargs) -> bytes, or None where the size is not literal --------
def _sized(args: tuple, kwargs: dict) -> int | None:  # zeros(2, 3), zeros((2, 3)), rand(size=...)
    n = _numel(_size(args, kwargs, 0))
    return None if n is None else n * _itemsize(kwargs)


def _full(args: tuple, kwargs: dict) -> int | None:
    n = _numel(_ints(_arg(args, kwargs, 0, "size")))
    fill = _arg(args, kwargs, 1, "fill_value", 0.0)
    default = 1 if type(fill) is bool else 8 if type(fill) is int else None
    return None if n is None else n * _itemsize(kwargs, default)


def _randint(args: tuple, kwargs: dict) -> int | None:  # randint(high, size) / randint(low, high, size)
    sizes = [a for a in args if isinstance(a, (list, tuple))]
    n = _numel(_ints(kwargs["size"] if "size" in kwargs else sizes[-1] if sizes else UNKNOWN))
    return None if n is None else n * _itemsize(kwargs, 8)


def _strided(at: int) -> Callable[[tuple, dict], int | None]:
    def count(args: tuple, kwargs: dict) -> int | None:  # the storage strides reach, not only the elements
        size, stride = _ints(_arg(args, kwargs, at, "size")), _ints(_arg(args, kwargs, at + 1, "stride"))
        if size is None or stride is None:
            return None
        n = _numel(size) or 0
        reach = 1 + sum((s - 1) * abs(t) for s, t in zip(size, stride)) if n else 0
        return max(n, reach) * _itemsize(kwargs, None if at == 0 else _UNKNOWN_ITEMSIZE)
    return count


def _eye(args: tuple, kwargs: dict) -> int | None:
    n = _arg(args, kwargs, 0, "n")
    m = _arg(args, kwargs, 1, "m", n)
    m = n if m is None else m
    return None if type(n) is not int or type(m) is not int else max(n, 0) * max(m, 0) * _itemsize(kwargs)


def _arange(inclusive: bool) -> Callable[[tuple, dict], int | None]:
    def count(args: tuple, kwargs: dict) -> int | None:
        if len(args) == 1:  # arange(end)
            start, end, step = 0, args[0], 1
        else:  # arange(start, end[, step]), or by keyword
            start, end, step = (tuple(args) + (0, UNKNOWN, 1)[len(args):])[:3]
        start, end, step = kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
        a, b, s = _number(start), _number(end), _number(step)
        if a is None or b is None or s is None or s == 0:
            return None
        n = max(math.floor((b - a) / s) + 1 if inclusive else math.ceil((b - a) / s), 0)
        integers = all(type(v) is int for v in (start, end, step))
        return n * _itemsize(kwargs, 8 if integers else None)
    return count


def _steps(args: tuple, kwargs: dict) -> int | None:  # linspace / logspace (start, end, steps)
    steps = _arg(args, kwargs, 2, "steps")
    return None if type(steps) is not int else max(steps, 0) * _itemsize(kwargs)


def _first_int(itemsize: int | None) -> Callable[[tuple, dict], int | None]:
    def count(args: tuple, kwargs: dict) -> int | None:  # randperm(n), hann_window(n)
        n = args[0] if args else kwargs.get("n", kwargs.get("window_length"))
        return None if type(n) is not int else max(n, 0) * _itemsize(kwargs, itemsize)
    return count


def _new(args: tuple, kwargs: dict) -> int | None:  # x.new_zeros(size), x.new_empty(2, 3)
    n = _numel(_size(args, kwargs, 1))
    return None if n is None else n * _itemsize(kwargs, _UNKNOWN_ITEMSIZE)


def _new_full(args: tuple, kwargs: dict) -> int | None:
    n = _numel(_ints(_arg(args, kwargs, 1, "size")))
    return None if n is None else n * _itemsize(kwargs, _UNKNOWN_ITEMSIZE)


def _expand(args: tuple, kwargs: dict) -> int | None:  # x.expand(2**20, -1): at least the literal sizes
    n = _numel(_size(args, kwargs, 1), keep=True)
    return None if n is None else n * _UNKNOWN_ITEMSIZE


def _repeat(args: tuple, kwargs: dict) -> int | None:  # x.repeat(...), x.tile(...): at least the factors
    n = _numel(_size(args, kwargs, 1, "repeats" if "repeats" in kwargs else "dims"))
    return None if n is None else n * _UNKNOWN_ITEMSIZE


def _repeat_interleave(args: tuple, kwargs: dict) -> int | None:
    repeats = _arg(args, kwargs, 1, "repeats")
    return None if type(repeats) is not int else max(repeats, 0) * _UNKNOWN_ITEMSIZE


def _interpolate(args: tuple, kwargs: dict) -> int | None:  # F.interpolate(x, size=(h, w)): at least h*w
    size = _arg(args, kwargs, 1, "size", None)
    size = _arg(args, kwargs, 1, "output_size", None) if size is None else size
    n = _numel(_ints(size)) if size is not None else None
    return None if n is None else n * _UNKNOWN_ITEMSIZE


_WINDOWS = ("hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window")
# op name (a torch function's, an aten op's, or a Tensor method's) -> how to count what it allocates
RULES: dict[str, Callable[[tuple, dict], int | None]] = {
    **{n: _sized for n in ("zeros", "ones", "empty", "rand", "randn")},
    "full": _full, "randint": _randint, "empty_strided": _strided(0), "new_empty_strided": _strided(1),
    "empty_permuted": _sized, "eye": _eye, "arange": _arange(False), "range": _arange(True),
    "linspace": _steps, "logspace": _steps, "randperm": _first_int(8), **{n: _first_int(None) for n in _WINDOWS},
    **{n: _new for n in ("new_zeros", "new_ones", "new_empty")}, "new_full": _new_full,
    "expand": _expand, "broadcast_to": _expand, "repeat": _repeat, "tile": _repeat,
    "repeat_interleave": _repeat_interleave, "interpolate": _interpolate, "upsample": _interpolate,
    **{f"upsample_{k}": _interpolate for k in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                                               "bicubic2d", "trilinear3d")},
}
VIEWS = frozenset({"expand", "broadcast_to"})  # allocate nothing: the largest counts, not their sum
_METHODS = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "expand", "broadcast_to",
                      "repeat", "tile", "repeat_interleave"})
_NAMESPACES = frozenset({"torch", "torch.nn.functional", "torch._C._nn"})  # saved-name prefixes of the rules' functions


def _rule_name(fn: Any) -> str | None:
    """The :data:`RULES` entry for ``fn``: a Tensor method called by an op module or a ``call_method``
    node, an aten op, or a torch function of that name (its saved name, found by identity among every function a save may
    name, an opt-in's included: :func:`.allowlist.any_name`; never a function named alike).
    Every rule reads the tensor a method or function works on as its first argument."""
    if isinstance(fn, ops._MethodCall):
        return fn.name if fn.name in _METHODS else None
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = fn._schema.name if isinstance(fn, torch._ops.OpOverload) else fn._qualified_op_name
        namespace, _, name = qualified.partition("::")
        return name if namespace == "aten" and name in RULES else None
    method = getattr(fn, "__name__", None)
    if isinstance(method, str) and method in _METHODS and getattr(torch.Tensor, method, None) is fn:
        return method
    prefix, _, name = allowlist.any_name(fn).rpartition(".")
    return name if prefix in _NAMESPACES and name in RULES else None


# --- folding literal integer arithmetic ------------------------------------------------------------------
def _pow(a: int, b: int) -> int:
    if b < 0:
        return 0
    return _HUGE if abs(a) > 1 and b * max(abs(a).bit_length(), 1) > 256 else a**b


_FOLD: dict[Any, Callable[..., int]] = {
    operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul, operator.neg: operator.neg,
    operator.floordiv: lambda a, b: a // b if b else 0, operator.mod: lambda a, b: a % b if b else 0,
    operator.pow: _pow, operator.lshift: lambda a, b: _HUGE if b > 256 else a << max(b, 0),
}


def _resolved(value: Any, env: dict[fx.Node, Any]) -> Any:
    if isinstance(value, fx.Node):
        return env.get(value, UNKNOWN)
    if type(value) in (tuple, list) or isinstance(value, torch.Size):
        return type(value)(_resolved(v, env) for v in value) if type(value) in (tuple, list) else tuple(value)
    if type(value) is dict:
        return {k: _resolved(v, env) for k, v in value.items()}
    return value


def _fold(node: fx.Node, args: tuple[Any, ...]) -> Any:
    fn = _FOLD.get(node.target) if node.op == "call_function" and not node.kwargs else None
    if fn is None or not all(type(a) is int for a in args):
        if node.op == "call_function" and node.target is operator.getitem and len(args) == 2 \
                and isinstance(args[0], tuple) and type(args[1]) is int and -len(args[0]) <= args[1] < len(args[0]):
            return args[0][args[1]]
        return UNKNOWN
    try:
        return max(-_HUGE, min(_HUGE, fn(*args)))
    except (ArithmeticError, ValueError, TypeError):
        return UNKNOWN


def _filled(template: Any, inputs: tuple[Any, ...]) -> Any:
    """An op module's argument template with its slots filled by the (resolved) call-site values."""
    if isinstance(template, ops.Slot):
        return inputs[template.index] if 0 <= template.index < len(inputs) else UNKNOWN
    if type(template) in (tuple, list):
        return type(template)(_filled(t, inputs) for t in template)
    if type(template) is dict:
        return {k: _filled(v, inputs) for k, v in template.items()}
    return template


# --- the walk ---------------------------------------------------------------------------------------------
def _graphs(root: nn.Module) -> Iterator[tuple[str, fx.Graph, nn.Module]]:
    for path, module in root.named_modules(remove_duplicate=True):
        graph = getattr(module, "graph", None) if isinstance(module, fx.GraphModule) else None
        if isinstance(graph, fx.Graph):
            yield path, graph, module


def literal_allocations(root: nn.Module) -> list[tuple[str, str, int]]:
    """``(node, what it calls, bytes)`` for every node of ``root``'s graph (and nested graphs) that
    makes a tensor whose size is written into the graph, before anything runs."""
    found: list[tuple[str, str, int]] = []
    for path, graph, owner in _graphs(root):
        env: dict[fx.Node, Any] = {}
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            args = _resolved(tuple(node.args), env)
            kwargs = _resolved(dict(node.kwargs), env)
            fn: Any = node.target
            if node.op == "call_method":
                fn = ops.method_call(node.target) if isinstance(node.target, str) else None
            elif node.op == "call_module":
                module = owner.get_submodule(node.target) if isinstance(node.target, str) else None
                if not isinstance(module, ops.BoundOp) or kwargs:
                    continue
                fn, args, kwargs = module.fn, _filled(module.args, args), _filled(module.kwargs, args)
            name = _rule_name(fn)
            if name is None:
                env[node] = _fold(node, args)
                continue
            try:
                count = RULES[name](tuple(args), dict(kwargs) if isinstance(kwargs, dict) else {})
            except (TypeError, ValueError, IndexError, KeyError, OverflowError):
                count = None  # malformed calls fail when run, before allocating
            if count:
                found.append((f"{path}.{node.name}" if path else node.name, name, count))
    return found


def declared_bytes(made: list[tuple[str, str, int]]) -> int:
    """What :func:`literal_allocations` found, as one number for the budget: the constructors' bytes
    summed, plus the largest view (see the module docstring)."""
    return sum(b for _, what, b in made if what not in VIEWS) + max((b for _, what, b in made if what in VIEWS), default=0)
