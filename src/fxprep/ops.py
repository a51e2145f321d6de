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
import keyword
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

_AUTOGRAD_CALLERS: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def autograd_function_caller(fn_cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """A plain function that calls ``fn_cls.apply``; fx cannot use a bound classmethod (or a class
    argument) as a node target, but it can use this. ``caller.autograd_function`` is ``fn_cls``."""
    caller = _AUTOGRAD_CALLERS.get(fn_cls)
    if caller is None:

        def caller(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)

        caller.__name__ = f"{fn_cls.__name__}_apply"
        caller.__qualname__ = caller.__name__
        caller.__module__ = fn_cls.__module__
        caller.autograd_function = fn_cls  # type: ignore[attr-defined]
        _AUTOGRAD_CALLERS[fn_cls] = caller
    return caller


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
    graph nodes when a pass rewrites a call). The reference semantics of a :class:`BoundOp` call:
    :func:`_caller` compiles the same thing once per template."""
    if isinstance(template, Slot):
        return inputs[template.index]
    if type(template) in (tuple, list):
        return type(template)(fill_template(t, inputs) for t in template)
    if type(template) is dict:
        return {k: fill_template(v, inputs) for k, v in template.items()}
    if type(template) is slice:
        return slice(fill_template(template.start, inputs), fill_template(template.stop, inputs), fill_template(template.step, inputs))
    return template


# --- the call path ---------------------------------------------------------------------------------
# A BoundOp runs on every calibration batch, and LLMs have hundreds of them per forward. Filling the
# template (walking it, rebuilding every container) cost more than many of the ops themselves, so
# each template is compiled once into a small Python function that makes exactly the call written
# in the source: ``fn(inputs[0], inputs[1], dim=c0)``, ``inputs[0].transpose(c0, c1)``. Generated
# code is cached by the template's shape (constants are bound, never printed into the source).
_FACTORIES: dict[str, Callable[..., Callable[[tuple[Any, ...]], Any]]] = {}


class _Emitter:
    def __init__(self) -> None:
        self.consts: list[Any] = []

    def const(self, value: Any) -> str:
        self.consts.append(value)
        return f"c{len(self.consts) - 1}"

    def emit(self, value: Any) -> str:
        if isinstance(value, Slot):
            return f"inputs[{int(value.index)}]"
        if type(value) is tuple:
            if not _has_slot(value):
                return self.const(value)  # immutable: passed as it is
            parts = [self.emit(v) for v in value]
            return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
        if type(value) is list:
            return f"[{', '.join(self.emit(v) for v in value)}]"  # a new list per call, as fill_template makes
        if type(value) is dict:
            return "{" + ", ".join(f"{self.const(k)}: {self.emit(v)}" for k, v in value.items()) + "}"
        if type(value) is slice and _has_slot(value):
            return f"slice({self.emit(value.start)}, {self.emit(value.stop)}, {self.emit(value.step)})"
        return self.const(value)

    def call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        parts = [self.emit(a) for a in args]
        parts += [f"{k}={self.emit(v)}" if k.isidentifier() and not keyword.iskeyword(k) else f"**{{{self.const(k)}: {self.emit(v)}}}"
                  for k, v in kwargs.items()]
        if isinstance(fn, _MethodCall) and fn.name.isidentifier() and args and isinstance(args[0], Slot):
            return f"{parts[0]}.{fn.name}({', '.join(parts[1:])})"  # the method looked up as Tensor.<name>(x) would
        return f"fn({', '.join(parts)})"


def _has_slot(value: Any) -> bool:
    if isinstance(value, Slot):
        return True
    if type(value) in (tuple, list):
        return any(_has_slot(v) for v in value)
    if type(value) is dict:
        return any(_has_slot(v) for v in value.values())
    if type(value) is slice:
        return any(_has_slot(v) for v in (value.start, value.stop, value.step))
    return False


def _caller(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[tuple[Any, ...]], Any]:
    """``inputs -> fn(*filled args, **filled kwargs)``, compiled for this template."""
    emitter = _Emitter()
    body = emitter.call(fn, args, kwargs)
    names = ", ".join(f"c{i}" for i in range(len(emitter.consts)))
    source = f"def make(fn{', ' if names else ''}{names}):\n    def call(inputs):\n        return {body}\n    return call\n"
    factory = _FACTORIES.get(source)
    if factory is None:
        namespace: dict[str, Any] = {}
        exec(compile(source, "<fxprep.ops.BoundOp>", "exec"), namespace)  # noqa: S102 - source built above from a template
        factory = _FACTORIES[source] = namespace["make"]
    return factory(fn, *emitter.consts)


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


def op_name(fn: Any) -> str | None:
    """``torch.ops.<ns>.<op>[.<overload>]`` for a dispatcher op (aten's or a library's custom op,
    ``torch.ops.transformers.grouped_mm_fallback``), None for anything else. Its Python
    ``__qualname__`` names the C++ binding's record type, not the op."""
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops.{fn.namespace}.{fn._opname}.{fn._overloadname}"
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
    return None


