"""The modules that functional ops become.

A compression toolkit attaches quantizers (and other wrappers) to *modules*, so every
tensor-computing functional call in a prepared graph becomes a ``call_module``. Where ``torch.nn``
has a layer that computes exactly the same thing (``F.relu`` → ``nn.ReLU``, ``F.linear`` with the
module's own parameters → ``nn.Linear`` holding those same Parameter objects), the pass uses it.
Everything else becomes a :class:`BoundOp`: a module that stores the *original* callable and the
call's arguments, with a slot for each tensor. Its forward makes the very same call, so it is exact
by construction; no argument is dropped or reordered, keyword arguments stay keyword arguments.

Named subclasses (:class:`Add`, :class:`MatMul`, :class:`Concat`, ...) carry no logic of their own:
they exist so tools and people can recognise the op by class.
"""

from __future__ import annotations

import builtins
import importlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .wrap import autograd_function_caller


class Slot:
    """Placeholder in a :class:`BoundOp` argument template for the ``index``-th forward input."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<in{self.index}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Slot) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("Slot", self.index))


def fill_template(template: Any, inputs: tuple[Any, ...]) -> Any:
    """``template`` with each :class:`Slot` replaced by ``inputs[slot.index]`` (tensors at run time,
    graph nodes when a pass rewrites a call)."""
    if isinstance(template, Slot):
        return inputs[template.index]
    if type(template) in (tuple, list):
        return type(template)(fill_template(t, inputs) for t in template)
    if type(template) is dict:
        return {k: fill_template(v, inputs) for k, v in template.items()}
    if type(template) is slice:
        return slice(fill_template(template.start, inputs), fill_template(template.stop, inputs), fill_template(template.step, inputs))
    return template


class _MethodCall:
    """``Tensor.<name>`` called on its first argument (how fx's ``call_method`` nodes run)."""

    def __init__(self, name: str):
        self.name = name
        self.__name__ = name
        self.__qualname__ = f"Tensor.{name}"

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tensor.{self.name}"


def method_call(name: str) -> _MethodCall:
    return _MethodCall(name)


def qualified_name(fn: Any) -> str:
    """An importable name for ``fn`` (used for display and by save/load)."""
    if isinstance(fn, _MethodCall):
        return f"Tensor.{fn.name}"
    autograd_fn = getattr(fn, "autograd_function", None)
    if autograd_fn is not None:
        return f"autograd:{autograd_fn.__module__}.{autograd_fn.__qualname__}"
    try:
        if fn in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[fn]
    except TypeError:  # unhashable callable
        pass
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    short = getattr(fn, "__name__", "")
    if short and (module == "torch" or module.startswith("torch.") or not module):
        # torch's builtins report where they are implemented (``torch._VariableFunctionsClass.add``,
        # ``torch._C._nn.gelu``), which is not importable: name the public namespace holding them.
        for prefix in _PUBLIC_NAMESPACES + _PRIVATE_NAMESPACES:
            ns = _namespace(prefix)
            # torch.special.erf is named "special_erf", torch.linalg.vector_norm "linalg_vector_norm"
            for attr in dict.fromkeys((short, short.removeprefix(prefix.rpartition(".")[2] + "_"))):
                if ns is not None and getattr(ns, attr, None) is fn:
                    return f"{prefix}.{attr}"
    return f"{module}.{name}" if module else name


_PUBLIC_NAMESPACES = ("torch.nn.functional", "torch", "torch.special", "torch.linalg", "torch.fft")
_PRIVATE_NAMESPACES = ("torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft")


def _namespace(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        return _import_attr(path)  # torch._C._nn and friends are attributes, not importable modules


_OPERATOR_NAMES = {getattr(operator, n): f"operator.{n}" for n in dir(operator) if not n.startswith("_")}
_OPERATOR_NAMES.update({builtins.len: "builtins.len", builtins.getattr: "builtins.getattr"})


def _import_attr(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    while module_name:
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            module_name, _, head = module_name.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


def resolve_callable(name: str) -> Callable[..., Any]:
    """Inverse of :func:`qualified_name` for the names fxprep writes (used by ``fxprep.load``)."""
    if name.startswith("Tensor."):
        return method_call(name.removeprefix("Tensor."))
    if name.startswith("autograd:"):
        cls = _import_attr(name.removeprefix("autograd:"))
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise ImportError(f"cannot import autograd.Function {name!r}")
        return autograd_function_caller(cls)
    fn = _import_attr(name)
    if fn is None or not callable(fn):
        raise ImportError(f"cannot import callable {name!r}")
    return fn


class BoundOp(nn.Module):
    """One functional call, bound: ``forward(*tensors)`` calls ``fn(*args, **kwargs)`` with the
    tensors put back into their slots. Static arguments are attributes (``self.args``,
    ``self.kwargs``), shown by ``print(module)``."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.num_inputs = _count_slots((self.args, self.kwargs))

    @property
    def fn_name(self) -> str:
        return qualified_name(self.fn)

    def forward(self, *inputs: Any) -> Any:
        return self.fn(*fill_template(self.args, inputs), **fill_template(self.kwargs, inputs))

    def extra_repr(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.fn_name}({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its callable *named* where the name leads back to it: some torch functions
        are closures that pickle cannot reach by reference (``F.max_pool2d`` is made by
        ``boolean_dispatch``), and AIMET's export ``torch.save``-s the whole model."""
        state = self.__dict__.copy()
        name = qualified_name(self.fn)
        try:
            if resolve_callable(name) is self.fn:
                state["fn"] = _NamedCallable(name)
        except ImportError:
            pass
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("fn"), _NamedCallable):
            state = {**state, "fn": resolve_callable(state["fn"].name)}
        super().__setstate__(state)


class _NamedCallable:
    """A callable in a pickle, by its importable name (see :meth:`BoundOp.__getstate__`)."""

    def __init__(self, name: str):
        self.name = name


def _count_slots(template: Any) -> int:
    if isinstance(template, Slot):
        return 1
    if isinstance(template, (tuple, list)):
        return sum(_count_slots(t) for t in template)
    if isinstance(template, dict):
        return sum(_count_slots(t) for t in template.values())
    if isinstance(template, slice):
        return _count_slots((template.start, template.stop, template.step))
    return 0


# --- named ops -----------------------------------------------------------------------------------
# Element-wise arithmetic
class Add(BoundOp):
    """Element-wise addition (``a + b``, ``torch.add``, ``Tensor.add``)."""


class Sub(BoundOp):
    """Element-wise subtraction (``a - b``, ``torch.sub``, ``torch.rsub``)."""


class Mul(BoundOp):
    """Element-wise multiplication."""


class Div(BoundOp):
    """Element-wise true division."""


class FloorDiv(BoundOp):
    """Element-wise floor division (``//``, ``torch.floor_divide``)."""


class Remainder(BoundOp):
    """Element-wise remainder (``%``, ``torch.remainder``, ``torch.fmod``)."""


class Pow(BoundOp):
    """Element-wise power."""


class Neg(BoundOp):
    """Negation."""


class Abs(BoundOp):
    """Absolute value."""


class Exp(BoundOp):
    """Exponential."""


class Log(BoundOp):
    """Natural logarithm (and log2/log10/log1p)."""


class Sqrt(BoundOp):
    """Square root."""


class Rsqrt(BoundOp):
    """Reciprocal square root."""


class Square(BoundOp):
    """Square."""


class Reciprocal(BoundOp):
    """Reciprocal."""


class Clamp(BoundOp):
    """Clamp / clip."""


class Maximum(BoundOp):
    """Element-wise maximum."""


class Minimum(BoundOp):
    """Element-wise minimum."""


class Compare(BoundOp):
    """Element-wise comparison (``==``, ``<``, ``torch.gt`` ...)."""


class Logical(BoundOp):
    """Element-wise logical / bitwise op (``&``, ``|``, ``~``, ``torch.logical_and`` ...)."""


class Unary(BoundOp):
    """Other element-wise unary math (``sin``, ``erf``, ``floor``, ``sign``, ...)."""


# Matrix products
class MatMul(BoundOp):
    """Matrix product (``@``, ``torch.matmul``, ``torch.mm``)."""


class Bmm(BoundOp):
    """Batched matrix product."""


class Baddbmm(BoundOp):
    """``beta * input + alpha * (batch1 @ batch2)``."""


class Addmm(BoundOp):
    """``beta * input + alpha * (mat1 @ mat2)``."""


class Einsum(BoundOp):
    """Einstein summation."""


# Joining and reductions
class Concat(BoundOp):
    """Concatenation (``torch.cat``/``concat``/``concatenate``)."""


class Stack(BoundOp):
    """Stacking along a new dimension."""


class Sum(BoundOp):
    """Sum reduction."""


class Mean(BoundOp):
    """Mean reduction."""


class Norm(BoundOp):
    """Norm (``torch.norm``, ``Tensor.norm``, ``torch.linalg.vector_norm``)."""


class CumSum(BoundOp):
    """Cumulative sum."""


class Amax(BoundOp):
    """Max reduction (``amax``, ``max`` over a dim)."""


class Amin(BoundOp):
    """Min reduction (``amin``, ``min`` over a dim)."""


class Reduce(BoundOp):
    """Other reductions (``prod``, ``var``, ``std``, ``logsumexp``, ``argmax``...)."""


# Selection
class Where(BoundOp):
    """``torch.where(cond, a, b)`` / ``a.where(cond, b)``."""


class MaskedFill(BoundOp):
    """``masked_fill`` (out of place, as written: never turned into ``masked_fill_``)."""


# Layers in functional form whose weights are computed (or not module-owned)
class FunctionalLinear(BoundOp):
    """``F.linear`` with weights passed in as inputs."""


class FunctionalConv(BoundOp):
    """``F.conv*d`` / ``F.conv_transpose*d`` with weights passed in as inputs."""


class FunctionalNorm(BoundOp):
    """``F.layer_norm``/``group_norm``/``batch_norm``/``instance_norm``/``rms_norm`` in functional form."""


class FunctionalEmbedding(BoundOp):
    """``F.embedding`` with the table passed in as an input."""


class PReLUOp(BoundOp):
    """``F.prelu`` with a computed weight."""


class Activation(BoundOp):
    """An activation whose arguments have no ``torch.nn`` module equivalent (e.g. softmax with ``dtype``)."""


class Softmax(BoundOp):
    """``softmax``/``log_softmax`` with arguments ``nn.Softmax`` cannot hold (``dtype``)."""


class Dropout(BoundOp):
    """Dropout whose ``training`` flag was fixed in the source (not tied to the module mode)."""


class Interpolate(BoundOp):
    """``F.interpolate`` / ``upsample``."""


class Pad(BoundOp):
    """``F.pad``."""


class Pool(BoundOp):
    """Max / average / adaptive pooling in functional form (``return_indices`` included)."""


class ScaledDotProductAttention(BoundOp):
    """``F.scaled_dot_product_attention`` with every argument kept (mask, causal, scale, dropout)."""


class AutogradFunction(BoundOp):
    """A custom ``torch.autograd.Function``: ONE call, so its own backward still runs."""


class Functional(BoundOp):
    """Any other tensor-computing call."""