def qualified_name(fn: Any) -> str:
    """An importable name for ``fn`` (used for display and by save/load)."""
    if isinstance(fn, _MethodCall):
        return f"Tensor.{fn.name}"
    op = op_name(fn)
    if op is not None:
        return op
    autograd_fn = getattr(fn, "autograd_function", None)
    if autograd_fn is not None:
        return f"autograd:{autograd_fn.__module__}.{autograd_fn.__qualname__}"
    try:
        if fn in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[fn]
    except TypeError:  # unhashable callable
        pass
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None)
    name = qualname if qualname else getattr(fn, "__name__", repr(fn))
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


def filled(template: Any, inputs: Sequence[Any]) -> Any:
    """An op module's argument template with its slots filled by ``inputs`` (what its call passes on);
    a slot past the inputs is None (the call would fail on it)."""
    if isinstance(template, Slot):
        return inputs[template.index] if 0 <= template.index < len(inputs) else None
    if type(template) in (tuple, list):
        return type(template)(filled(t, inputs) for t in template)
    if type(template) is dict:
        return {k: filled(v, inputs) for k, v in template.items()}
    return template


class BoundOp(nn.Module):
    """One functional call, bound: ``forward(*tensors)`` calls ``fn(*args, **kwargs)`` with the
    tensors put back into their slots. Static arguments are attributes (``self.args``,
    ``self.kwargs``), shown by ``print(module)``. Setting ``fn``, ``args`` or ``kwargs`` recompiles
    the call (see :func:`_caller`); copies and pickles rebuild it."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        super().__init__()
        args, kwargs = tuple(args), dict(kwargs or {})
        if isinstance(fn, (nn.Module, torch.Tensor)):  # nn.Module's bookkeeping, then the call compiled
            self.fn, self.args, self.kwargs = fn, args, kwargs
        else:  # plain attributes: written directly (an LLM graph builds thousands of these)
            self.__dict__.update(fn=fn, args=args, kwargs=kwargs)
            self._rebuild()
        self.__dict__["num_inputs"] = _count_slots((args, kwargs))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("fn", "args", "kwargs"):
            self._rebuild()

    def _rebuild(self) -> None:
        state = self.__dict__
        if "fn" in state and "args" in state and "kwargs" in state:
            state["_call"] = _caller(state["fn"], state["args"], state["kwargs"])

    @property
    def fn_name(self) -> str:
        return qualified_name(self.fn)

    def forward(self, *inputs: Any) -> Any:
        return self._call(inputs)

    def extra_repr(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.fn_name}({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its callable *named* where the name leads back to it: some torch functions
        are closures that pickle cannot reach by reference (``F.max_pool2d`` is made by
        ``boolean_dispatch``), and AIMET's export ``torch.save``-s the whole model."""
        state = self.__dict__.copy()
        state.pop("_call", None)  # generated code: rebuilt on load, never pickled or copied
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
        self._rebuild()


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
    """``F.scaled_dot_product_attention`` with every argument kept (mask, causal, scale, dropout, GQA)."""

    def forward(self, *inputs: Any) -> Any:
        # The graph calls SDPA as eager does, so grouped-query attention keeps enable_gqa=True; torch's
        # TorchScript ONNX exporter (the one AIMET QuantSim's export uses) cannot convert that flag on
        # older torch (2.8: "not implemented if enable_gqa is True"). Under an ONNX export the same
        # attention is written with each key/value head repeated for its query group: equal values.
        if self.kwargs.get("enable_gqa") is True and torch.onnx.is_in_onnx_export():
            return _sdpa_heads_repeated(self.fn, fill_template(self.args, inputs), fill_template(self.kwargs, inputs))
        return self._call(inputs)


def _sdpa_heads_repeated(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(q, k, v, ..., enable_gqa=True)`` as ``fn(q, k', v', ...)`` with k and v's heads (dim -3)
    repeated ``q_heads // kv_heads`` times each, which is what enable_gqa means."""
    names = ("query", "key", "value")
    q, k, v = (args[i] if i < len(args) else kwargs[names[i]] for i in range(3))
    rest = {n: x for n, x in kwargs.items() if n not in names and n != "enable_gqa"}
    groups = q.size(-3) // k.size(-3)
    return fn(q, k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3), *args[3:], **rest)


class AutogradFunction(BoundOp):
    """A custom ``torch.autograd.Function``: ONE call, so its own backward still runs."""


class Functional(BoundOp):
    """Any other tensor-computing call."""
