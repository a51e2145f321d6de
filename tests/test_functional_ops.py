"""The functional → module pass, op by op, through the public ``prepare_model`` (fx tracer).

Every case builds a tiny module around one op (in its function, ``torch.*`` and Tensor-method
forms), prepares it, and checks four things: the prepared module computes the same thing on *other*
inputs than the example ones, the op became a ``call_module`` of the expected class (with the
expected arguments), no tensor-computing function call is left, and the user's model is untouched.
"""

from __future__ import annotations

import copy
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep import ops
from fxprep.passes.functional_to_module import remaining_compute_ops

from .helpers import STE


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


_scaled.__module__ = "torch_utils.ops"  # a user package whose name merely starts with "torch"
torch.fx.wrap("_scaled")


@torch.fx.wrap
def add_2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A user function whose name looks like an fx node name of ``torch.add``: it is not an add."""
    return x * 3 + y


# --- helpers ------------------------------------------------------------------------------------
InputSpec = Any  # a shape tuple (float randn) or a callable(generator) -> tensor


def pos(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.rand(*shape, generator=g) + 0.5


def ints(high: int, *shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, high, shape, generator=g)


def mask(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.rand(*shape, generator=g) < 0.5


def f64(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(*shape, generator=g, dtype=torch.float64)


def make_inputs(specs: tuple[InputSpec, ...], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(s(g) if callable(s) else torch.randn(*s, generator=g) for s in specs)


class _Fn(nn.Module):
    """A module whose forward is ``fn(self, *inputs)``; members (parameters, buffers, children)
    are set as attributes."""

    def __init__(self, fn: Callable[..., Any], members: dict[str, Any] | None = None):
        super().__init__()
        self.fn = fn
        for name, value in (members or {}).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)


class Fn1(_Fn):
    def forward(self, a: Any) -> Any:
        return self.fn(self, a)


class Fn2(_Fn):
    def forward(self, a: Any, b: Any) -> Any:
        return self.fn(self, a, b)


class Fn3(_Fn):
    def forward(self, a: Any, b: Any, c: Any) -> Any:
        return self.fn(self, a, b, c)


def build(fn: Callable[..., Any], n_inputs: int, members: dict[str, Any] | None = None) -> nn.Module:
    return {1: Fn1, 2: Fn2, 3: Fn3}[n_inputs](fn, members)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything prepare_model must leave as it was: module tree, tensors (objects and values),
    attributes, hooks and modes."""
    return {
        "modules": [(n, m, type(m), m.training) for n, m in model.named_modules(remove_duplicate=False)],
        "dicts": [(n, sorted(m.__dict__), dict(m._modules), dict(m._parameters), dict(m._buffers))
                  for n, m in model.named_modules(remove_duplicate=False)],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks),
                   len(m._load_state_dict_pre_hooks)) for m in model.modules()],
        "values": {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
        "class": type(model),
    }


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert [(n, id(m), t, tr) for n, m, t, tr in after["modules"]] == [
        (n, id(m), t, tr) for n, m, t, tr in before["modules"]
    ]
    assert after["dicts"] == before["dicts"]
    assert after["hooks"] == before["hooks"]
    assert after["class"] is before["class"]
    assert after["values"].keys() == before["values"].keys()
    for key, (tensor, value) in before["values"].items():
        assert after["values"][key][0] is tensor, key
        assert torch.equal(tensor.detach(), value), key


def added_modules(gm: fx.GraphModule, model: nn.Module) -> dict[str, nn.Module]:
    """The call_module targets that are not the user's own module objects."""
    originals = {id(m) for m in model.modules()}
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if id(mod) not in originals:
                out[str(node.target)] = mod
    return out


def the_module(gm: fx.GraphModule, model: nn.Module, cls: type[nn.Module]) -> nn.Module:
    found = [m for m in added_modules(gm, model).values() if type(m) is cls]
    assert len(found) == 1, f"expected one {cls.__name__}, found {len(found)}"
    return found[0]


def assert_same_output(ref: Any, got: Any) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


def check_callables_round_trip(gm: fx.GraphModule) -> None:
    """Each BoundOp stores the original callable, and its display name resolves back to it."""
    for mod in gm.modules():
        if isinstance(mod, ops.BoundOp):
            back = ops.resolve_callable(mod.fn_name)
            if isinstance(mod.fn, ops._MethodCall):
                assert isinstance(back, ops._MethodCall) and back.name == mod.fn.name
            elif getattr(mod.fn, "autograd_function", None) is not None:
                assert back.autograd_function is mod.fn.autograd_function  # type: ignore[attr-defined]
            else:
                assert back is mod.fn, (mod.fn_name, mod.fn)


def prepare(model: nn.Module, inputs: tuple[Any, ...], **options: Any) -> fx.GraphModule:
    """prepare_model with the fx tracer, checking the model and the example inputs are untouched."""
    before = snapshot(model)
    kept = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    gm = fxprep.prepare_model(model, example_inputs=inputs, tracer="fx", **options)
    assert_untouched(model, before)
    for a, b in zip(inputs, kept):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    return gm


def run_both(model: nn.Module, gm: fx.GraphModule, inputs: tuple[Any, ...], seed: int = 0) -> tuple[Any, Any]:
    """Original and prepared on clones of the same inputs, the same RNG seed before each."""
    with torch.no_grad():
        torch.manual_seed(seed)
        ref = model(*[t.clone() for t in inputs])
        torch.manual_seed(seed)
        got = gm(*[t.clone() for t in inputs])
    return ref, got


@dataclass
class Case:
    id: str
    fn: Callable[..., Any]
    inputs: tuple[InputSpec, ...]
    expect: list[type[nn.Module]]
    members: Callable[[], dict[str, Any]] | None = None
    check: Callable[[fx.GraphModule, nn.Module], None] | None = None
    training: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def run_case(case: Case) -> tuple[fx.GraphModule, nn.Module]:
    model = build(case.fn, len(case.inputs), case.members() if case.members else None)
    model.train(case.training)
    example = make_inputs(case.inputs, seed=0)
    gm = prepare(model, example)
    assert gm.fxprep_report.verification.status == "passed"
    # (c) nothing tensor-computing is left as a function call
    assert remaining_compute_ops(gm) == []
    assert gm.fxprep_report.left == []
    # (b) the op became modules of the expected classes, and nothing else was added
    got = Counter(type(m) for m in added_modules(gm, model).values())
    assert got == Counter(case.expect), {c.__name__: n for c, n in got.items()}
    check_callables_round_trip(gm)
    # (a) same outputs on inputs of another value than the example
    fresh = make_inputs(case.inputs, seed=1)
    assert any(not torch.equal(a, b) for a, b in zip(example, fresh) if a.is_floating_point()) or not any(
        a.is_floating_point() for a in example
    )
    ref, out = run_both(model, gm, fresh)
    assert_same_output(ref, out)
    if case.check is not None:
        case.check(gm, model)
    return gm, model


def attrs(cls: type[nn.Module], **expected: Any) -> Callable[[fx.GraphModule, nn.Module], None]:
    """Check attributes of the one added module of class ``cls``."""

    def check(gm: fx.GraphModule, model: nn.Module) -> None:
        mod = the_module(gm, model, cls)
        for name, value in expected.items():
            assert getattr(mod, name) == value, (name, getattr(mod, name), value)

    return check


def bound(cls: type[ops.BoundOp], fn: Any, args: tuple[Any, ...] | None = None,
          kwargs: dict[str, Any] | None = None) -> Callable[[fx.GraphModule, nn.Module], None]:
    """Check that the one ``cls`` module calls ``fn`` (the original callable) with these arguments."""

    def check(gm: fx.GraphModule, model: nn.Module) -> None:
        mod = the_module(gm, model, cls)
        assert isinstance(mod, ops.BoundOp)
        if isinstance(fn, str):
            assert isinstance(mod.fn, ops._MethodCall) and mod.fn.name == fn
        else:
            assert mod.fn is fn
        if args is not None:
            assert mod.args == args, mod.args
        if kwargs is not None:
            assert mod.kwargs == kwargs, mod.kwargs

    return check


def ids(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in cases]


S0, S1, S2 = ops.Slot(0), ops.Slot(1), ops.Slot(2)
X = (3, 8)
X2 = ((3, 8), (3, 8))

# --- activations --------------------------------------------------------------------------------
ACTIVATIONS = [
    Case("F.relu", lambda s, x: F.relu(x), (X,), [nn.ReLU], check=attrs(nn.ReLU, inplace=False)),
    Case("torch.relu", lambda s, x: torch.relu(x), (X,), [nn.ReLU]),
    Case("Tensor.relu", lambda s, x: x.relu(), (X,), [nn.ReLU]),
    Case("F.relu6", lambda s, x: F.relu6(x * 4), (X,), [ops.Mul, nn.ReLU6]),
    Case("F.gelu", lambda s, x: F.gelu(x), (X,), [nn.GELU], check=attrs(nn.GELU, approximate="none")),
    Case("F.gelu-tanh", lambda s, x: F.gelu(x, approximate="tanh"), (X,), [nn.GELU],
         check=attrs(nn.GELU, approximate="tanh")),
    Case("F.silu", lambda s, x: F.silu(x), (X,), [nn.SiLU]),
    Case("F.sigmoid", lambda s, x: F.sigmoid(x), (X,), [nn.Sigmoid]),
    Case("torch.sigmoid", lambda s, x: torch.sigmoid(x), (X,), [nn.Sigmoid]),
    Case("Tensor.sigmoid", lambda s, x: x.sigmoid(), (X,), [nn.Sigmoid]),
    Case("F.tanh", lambda s, x: F.tanh(x), (X,), [nn.Tanh]),
    Case("torch.tanh", lambda s, x: torch.tanh(x), (X,), [nn.Tanh]),
    Case("Tensor.tanh", lambda s, x: x.tanh(), (X,), [nn.Tanh]),
    Case("F.hardswish", lambda s, x: F.hardswish(x * 4), (X,), [ops.Mul, nn.Hardswish]),
    Case("F.hardsigmoid", lambda s, x: F.hardsigmoid(x * 4), (X,), [ops.Mul, nn.Hardsigmoid]),
    Case("F.leaky_relu-default", lambda s, x: F.leaky_relu(x), (X,), [nn.LeakyReLU],
         check=attrs(nn.LeakyReLU, negative_slope=0.01)),
    Case("F.leaky_relu-positional", lambda s, x: F.leaky_relu(x, 0.2), (X,), [nn.LeakyReLU],
         check=attrs(nn.LeakyReLU, negative_slope=0.2)),
    Case("F.leaky_relu-keyword", lambda s, x: F.leaky_relu(x, negative_slope=0.3), (X,), [nn.LeakyReLU],
         check=attrs(nn.LeakyReLU, negative_slope=0.3)),
    Case("F.elu", lambda s, x: F.elu(x, alpha=0.5), (X,), [nn.ELU], check=attrs(nn.ELU, alpha=0.5)),
    Case("F.selu", lambda s, x: F.selu(x), (X,), [nn.SELU]),
    Case("torch.selu", lambda s, x: torch.selu(x), (X,), [nn.SELU]),
    Case("F.celu", lambda s, x: F.celu(x, 2.0), (X,), [nn.CELU], check=attrs(nn.CELU, alpha=2.0)),
    Case("torch.celu", lambda s, x: torch.celu(x, alpha=0.7), (X,), [nn.CELU], check=attrs(nn.CELU, alpha=0.7)),
    Case("F.mish", lambda s, x: F.mish(x), (X,), [nn.Mish]),
    Case("F.softplus", lambda s, x: F.softplus(x), (X,), [nn.Softplus], check=attrs(nn.Softplus, beta=1.0, threshold=20.0)),
    Case("F.softplus-args", lambda s, x: F.softplus(x * 4, beta=2, threshold=3), (X,), [ops.Mul, nn.Softplus],
         check=attrs(nn.Softplus, beta=2, threshold=3)),
    Case("F.hardtanh", lambda s, x: F.hardtanh(x, -0.5, 0.25), (X,), [nn.Hardtanh],
         check=attrs(nn.Hardtanh, min_val=-0.5, max_val=0.25)),
    Case("F.logsigmoid", lambda s, x: F.logsigmoid(x), (X,), [nn.LogSigmoid]),
    Case("F.glu", lambda s, x: F.glu(x, dim=1), (X,), [nn.GLU], check=attrs(nn.GLU, dim=1)),
    Case("F.softsign", lambda s, x: F.softsign(x), (X,), [nn.Softsign]),
    Case("F.tanhshrink", lambda s, x: F.tanhshrink(x), (X,), [nn.Tanhshrink]),
    Case("F.threshold", lambda s, x: F.threshold(x, 0.1, 20.0), (X,), [nn.Threshold],
         check=attrs(nn.Threshold, threshold=0.1, value=20.0)),
    Case("torch.threshold", lambda s, x: torch.threshold(x, -0.2, 0.0), (X,), [nn.Threshold]),
    Case("F.hardshrink", lambda s, x: F.hardshrink(x, 0.3), (X,), [nn.Hardshrink], check=attrs(nn.Hardshrink, lambd=0.3)),
    Case("Tensor.hardshrink", lambda s, x: x.hardshrink(), (X,), [nn.Hardshrink], check=attrs(nn.Hardshrink, lambd=0.5)),
    Case("F.softshrink", lambda s, x: F.softshrink(x, lambd=0.25), (X,), [nn.Softshrink],
         check=attrs(nn.Softshrink, lambd=0.25)),
    # softmax family: positional / keyword dim, every form
    Case("F.softmax-positional", lambda s, x: F.softmax(x, -1), (X,), [nn.Softmax], check=attrs(nn.Softmax, dim=-1)),
    Case("F.softmax-keyword", lambda s, x: F.softmax(x, dim=0), (X,), [nn.Softmax], check=attrs(nn.Softmax, dim=0)),
    Case("torch.softmax", lambda s, x: torch.softmax(x, 1), (X,), [nn.Softmax], check=attrs(nn.Softmax, dim=1)),
    Case("Tensor.softmax-positional", lambda s, x: x.softmax(-1), (X,), [nn.Softmax], check=attrs(nn.Softmax, dim=-1)),
    Case("Tensor.softmax-keyword", lambda s, x: x.softmax(dim=0), (X,), [nn.Softmax], check=attrs(nn.Softmax, dim=0)),
    Case("F.log_softmax", lambda s, x: F.log_softmax(x, 1), (X,), [nn.LogSoftmax], check=attrs(nn.LogSoftmax, dim=1)),
    Case("torch.log_softmax", lambda s, x: torch.log_softmax(x, dim=-1), (X,), [nn.LogSoftmax],
         check=attrs(nn.LogSoftmax, dim=-1)),
    Case("Tensor.log_softmax", lambda s, x: x.log_softmax(0), (X,), [nn.LogSoftmax], check=attrs(nn.LogSoftmax, dim=0)),
    Case("F.softmin", lambda s, x: F.softmin(x, 1), (X,), [nn.Softmin], check=attrs(nn.Softmin, dim=1)),
    # with dtype: nn.Softmax cannot hold it, the call is kept exactly
    Case("F.softmax-dtype", lambda s, x: F.softmax(x, dim=-1, dtype=torch.float32), (f64(3, 8),), [ops.Softmax],
         check=bound(ops.Softmax, F.softmax, kwargs={"dim": -1, "_stacklevel": 3, "dtype": torch.float32})),
    Case("F.log_softmax-dtype", lambda s, x: F.log_softmax(x, 1, dtype=torch.float64), (X,), [ops.Softmax]),
    Case("torch.softmax-dtype", lambda s, x: torch.softmax(x, -1, dtype=torch.float64), (X,), [ops.Softmax],
         check=bound(ops.Softmax, torch.softmax, args=(S0, -1), kwargs={"dtype": torch.float64})),
    Case("Tensor.softmax-dtype", lambda s, x: x.softmax(-1, dtype=torch.float32), (f64(3, 8),), [ops.Softmax],
         check=bound(ops.Softmax, "softmax", args=(S0, -1), kwargs={"dtype": torch.float32})),
]


@pytest.mark.parametrize("case", ids(ACTIVATIONS))
def test_activation(case: Case) -> None:
    run_case(case)


def test_softmax_dtype_output_dtype() -> None:
    model = build(lambda s, x: F.softmax(x, dim=-1, dtype=torch.float32), 1)
    x64 = torch.randn(2, 5, dtype=torch.float64)
    gm = prepare(model, (x64,))
    out = gm(x64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x64), rtol=0, atol=0)


def _prelu_shares(gm: fx.GraphModule, model: nn.Module) -> None:
    assert the_module(gm, model, nn.PReLU).weight is model.w


PRELU = [
    Case("F.prelu-module-weight", lambda s, x: F.prelu(x, s.w), ((3, 4, 5),), [nn.PReLU],
         members=lambda: {"w": nn.Parameter(torch.rand(4))}, check=_prelu_shares),
    Case("torch.prelu-module-weight", lambda s, x: torch.prelu(x, s.w), ((3, 4, 5),), [nn.PReLU],
         members=lambda: {"w": nn.Parameter(torch.rand(1))}, check=_prelu_shares),
    Case("Tensor.prelu-module-weight", lambda s, x: x.prelu(s.w), ((3, 4, 5),), [nn.PReLU],
         members=lambda: {"w": nn.Parameter(torch.rand(4))}, check=_prelu_shares),
    Case("F.prelu-computed-weight", lambda s, x: F.prelu(x, s.w * 0.5), ((3, 4, 5),), [ops.Mul, ops.PReLUOp],
         members=lambda: {"w": nn.Parameter(torch.rand(4))}),
    Case("F.prelu-input-weight", lambda s, x, w: F.prelu(x, w), ((3, 4, 5), pos(4)), [ops.PReLUOp]),
]


@pytest.mark.parametrize("case", ids(PRELU))
def test_prelu(case: Case) -> None:
    run_case(case)


# --- arithmetic ---------------------------------------------------------------------------------
ARITHMETIC = [
    Case("add-tt", lambda s, x, y: x + y, X2, [ops.Add], check=bound(ops.Add, operator.add, (S0, S1))),
    Case("add-ts", lambda s, x: x + 2, (X,), [ops.Add], check=bound(ops.Add, operator.add, (S0, 2))),
    Case("add-st", lambda s, x: 2.5 + x, (X,), [ops.Add]),
    Case("torch.add", lambda s, x, y: torch.add(x, y), X2, [ops.Add]),
    Case("torch.add-alpha", lambda s, x, y: torch.add(x, y, alpha=2), X2, [ops.Add],
         check=bound(ops.Add, torch.add, (S0, S1), {"alpha": 2})),
    Case("Tensor.add", lambda s, x, y: x.add(y, alpha=-1), X2, [ops.Add],
         check=bound(ops.Add, "add", (S0, S1), {"alpha": -1})),
    Case("add-parameter", lambda s, x: x + s.b, (X,), [ops.Add], members=lambda: {"b": nn.Parameter(torch.randn(8))}),
    Case("add-buffer", lambda s, x: x + s.b, (X,), [ops.Add], members=lambda: {"b": torch.randn(8)}),
    Case("sub-tt", lambda s, x, y: x - y, X2, [ops.Sub]),
    Case("sub-ts", lambda s, x: x - 1, (X,), [ops.Sub]),
    Case("rsub-literal", lambda s, x: 1 - x, (X,), [ops.Sub], check=bound(ops.Sub, operator.sub, (1, S0))),
    Case("torch.sub-alpha", lambda s, x, y: torch.sub(x, y, alpha=0.5), X2, [ops.Sub]),
    Case("torch.rsub-tt", lambda s, x, y: torch.rsub(x, y), X2, [ops.Sub], check=bound(ops.Sub, torch.rsub, (S0, S1))),
    Case("torch.rsub-ts", lambda s, x: torch.rsub(x, 1), (X,), [ops.Sub]),
    Case("Tensor.sub", lambda s, x, y: x.sub(y), X2, [ops.Sub]),
    Case("mul-tt", lambda s, x, y: x * y, X2, [ops.Mul]),
    Case("mul-ts", lambda s, x: x * 3, (X,), [ops.Mul]),
    Case("mul-st", lambda s, x: 3 * x, (X,), [ops.Mul], check=bound(ops.Mul, operator.mul, (3, S0))),
    Case("torch.mul", lambda s, x, y: torch.mul(x, y), X2, [ops.Mul]),
    Case("Tensor.mul", lambda s, x: x.mul(0.5), (X,), [ops.Mul]),
    Case("div-tt", lambda s, x, y: x / y, ((3, 8), pos(3, 8)), [ops.Div]),
    Case("div-ts", lambda s, x: x / 4, (X,), [ops.Div]),
    Case("div-st", lambda s, x: 2 / x, (pos(3, 8),), [ops.Div], check=bound(ops.Div, operator.truediv, (2, S0))),
    Case("torch.div-rounding", lambda s, x, y: torch.div(x, y, rounding_mode="floor"), ((3, 8), pos(3, 8)), [ops.Div],
         check=bound(ops.Div, torch.div, (S0, S1), {"rounding_mode": "floor"})),
    Case("Tensor.div", lambda s, x: x.div(3), (X,), [ops.Div]),
    Case("floordiv-tt", lambda s, x, y: x // y, ((3, 8), pos(3, 8)), [ops.FloorDiv]),
    Case("floordiv-ts", lambda s, x: x // 0.3, (X,), [ops.FloorDiv]),
    Case("floordiv-st", lambda s, x: 7 // x, (pos(3, 8),), [ops.FloorDiv]),
    Case("torch.floor_divide", lambda s, x, y: torch.floor_divide(x, y), ((3, 8), pos(3, 8)), [ops.FloorDiv]),
    Case("pow-ts", lambda s, x: x ** 2, (X,), [ops.Pow]),
    Case("pow-st", lambda s, x: 2 ** x, (X,), [ops.Pow], check=bound(ops.Pow, operator.pow, (2, S0))),
    Case("pow-tt", lambda s, x, y: x ** y, (pos(3, 8), (3, 8)), [ops.Pow]),
    Case("torch.pow", lambda s, x: torch.pow(x, 3), (X,), [ops.Pow]),
    Case("Tensor.pow", lambda s, x: x.pow(2), (X,), [ops.Pow]),
    Case("neg", lambda s, x: -x, (X,), [ops.Neg]),
    Case("torch.neg", lambda s, x: torch.neg(x), (X,), [ops.Neg]),
    Case("Tensor.neg", lambda s, x: x.neg(), (X,), [ops.Neg]),
    Case("abs", lambda s, x: abs(x), (X,), [ops.Abs]),
    Case("torch.abs", lambda s, x: torch.abs(x), (X,), [ops.Abs]),
    Case("Tensor.abs", lambda s, x: x.abs(), (X,), [ops.Abs]),
    Case("torch.exp", lambda s, x: torch.exp(x), (X,), [ops.Exp]),
    Case("Tensor.exp", lambda s, x: x.exp(), (X,), [ops.Exp]),
    Case("torch.log", lambda s, x: torch.log(x), (pos(3, 8),), [ops.Log]),
    Case("Tensor.log", lambda s, x: x.log(), (pos(3, 8),), [ops.Log]),
    Case("torch.sqrt", lambda s, x: torch.sqrt(x), (pos(3, 8),), [ops.Sqrt]),
    Case("Tensor.sqrt", lambda s, x: x.sqrt(), (pos(3, 8),), [ops.Sqrt]),
    Case("torch.rsqrt", lambda s, x: torch.rsqrt(x), (pos(3, 8),), [ops.Rsqrt]),
    Case("Tensor.rsqrt", lambda s, x: x.rsqrt(), (pos(3, 8),), [ops.Rsqrt]),
    Case("torch.square", lambda s, x: torch.square(x), (X,), [ops.Square]),
    Case("Tensor.square", lambda s, x: x.square(), (X,), [ops.Square]),
    Case("torch.clamp-positional", lambda s, x: torch.clamp(x, -0.5, 0.5), (X,), [ops.Clamp],
         check=bound(ops.Clamp, torch.clamp, (S0, -0.5, 0.5))),
    Case("Tensor.clamp-min", lambda s, x: x.clamp(min=0), (X,), [ops.Clamp]),
    Case("Tensor.clamp-tensor-bounds", lambda s, x, lo, hi: x.clamp(lo, hi + 1), ((3, 8), (3, 8), (3, 8)),
         [ops.Add, ops.Clamp]),
    Case("torch.clip", lambda s, x: torch.clip(x, max=0.1), (X,), [ops.Clamp]),
    Case("torch.maximum", lambda s, x, y: torch.maximum(x, y), X2, [ops.Maximum]),
    Case("Tensor.maximum", lambda s, x, y: x.maximum(y), X2, [ops.Maximum]),
    Case("torch.minimum", lambda s, x, y: torch.minimum(x, y), X2, [ops.Minimum]),
    Case("torch.max-binary", lambda s, x, y: torch.max(x, y), X2, [ops.Maximum]),
    Case("torch.min-binary", lambda s, x, y: torch.min(x, y), X2, [ops.Minimum]),
    Case("Tensor.max-binary", lambda s, x, y: x.max(y), X2, [ops.Maximum]),
    Case("broadcast-0d-tensor", lambda s, x, y: x * y, ((3, 8), lambda g: torch.randn((), generator=g)), [ops.Mul]),
]


@pytest.mark.parametrize("case", ids(ARITHMETIC))
def test_arithmetic(case: Case) -> None:
    run_case(case)


OTHER_ELEMENTWISE = [
    Case("compare", lambda s, x, y: (x > y).float() + (x <= 0.5).float(), X2, [ops.Compare, ops.Compare, ops.Add]),
    Case("torch.eq", lambda s, x, y: torch.eq(x, y), X2, [ops.Compare]),
    Case("logical", lambda s, x, y: ((x > 0) & ~(y > 0)) | (x < y), X2,
         [ops.Compare, ops.Compare, ops.Compare, ops.Logical, ops.Logical, ops.Logical]),
    Case("remainder", lambda s, x: x % 0.7, (X,), [ops.Remainder]),
    Case("torch.fmod", lambda s, x, y: torch.fmod(x, y), ((3, 8), pos(3, 8)), [ops.Remainder]),
    Case("reciprocal", lambda s, x: x.reciprocal(), (pos(3, 8),), [ops.Reciprocal]),
    Case("torch.erf", lambda s, x: torch.erf(x), (X,), [ops.Unary]),
    Case("torch.special.erf", lambda s, x: torch.special.erf(x), (X,), [ops.Unary]),
    Case("torch.special.expm1", lambda s, x: torch.special.expm1(x), (X,), [ops.Exp]),
    Case("torch.nn.functional.hardtanh-then-unknown-torch-op", lambda s, x: torch.special.i1(F.hardtanh(x)), (X,),
         [nn.Hardtanh, ops.Functional], check=bound(ops.Functional, torch.special.i1, (S0,))),
    Case("Tensor.floor", lambda s, x: x.floor(), (X,), [ops.Unary]),
    Case("torch.lerp", lambda s, x, y: torch.lerp(x, y, 0.3), X2, [ops.Unary]),
    Case("torch.prod", lambda s, x: torch.prod(x, 1), (X,), [ops.Reduce]),
    Case("Tensor.var", lambda s, x: x.var(dim=0, keepdim=True), (X,), [ops.Reduce]),
    Case("torch.logsumexp", lambda s, x: torch.logsumexp(x, -1), (X,), [ops.Reduce]),
    Case("Tensor.argmax", lambda s, x: x.argmax(-1), (X,), [ops.Reduce]),
    Case("torch.topk", lambda s, x: torch.topk(x, 2, dim=1).values, (X,), [ops.Reduce]),
    Case("F.normalize", lambda s, x: F.normalize(x, dim=-1), (X,), [ops.Norm]),
    Case("F.cosine_similarity", lambda s, x, y: F.cosine_similarity(x, y), X2, [ops.Functional]),
    Case("Tensor.sin", lambda s, x: x.sin(), (X,), [ops.Unary]),
    Case("torch.cos", lambda s, x: torch.cos(x), (X,), [ops.Unary]),
    Case("Tensor.erfc", lambda s, x: x.erfc(), (X,), [ops.Unary]),
]


@pytest.mark.parametrize("case", ids(OTHER_ELEMENTWISE))
def test_other_elementwise_and_reductions(case: Case) -> None:
    run_case(case)


# --- products, joins, reductions, selection -----------------------------------------------------
B = ((2, 3, 4), (2, 4, 5))
PRODUCTS_AND_REDUCTIONS = [
    Case("matmul-operator", lambda s, a, b: a @ b, B, [ops.MatMul], check=bound(ops.MatMul, operator.matmul, (S0, S1))),
    Case("torch.matmul", lambda s, a, b: torch.matmul(a, b), B, [ops.MatMul]),
    Case("Tensor.matmul", lambda s, a, b: a.matmul(b), B, [ops.MatMul]),
    Case("matmul-parameter", lambda s, a: a @ s.w, ((2, 3, 4),), [ops.MatMul],
         members=lambda: {"w": nn.Parameter(torch.randn(4, 6))}),
    Case("torch.mm", lambda s, a, b: torch.mm(a, b), ((3, 4), (4, 5)), [ops.MatMul]),
    Case("torch.bmm", lambda s, a, b: torch.bmm(a, b), B, [ops.Bmm]),
    Case("torch.baddbmm", lambda s, c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), ((2, 3, 5), *B), [ops.Baddbmm],
         check=bound(ops.Baddbmm, torch.baddbmm, (S0, S1, S2), {"beta": 0.5, "alpha": 2.0})),
    Case("torch.addmm", lambda s, c, a, b: torch.addmm(c, a, b, beta=2, alpha=0.25), ((5,), (3, 4), (4, 5)), [ops.Addmm],
         check=bound(ops.Addmm, torch.addmm, (S0, S1, S2), {"beta": 2, "alpha": 0.25})),
    Case("torch.einsum", lambda s, a, b: torch.einsum("bij,bjk->bik", a, b), B, [ops.Einsum]),
    Case("torch.einsum-list", lambda s, a, b: torch.einsum("bij,bjk->bki", [a, b]), B, [ops.Einsum]),
    Case("torch.cat-positional", lambda s, x, y: torch.cat([x, y], 1), X2, [ops.Concat],
         check=bound(ops.Concat, torch.cat, ([S0, S1], 1))),
    Case("torch.cat-keyword", lambda s, x, y: torch.cat((x, y), dim=0), X2, [ops.Concat],
         check=bound(ops.Concat, torch.cat, ((S0, S1),), {"dim": 0})),
    Case("torch.cat-same-twice", lambda s, x: torch.cat([x, x, x], dim=-1), (X,), [ops.Concat]),
    Case("torch.concat", lambda s, x, y: torch.concat([x, y], dim=-1), X2, [ops.Concat]),
    Case("torch.concatenate", lambda s, x, y: torch.concatenate([x, y], 1), X2, [ops.Concat]),
    Case("torch.concatenate-dim", lambda s, x, y: torch.concatenate([x, y], dim=0), X2, [ops.Concat]),
    Case("torch.stack", lambda s, x, y: torch.stack([x, y]), X2, [ops.Stack]),
    Case("torch.stack-dim", lambda s, x, y: torch.stack((x, y), dim=2), X2, [ops.Stack]),
    Case("Tensor.sum", lambda s, x: x.sum(), (X,), [ops.Sum]),
    Case("torch.sum-dim-keepdim", lambda s, x: torch.sum(x, dim=1, keepdim=True), (X,), [ops.Sum],
         check=bound(ops.Sum, torch.sum, (S0,), {"dim": 1, "keepdim": True})),
    Case("Tensor.mean-keepdim", lambda s, x: x.mean(-1, keepdim=True), (X,), [ops.Mean]),
    Case("torch.mean", lambda s, x: torch.mean(x, (0, 1)), (X,), [ops.Mean]),
    Case("torch.norm", lambda s, x: torch.norm(x, dim=1), (X,), [ops.Norm]),
    Case("Tensor.norm-keepdim", lambda s, x: x.norm(p=2, dim=-1, keepdim=True), (X,), [ops.Norm]),
    Case("torch.linalg.vector_norm", lambda s, x: torch.linalg.vector_norm(x, 3, dim=0), (X,), [ops.Norm]),
    Case("torch.cumsum", lambda s, x: torch.cumsum(x, dim=1), (X,), [ops.CumSum]),
    Case("Tensor.cumsum", lambda s, x: x.cumsum(0), (X,), [ops.CumSum]),
    Case("torch.amax-keepdim", lambda s, x: torch.amax(x, dim=1, keepdim=True), (X,), [ops.Amax],
         check=bound(ops.Amax, torch.amax, (S0,), {"dim": 1, "keepdim": True})),
    Case("Tensor.amax", lambda s, x: x.amax(0), (X,), [ops.Amax]),
    Case("torch.amin-keepdim", lambda s, x: torch.amin(x, 0, True), (X,), [ops.Amin]),
    Case("Tensor.amin-dims", lambda s, x: x.amin(dim=(0, 1)), (X,), [ops.Amin]),
    Case("torch.max-dim", lambda s, x: torch.max(x, dim=1).values, (X,), [ops.Amax]),
    Case("Tensor.max-all", lambda s, x: x.max(), (X,), [ops.Amax]),
    Case("Tensor.min-dim-keepdim", lambda s, x: x.min(1, keepdim=True)[0], (X,), [ops.Amin]),
    Case("torch.where", lambda s, c, a, b: torch.where(c, a, b), (mask(3, 8), (3, 8), (3, 8)), [ops.Where],
         check=bound(ops.Where, torch.where, (S0, S1, S2))),
    Case("torch.where-computed-cond", lambda s, a, b: torch.where(a > 0, a, b), X2, [ops.Compare, ops.Where]),
    Case("torch.where-scalar", lambda s, a: torch.where(a > 0, a, 0.0), (X,), [ops.Compare, ops.Where]),
    Case("Tensor.where", lambda s, x, c, y: x.where(c, y), ((3, 8), mask(3, 8), (3, 8)), [ops.Where],
         check=bound(ops.Where, "where", (S0, S1, S2))),
    Case("Tensor.masked_fill", lambda s, x, m: x.masked_fill(m, -1.5), ((3, 8), mask(3, 8)), [ops.MaskedFill],
         check=bound(ops.MaskedFill, "masked_fill", (S0, S1, -1.5))),
    Case("Tensor.masked_fill-computed-mask", lambda s, x: x.masked_fill(x < 0, float("-inf")).softmax(-1), (X,),
         [ops.Compare, ops.MaskedFill, nn.Softmax]),
    Case("torch.masked_fill", lambda s, x, m: torch.masked_fill(x, m, 2.0), ((3, 8), mask(3, 8)), [ops.MaskedFill]),
]


@pytest.mark.parametrize("case", ids(PRODUCTS_AND_REDUCTIONS))
def test_products_joins_reductions(case: Case) -> None:
    run_case(case)


def test_masked_fill_leaves_input_untouched() -> None:
    model = build(lambda s, x, m: x.masked_fill(m, 0.0) + x, 2)
    x, m = torch.randn(4, 5), torch.rand(4, 5) < 0.5
    gm = prepare(model, (x, m))
    fill = the_module(gm, model, ops.MaskedFill)
    assert isinstance(fill.fn, ops._MethodCall) and fill.fn.name == "masked_fill"
    assert not any(n.op == "call_method" and n.target == "masked_fill_" for n in gm.graph.nodes)
    assert not any(isinstance(m, ops.BoundOp) and m.fn_name.endswith("masked_fill_") for m in gm.modules())
    x_before = x.clone()
    out = gm(x, m)
    assert torch.equal(x, x_before)  # the input tensor object is unchanged after the call
    torch.testing.assert_close(out, torch.where(m, 0.0, x) + x_before)


# --- layers in functional form ------------------------------------------------------------------
def _shares(cls: type[nn.Module], **pairs: str) -> Callable[[fx.GraphModule, nn.Module], None]:
    """The one added ``cls`` layer holds the model's own tensors: ``layer.<k> is model.<v>``."""

    def check(gm: fx.GraphModule, model: nn.Module) -> None:
        layer = the_module(gm, model, cls)
        name = next(n for n, m in added_modules(gm, model).items() if m is layer)
        assert gm.get_submodule(name) is layer
        for attr, member in pairs.items():
            mine = getattr(layer, attr)
            if member == "None":
                assert mine is None
            else:
                assert mine is getattr(model, member), attr
        # the state_dict of the prepared module is the original's (the layer's tensors are aliases)
        assert gm.state_dict().keys() == model.state_dict().keys()

    return check


def _conv_args(cls: type[nn.Module], **expected: Any) -> Callable[[fx.GraphModule, nn.Module], None]:
    share = _shares(cls, weight="w", bias="b")
    at = attrs(cls, **expected)

    def check(gm: fx.GraphModule, model: nn.Module) -> None:
        share(gm, model)
        at(gm, model)

    return check


def _params(**shapes: tuple[int, ...]) -> Callable[[], dict[str, Any]]:
    return lambda: {k: nn.Parameter(torch.randn(*v) * 0.5) for k, v in shapes.items()}


LAYERS = [
    Case("F.linear", lambda s, x: F.linear(x, s.weight, s.bias), (X,), [nn.Linear],
         members=_params(weight=(5, 8), bias=(5,)), check=_shares(nn.Linear, weight="weight", bias="bias")),
    Case("F.linear-keywords", lambda s, x: F.linear(x, weight=s.weight, bias=s.bias), ((2, 3, 8),), [nn.Linear],
         members=_params(weight=(5, 8), bias=(5,)), check=_shares(nn.Linear, weight="weight", bias="bias")),
    Case("F.linear-no-bias", lambda s, x: F.linear(x, s.weight), (X,), [nn.Linear],
         members=_params(weight=(5, 8)), check=_shares(nn.Linear, weight="weight", bias="None")),
    Case("F.linear-computed-weight", lambda s, x: F.linear(x, s.weight.t(), s.bias), (X,), [ops.FunctionalLinear],
         members=_params(weight=(8, 5), bias=(5,))),
    Case("F.linear-buffer-weight", lambda s, x: F.linear(x, s.wbuf), (X,), [ops.FunctionalLinear],
         members=lambda: {"wbuf": torch.randn(5, 8)}),
    Case("F.conv1d", lambda s, x: F.conv1d(x, s.w, s.b, stride=2, padding=1), ((2, 3, 9),), [nn.Conv1d],
         members=_params(w=(4, 3, 3), b=(4,)), check=_conv_args(nn.Conv1d, stride=(2,), padding=(1,))),
    Case("F.conv2d-3x1", lambda s, x: F.conv2d(x, s.w), ((2, 3, 7, 6),), [nn.Conv2d],
         members=_params(w=(8, 3, 3, 1)), check=_shares(nn.Conv2d, weight="w")),
    Case("F.conv2d-args", lambda s, x: F.conv2d(x, s.w, s.b, 2, (2, 1), 2, 2), ((2, 4, 9, 8),), [nn.Conv2d],
         members=_params(w=(6, 2, 3, 2), b=(6,)),
         check=_conv_args(nn.Conv2d, stride=(2, 2), padding=(2, 1), dilation=(2, 2), groups=2, kernel_size=(3, 2))),
    Case("F.conv2d-keywords", lambda s, x: F.conv2d(x, s.w, bias=s.b, groups=3, padding="same", dilation=(1, 2)),
         ((2, 3, 6, 6),), [nn.Conv2d], members=_params(w=(6, 1, 3, 3), b=(6,)),
         check=_conv_args(nn.Conv2d, groups=3, padding="same", dilation=(1, 2))),
    Case("F.conv3d", lambda s, x: F.conv3d(x, s.w, s.b, padding=1, stride=(1, 2, 1)), ((1, 2, 4, 5, 4),), [nn.Conv3d],
         members=_params(w=(3, 2, 3, 3, 1), b=(3,)), check=_conv_args(nn.Conv3d, stride=(1, 2, 1))),
    Case("F.conv_transpose1d", lambda s, x: F.conv_transpose1d(x, s.w, s.b, stride=2, padding=1, output_padding=1),
         ((2, 4, 5),), [nn.ConvTranspose1d], members=_params(w=(4, 3, 3), b=(3,)),
         check=_conv_args(nn.ConvTranspose1d, output_padding=(1,), stride=(2,), in_channels=4, out_channels=3)),
    Case("F.conv_transpose2d", lambda s, x: F.conv_transpose2d(x, s.w, s.b, 2, 1, (1, 0), 2, 1),
         ((2, 4, 5, 4),), [nn.ConvTranspose2d], members=_params(w=(4, 3, 3, 2), b=(6,)),
         check=_conv_args(nn.ConvTranspose2d, output_padding=(1, 0), groups=2, in_channels=4, out_channels=6)),
    Case("F.conv_transpose2d-dilation-kw", lambda s, x: F.conv_transpose2d(x, s.w, dilation=2, stride=3, output_padding=2),
         ((1, 2, 4, 4),), [nn.ConvTranspose2d], members=_params(w=(2, 3, 2, 2)),
         check=attrs(nn.ConvTranspose2d, dilation=(2, 2), output_padding=(2, 2))),
    Case("F.conv2d-computed-weight", lambda s, x: F.conv2d(x, s.w * 2, bias=s.b * 2), ((2, 3, 6, 6),),
         [ops.Mul, ops.Mul, ops.FunctionalConv], members=_params(w=(4, 3, 3, 3), b=(4,))),
    Case("F.conv2d-input-weight", lambda s, x, w: F.conv2d(x, w, padding=1), ((2, 3, 6, 6), (4, 3, 3, 3)),
         [ops.FunctionalConv], check=bound(ops.FunctionalConv, F.conv2d, (S0, S1), {"padding": 1})),
    Case("F.layer_norm", lambda s, x: F.layer_norm(x, (8,), s.w, s.b, eps=1e-3), (X,), [nn.LayerNorm],
         members=_params(w=(8,), b=(8,)), check=_conv_args(nn.LayerNorm, eps=1e-3, normalized_shape=(8,))),
    Case("F.layer_norm-no-affine", lambda s, x: F.layer_norm(x, [3, 8]), ((2, 3, 8),), [nn.LayerNorm],
         check=attrs(nn.LayerNorm, elementwise_affine=False, normalized_shape=(3, 8))),
    Case("F.layer_norm-weight-only", lambda s, x: F.layer_norm(x, (8,), s.w), (X,), [nn.LayerNorm],
         members=_params(w=(8,)), check=_shares(nn.LayerNorm, weight="w", bias="None")),
    Case("F.layer_norm-traced-shape", lambda s, x: F.layer_norm(x, x.shape[-1:]), (X,), [ops.FunctionalNorm]),
    Case("F.group_norm", lambda s, x: F.group_norm(x, 2, s.w, s.b, 1e-4), ((2, 4, 3, 3),), [nn.GroupNorm],
         members=_params(w=(4,), b=(4,)), check=_conv_args(nn.GroupNorm, num_groups=2, eps=1e-4)),
    Case("F.group_norm-no-affine", lambda s, x: F.group_norm(x, 2), ((2, 4, 3, 3),), [ops.FunctionalNorm]),
    Case("F.batch_norm-eval", lambda s, x: F.batch_norm(x, s.rm, s.rv, s.w, s.b, s.training, 0.1, 1e-5),
         ((4, 3, 5),), [ops.FunctionalNorm],
         members=lambda: {"rm": torch.randn(3), "rv": torch.rand(3) + 0.5, "w": nn.Parameter(torch.randn(3)),
                          "b": nn.Parameter(torch.randn(3))}),
    Case("F.batch_norm-no-affine", lambda s, x: F.batch_norm(x, s.rm, s.rv, training=False), ((4, 3),),
         [ops.FunctionalNorm], members=lambda: {"rm": torch.randn(3), "rv": torch.rand(3) + 0.5}),
    Case("F.instance_norm", lambda s, x: F.instance_norm(x), ((2, 3, 5, 5),), [ops.FunctionalNorm]),
    Case("F.instance_norm-affine", lambda s, x: F.instance_norm(x, weight=s.w, bias=s.b, eps=1e-3), ((2, 3, 5),),
         [ops.FunctionalNorm], members=_params(w=(3,), b=(3,))),
    Case("F.embedding", lambda s, i: F.embedding(i, s.w), (ints(10, 3, 4),), [nn.Embedding],
         members=_params(w=(10, 6)), check=_shares(nn.Embedding, weight="w")),
    Case("F.embedding-padding_idx", lambda s, i: F.embedding(i, s.w, padding_idx=0), (ints(10, 3, 4),), [nn.Embedding],
         members=_params(w=(10, 6)), check=attrs(nn.Embedding, padding_idx=0, num_embeddings=10, embedding_dim=6)),
    Case("F.embedding-negative-padding_idx", lambda s, i: F.embedding(i, s.w, -1), (ints(10, 3, 4),), [nn.Embedding],
         members=_params(w=(10, 6)), check=attrs(nn.Embedding, padding_idx=9)),
    Case("F.embedding-computed-table", lambda s, i: F.embedding(i, s.w * 2), (ints(10, 3, 4),),
         [ops.Mul, ops.FunctionalEmbedding], members=_params(w=(10, 6))),
    Case("F.interpolate-scale", lambda s, x: F.interpolate(x, scale_factor=2), ((1, 2, 3, 4),), [ops.Interpolate],
         check=bound(ops.Interpolate, F.interpolate)),
    Case("F.interpolate-size-bilinear", lambda s, x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True),
         ((1, 2, 3, 4),), [ops.Interpolate]),
    Case("F.interpolate-traced-size", lambda s, x, y: F.interpolate(x, size=y.shape[-2:], mode="nearest") + y,
         ((1, 2, 3, 4), (1, 2, 6, 8)), [ops.Interpolate, ops.Add]),
    Case("F.pad", lambda s, x: F.pad(x, (1, 2)), ((2, 3, 4),), [ops.Pad], check=bound(ops.Pad, F.pad)),
    Case("F.pad-reflect", lambda s, x: F.pad(x, [1, 1, 2, 0], mode="reflect"), ((1, 2, 4, 4),), [ops.Pad]),
    Case("F.pad-value", lambda s, x: F.pad(x, (1, 1), "constant", 3.0), ((2, 3, 4),), [ops.Pad]),
    Case("F.max_pool2d", lambda s, x: F.max_pool2d(x, 2), ((1, 2, 6, 6),), [ops.Pool]),
    Case("F.max_pool2d-args", lambda s, x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), ((1, 2, 7, 7),),
         [ops.Pool]),
    Case("F.max_pool2d-indices", lambda s, x: F.max_pool2d(x, 2, return_indices=True), ((1, 2, 6, 6),), [ops.Pool]),
    Case("F.max_pool2d-indices-used", lambda s, x: F.max_pool2d(x, 2, return_indices=True)[1].float() + 1,
         ((1, 2, 6, 6),), [ops.Pool, ops.Add]),
    Case("F.max_pool1d", lambda s, x: F.max_pool1d(x, 2), ((2, 3, 8),), [ops.Pool]),
    Case("F.max_pool3d", lambda s, x: F.max_pool3d(x, 2), ((1, 1, 4, 4, 4),), [ops.Pool]),
    Case("F.avg_pool1d", lambda s, x: F.avg_pool1d(x, 3, 1, 1), ((2, 3, 8),), [ops.Pool]),
    Case("F.avg_pool2d", lambda s, x: F.avg_pool2d(x, 2, count_include_pad=False, padding=1), ((1, 2, 6, 6),), [ops.Pool]),
    Case("F.adaptive_avg_pool1d", lambda s, x: F.adaptive_avg_pool1d(x, 4), ((2, 3, 8),), [ops.Pool]),
    Case("F.adaptive_avg_pool2d", lambda s, x: F.adaptive_avg_pool2d(x, 1), ((1, 2, 6, 6),), [ops.Pool]),
    Case("F.adaptive_max_pool2d", lambda s, x: F.adaptive_max_pool2d(x, (2, 3)), ((1, 2, 6, 6),), [ops.Pool]),
    Case("F.adaptive_max_pool1d-indices", lambda s, x: F.adaptive_max_pool1d(x, 4, return_indices=True),
         ((2, 3, 8),), [ops.Pool]),
    Case("F.lp_pool2d", lambda s, x: F.lp_pool2d(x, 2, 2), ((1, 2, 6, 6),), [ops.Pool]),
]


@pytest.mark.parametrize("case", ids(LAYERS))
def test_layer(case: Case) -> None:
    run_case(case)


def test_linear_shares_parameter_objects() -> None:
    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 6))
            self.bias = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    model = Lin()
    gm = prepare(model, (torch.randn(2, 6),))
    (name,) = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert type(gm.get_submodule(name)) is nn.Linear
    assert gm.get_submodule(name).weight is model.weight
    assert gm.get_submodule(name).bias is model.bias
    # nothing was copied: a change to the user's weight shows in the prepared module
    with torch.no_grad():
        model.weight.add_(1.0)
    x = torch.randn(3, 6)
    torch.testing.assert_close(gm(x), model(x))
    assert all(p.device.type == "cpu" for p in gm.parameters())


def test_batch_norm_train_mode_updates_running_stats_like_the_original() -> None:
    def fn(s: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, s.rm, s.rv, s.w, s.b, training=s.training, momentum=0.2)

    members = {"rm": torch.zeros(3), "rv": torch.ones(3), "w": nn.Parameter(torch.rand(3)), "b": nn.Parameter(torch.rand(3))}
    model = build(fn, 1, members).train()
    twin = copy.deepcopy(model)
    gm = prepare(model, (torch.randn(4, 3),))
    assert torch.equal(model.rm, torch.zeros(3))  # verification did not update the user's buffers
    the_module(gm, model, ops.FunctionalNorm)
    x = torch.randn(4, 3)
    ref = twin(x.clone())
    out = gm(x.clone())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(model.rm, twin.rm)  # gm shares (and updates) the user's buffers
    torch.testing.assert_close(model.rv, twin.rv)


@pytest.mark.parametrize("case", ids(ACTIVATIONS[::3] + ARITHMETIC[::2] + PRODUCTS_AND_REDUCTIONS[::2] + LAYERS[::2]))
def test_without_example_inputs_static_kinds_give_the_same_modules(case: Case) -> None:
    """No example inputs: which nodes are tensors is inferred statically (fxprep.passes.values);
    the prepared graph must come out the same and still compute the same thing."""
    model = build(case.fn, len(case.inputs), case.members() if case.members else None).train(case.training)
    before = snapshot(model)
    gm = fxprep.prepare_model(model, tracer="fx")
    assert_untouched(model, before)
    assert gm.fxprep_report.verification.status == "skipped"
    assert remaining_compute_ops(gm) == []
    assert Counter(type(m) for m in added_modules(gm, model).values()) == Counter(case.expect)
    ref, out = run_both(model, gm, make_inputs(case.inputs, seed=2))
    assert_same_output(ref, out)


# --- dropout ------------------------------------------------------------------------------------
def test_dropout_following_self_training_becomes_nn_dropout_and_follows_mode() -> None:
    model = build(lambda s, x: F.dropout(x, 0.3, training=s.training) * 2, 1).eval()
    x = torch.randn(64, 64)
    gm = prepare(model, (x,))
    drop = the_module(gm, model, nn.Dropout)
    assert drop.p == 0.3 and not drop.training
    torch.testing.assert_close(gm(x), x * 2)  # eval: identity
    gm.train()
    assert drop.training
    torch.manual_seed(0)
    a = gm(x)
    torch.manual_seed(1)
    b = gm(x)
    assert not torch.equal(a, x * 2)  # randomised in train mode
    assert not torch.equal(a, b)
    assert ((a == 0) | torch.isclose(a, x * 2 / 0.7)).all()
    model.train()
    ref, got = run_both(model, gm, (x,), seed=3)
    torch.testing.assert_close(got, ref)  # same masks as the original in train mode
    gm.eval()
    torch.testing.assert_close(gm(x), x * 2)


def test_dropout_captured_in_train_mode_follows_eval() -> None:
    model = build(lambda s, x: F.dropout(x, p=0.5, training=s.training), 1).train()
    x = torch.randn(32, 32)
    gm = prepare(model, (x,))
    drop = the_module(gm, model, nn.Dropout)
    assert drop.training and drop.p == 0.5
    ref, got = run_both(model, gm, (x,), seed=5)
    torch.testing.assert_close(got, ref)
    gm.eval()
    torch.testing.assert_close(gm(x), x)


def test_dropout_with_literal_training_false_stays_fixed_in_train_mode() -> None:
    model = build(lambda s, x: F.dropout(x, 0.3, training=False) + 1, 1).train()
    x = torch.randn(32, 32)
    gm = prepare(model, (x,))
    assert not any(isinstance(m, nn.Dropout) for m in gm.modules())
    fixed = the_module(gm, model, ops.Dropout)
    assert fixed.fn is F.dropout
    gm.train()
    torch.testing.assert_close(gm(x), x + 1)  # never drops, whatever the mode
    gm.eval()
    torch.testing.assert_close(gm(x), x + 1)
    assert remaining_compute_ops(gm) == []


@pytest.mark.parametrize(
    "fn, cls, shape",
    [
        (lambda s, x: F.dropout1d(x, 0.5, s.training), nn.Dropout1d, (4, 6, 8)),
        (lambda s, x: F.dropout2d(x, 0.5, training=s.training), nn.Dropout2d, (2, 4, 3, 3)),
        (lambda s, x: F.dropout3d(x, 0.5, s.training, False), nn.Dropout3d, (2, 4, 3, 3, 2)),
        (lambda s, x: F.alpha_dropout(x, 0.5, s.training), nn.AlphaDropout, (4, 6, 8)),
        (lambda s, x: F.feature_alpha_dropout(x, 0.5, training=s.training), nn.FeatureAlphaDropout, (4, 6, 8)),
        (lambda s, x: F.rrelu(x, 0.1, 0.3, s.training), nn.RReLU, (4, 6, 8)),
    ],
    ids=["dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu"],
)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_mode_dependent_ops_follow_mode(fn: Callable[..., Any], cls: type[nn.Module], shape: tuple[int, ...],
                                       training: bool) -> None:
    model = build(fn, 1).train(training)
    x = torch.randn(*shape)
    gm = prepare(model, (x,))
    assert the_module(gm, model, cls).training is training
    ref, got = run_both(model, gm, (x,), seed=7)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize(
    "fn, training, expected",
    [
        (F.alpha_dropout, True, ops.Dropout),  # defaults to training=False: fixed, never drops
        (F.feature_alpha_dropout, True, ops.Dropout),
        (F.alpha_dropout, False, nn.AlphaDropout),  # the default equals the mode: follows it
        (F.dropout, True, nn.Dropout),  # F.dropout defaults to training=True
        (F.dropout, False, ops.Dropout),
    ],
)
def test_dropout_binds_each_functions_own_training_default(fn: Callable[..., Any], training: bool,
                                                             expected: type[nn.Module]) -> None:
    """The pass alone, on a graph whose call leaves ``training`` out (as Dynamo records calls)."""
    from fxprep.core.inputs import ExampleInputs
    from fxprep.passes import functional_to_module, values

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(fn, (x, 0.5)))
    gm = fx.GraphModule(nn.Module(), graph)
    example = torch.randn(6, 5, 4)
    values.annotate(gm, ExampleInputs((example,)))
    functional_to_module.run(gm, training=training)
    (mod,) = [m for m in gm.modules() if m is not gm]
    assert type(mod) is expected
    gm.train(training)
    torch.manual_seed(0)
    ref = fn(example, 0.5)
    torch.manual_seed(0)
    torch.testing.assert_close(gm(example), ref)
    assert remaining_compute_ops(gm) == []


@pytest.mark.parametrize("fn", [lambda s, x: F.alpha_dropout(x, 0.5), lambda s, x: F.feature_alpha_dropout(x, 0.5)],
                         ids=["alpha_dropout", "feature_alpha_dropout"])
def test_alpha_dropout_default_training_is_false(fn: Callable[..., Any]) -> None:
    """``F.alpha_dropout``'s ``training`` defaults to False (unlike ``F.dropout``): in a train-mode
    model it never drops, and the prepared module must not start dropping either."""
    model = build(fn, 1).train()
    x = torch.randn(4, 6, 8)
    gm = prepare(model, (x,))
    gm.train()
    torch.testing.assert_close(gm(x), x)
    assert not any(isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)) for m in gm.modules())


def test_rrelu_with_literal_training_stays_fixed() -> None:
    model = build(lambda s, x: F.rrelu(x, 0.1, 0.3), 1).train()  # training defaults to False
    x = torch.randn(8, 8)
    gm = prepare(model, (x,))
    assert not any(isinstance(m, nn.RReLU) for m in gm.modules())
    assert the_module(gm, model, ops.Activation).fn is F.rrelu
    gm.train()
    torch.testing.assert_close(gm(x), torch.where(x >= 0, x, x * (0.1 + 0.3) / 2))


def test_torchvision_stochastic_depth_follows_mode() -> None:
    import torchvision.ops as torchvision_ops

    # StochasticDepth is traced into (not a torch.nn leaf); its fx-wrapped stochastic_depth call comes back
    model = build(lambda s, x: s.sd(x) + x, 1, {"sd": torchvision_ops.StochasticDepth(0.5, "row")}).eval()
    x = torch.randn(16, 4)
    gm = prepare(model, (x,))
    depth = the_module(gm, model, torchvision_ops.StochasticDepth)
    assert depth is not model.sd
    assert depth.p == 0.5 and depth.mode == "row"
    torch.testing.assert_close(gm(x), 2 * x)
    gm.train()
    torch.manual_seed(0)
    out = gm(x)
    assert not torch.equal(out, 2 * x)
    model.train()
    ref, got = run_both(model, gm, (x,), seed=2)
    torch.testing.assert_close(got, ref)


# --- scaled dot-product attention ---------------------------------------------------------------
QKV = ((2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4))
SDPA = [
    Case("sdpa-plain", lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v), QKV, [ops.ScaledDotProductAttention],
         check=bound(ops.ScaledDotProductAttention, F.scaled_dot_product_attention, (S0, S1, S2), {})),
    Case("sdpa-causal", lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), QKV,
         [ops.ScaledDotProductAttention],
         check=bound(ops.ScaledDotProductAttention, F.scaled_dot_product_attention, (S0, S1, S2), {"is_causal": True})),
    Case("sdpa-scale", lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), QKV,
         [ops.ScaledDotProductAttention],
         check=bound(ops.ScaledDotProductAttention, F.scaled_dot_product_attention, (S0, S1, S2), {"scale": 0.3})),
    Case("sdpa-attn_mask-buffer", lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=s.m), QKV,
         [ops.ScaledDotProductAttention], members=lambda: {"m": torch.rand(5, 5) < 0.7}),
    Case("sdpa-float-mask-computed", lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=q[..., :1] * 0.1),
         QKV, [ops.Mul, ops.ScaledDotProductAttention]),
    Case("sdpa-dropout-if-training", lambda s, q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.3 if s.training else 0.0, is_causal=True), QKV, [ops.ScaledDotProductAttention],
         check=bound(ops.ScaledDotProductAttention, F.scaled_dot_product_attention, (S0, S1, S2),
                     {"dropout_p": 0.0, "is_causal": True})),
]


@pytest.mark.parametrize("case", ids(SDPA))
def test_sdpa(case: Case) -> None:
    run_case(case)


def test_sdpa_with_attn_mask_input() -> None:
    model = build(lambda s, q, k, m: F.scaled_dot_product_attention(q, k, k, attn_mask=m), 3)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    m = torch.rand(4, 6) < 0.8
    m[:, 0] = True
    gm = prepare(model, (q, k, m))
    mod = the_module(gm, model, ops.ScaledDotProductAttention)
    assert mod.args == (S0, S1, S2) and mod.kwargs == {"attn_mask": ops.Slot(3)}  # one slot per argument
    m2 = torch.rand(4, 6) < 0.3
    m2[:, -1] = True
    torch.testing.assert_close(gm(q, k, m2), model(q, k, m2))


def test_sdpa_literal_dropout_p_in_eval_is_passed_as_written() -> None:
    model = build(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), 3).eval()
    q, k, v = make_inputs(QKV, 0)
    gm = prepare(model, (q, k, v))
    mod = the_module(gm, model, ops.ScaledDotProductAttention)
    assert mod.kwargs == {"dropout_p": 0.5}
    ref, got = run_both(model, gm, (q, k, v), seed=11)
    torch.testing.assert_close(got, ref)
    ref2, _ = run_both(model, gm, (q, k, v), seed=12)
    assert not torch.equal(ref, ref2)  # the original really drops in eval: so must the prepared one


# --- argument binding, names, Python values -----------------------------------------------------
def test_wrapped_user_function_named_add_2_is_not_replaced() -> None:
    model = build(lambda s, x, y: add_2(x, y) + torch.add(x, y), 2)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = prepare(model, (x, y))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [add_2]
    assert Counter(type(m) for m in added_modules(gm, model).values()) == Counter([ops.Add, ops.Add])
    left = gm.fxprep_report.left
    assert len(left) == 1 and left[0].node == calls[0].name
    assert "add_2" in left[0].target and "torch.fx.wrap" in left[0].reason
    torch.testing.assert_close(gm(y, x), model(y, x))
    assert remaining_compute_ops(gm) == calls  # honest: the wrapped call is reported as remaining


def test_wrapped_function_from_a_package_named_like_torch_is_not_replaced() -> None:
    model = build(lambda s, x: _scaled(x) + 1, 1)
    x = torch.randn(3, 4)
    gm = prepare(model, (x,))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [_scaled]
    assert [entry.reason for entry in gm.fxprep_report.left] == ["function registered with torch.fx.wrap: kept as one call"]
    torch.testing.assert_close(gm(x * 3), model(x * 3))


def test_opaque_user_function_is_kept_and_reported() -> None:
    @fxprep.opaque
    def scale_by_max(x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().max()

    model = build(lambda s, x: scale_by_max(x) * 2, 1)
    x = torch.randn(3, 4)
    gm = prepare(model, (x,))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1
    left = gm.fxprep_report.left
    assert len(left) == 1 and "opaque" in left[0].reason
    torch.testing.assert_close(gm(x + 1), model(x + 1))


def test_reused_child_named_like_an_op_does_not_collide() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add = nn.ReLU()
            self.add_1 = nn.Identity()  # an unused attribute on a likely generated name

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            a = self.add(x)
            b = self.add(y)
            return torch.add(a, b) + torch.add(a, 1)

    model = Net()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = prepare(model, (x, y))
    assert gm.get_submodule("add") is model.add
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert len(names) == len(set(names)) == 5
    kinds = Counter(type(gm.get_submodule(n)) for n in names)
    assert kinds == Counter({nn.ReLU: 2, ops.Add: 3})
    assert "add_1" not in names  # never shadows the user's attribute
    assert remaining_compute_ops(gm) == []
    x2, y2 = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(gm(x2, y2), model(x2, y2))


class ShapeArith(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = 2
        y = x.reshape(b, c, h // p, p, w // p, p)  # Python int arithmetic on shapes
        y = y.permute(0, 2, 4, 3, 5, 1).reshape(b * (h // p) * (w // p), p * p * c)
        z = self.proj(y[:, :4])
        z = z.view(z.size()[:-1] + (3, 2))
        z = z.view(z.size(0), -1)
        n = z.shape[-1] - 1
        return z[:, :n] * (h + w)


@pytest.mark.parametrize("with_example", [True, False], ids=["example", "static"])
def test_python_shape_arithmetic_stays_python(with_example: bool) -> None:
    model = ShapeArith()
    x = torch.randn(2, 1, 4, 6)
    if with_example:
        gm = prepare(model, (x,))
    else:
        gm = fxprep.prepare_model(model, tracer="fx")
    added = Counter(type(m) for m in added_modules(gm, model).values())
    assert added == Counter([ops.Mul])  # the only tensor op besides the Linear: `z[:, :n] * (h + w)`
    assert not any(isinstance(m, (ops.FloorDiv, ops.Add, ops.Sub)) for m in gm.modules())
    mul = the_module(gm, model, ops.Mul)
    assert mul.num_inputs == 2  # the tensor and the Python int (h + w) come in as inputs
    int_ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in
               (operator.floordiv, operator.add, operator.mul, operator.sub)]
    assert len(int_ops) >= 6
    assert remaining_compute_ops(gm) == []
    assert gm.fxprep_report.left == []
    x2 = torch.randn(3, 1, 6, 8)
    torch.testing.assert_close(gm(x2), model(x2))


def test_straight_through_estimator_stays_one_call_with_its_backward() -> None:
    class Quant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return STE.apply(x * self.scale) / self.scale

    model = Quant()
    x = torch.randn(4, 5)
    gm = prepare(model, (x,), verify="grad")
    v = gm.fxprep_report.verification
    assert v.status == "passed" and v.grad
    ste = the_module(gm, model, ops.AutogradFunction)
    assert ste.fn.autograd_function is STE
    assert Counter(type(m) for m in added_modules(gm, model).values()) == Counter([ops.Mul, ops.AutogradFunction, ops.Div])
    assert remaining_compute_ops(gm) == []
    assert not any(n.target is torch.round for n in gm.graph.nodes)

    def grads(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        xi = torch.randn(4, 5, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        model.scale.grad = None
        (m(xi) * torch.arange(20.0).view(4, 5)).sum().backward()
        return xi.grad, model.scale.grad

    gx_ref, gs_ref = grads(model)
    gx, gs = grads(gm)
    assert gx.abs().sum() > 0  # round alone would give zero
    torch.testing.assert_close(gx, torch.arange(20.0).view(4, 5))
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gs, gs_ref)


# --- in place -----------------------------------------------------------------------------------
def _inplace_relu(gm: fx.GraphModule, model: nn.Module) -> None:
    assert the_module(gm, model, nn.ReLU).inplace is True


INPLACE = [
    Case("Tensor.relu_", lambda s, x: (x * 1).relu_(), (X,), [ops.Mul, nn.ReLU], check=_inplace_relu),
    Case("F.relu-inplace", lambda s, x: F.relu(x * 2, inplace=True), (X,), [ops.Mul, nn.ReLU], check=_inplace_relu),
    Case("torch.relu_", lambda s, x: torch.relu_(x + 0), (X,), [ops.Add, nn.ReLU], check=_inplace_relu),
    Case("F.leaky_relu-inplace-positional", lambda s, x: F.leaky_relu(x - 1, 0.1, True), (X,), [ops.Sub, nn.LeakyReLU],
         check=attrs(nn.LeakyReLU, inplace=True, negative_slope=0.1)),
    Case("Tensor.sigmoid_", lambda s, x: (x * 1).sigmoid_(), (X,), [ops.Mul, ops.Activation],
         check=bound(ops.Activation, "sigmoid_")),
    Case("Tensor.add_", lambda s, x, y: x.add_(y), X2, [ops.Add], check=bound(ops.Add, "add_", (S0, S1))),
    Case("Tensor.add_-then-reuse", lambda s, x, y: torch.cat([x.add_(y), x]), X2, [ops.Add, ops.Concat]),
    Case("iadd", lambda s, x, y: _iadd(x, y), X2, [ops.Add]),
    Case("iadd-scalar-chain", lambda s, x: _imul_iadd(x), (X,), [ops.Mul, ops.Add]),
    Case("Tensor.mul_", lambda s, x: (x + 1).mul_(2), (X,), [ops.Add, ops.Mul]),
    Case("Tensor.clamp_", lambda s, x: (x * 1).clamp_(min=0.0), (X,), [ops.Mul, ops.Clamp]),
    Case("Tensor.masked_fill_-written", lambda s, x, m: (x * 1).masked_fill_(m, 0.0), ((3, 8), mask(3, 8)),
         [ops.Mul, ops.MaskedFill], check=bound(ops.MaskedFill, "masked_fill_")),
    Case("relu_-on-clone-then-use-original", lambda s, x: _relu_clone(x), (X,), [nn.ReLU, ops.Add]),
]


def _iadd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x += y
    return x


def _imul_iadd(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y += 1
    return y


def _relu_clone(x: torch.Tensor) -> torch.Tensor:
    h = x.clone()
    h.relu_()
    return x + h


@pytest.mark.parametrize("case", ids(INPLACE))
def test_inplace(case: Case) -> None:
    run_case(case)


def _iadd_seen_through_a_view(s: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = x.view(-1)
    x += y  # in place in eager: z sees it
    return z * 1


def test_iadd_seen_through_an_earlier_view() -> None:
    run_case(Case("iadd-alias", _iadd_seen_through_a_view, X2, [ops.Add, ops.Mul]))


def test_inplace_add_mutates_the_callers_tensor_like_the_original() -> None:
    model = build(lambda s, x, y: x.add_(y) * 2, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = prepare(model, (x, y))
    a, b = x.clone(), x.clone()
    model(a, y)
    gm(b, y)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, x)


@pytest.mark.parametrize(
    "fn, n_modules",
    [
        (lambda s, x, y: (x.add_(y), x * 2)[1], 2),
        (lambda s, x, y: (x.relu_(), x - y)[1], 2),
        (lambda s, x, y: (F.relu(x, inplace=True), x + y)[1], 2),
        (lambda s, x, y: (x.masked_fill_(y > 0, 0.0), x * 1)[1], 3),
        (lambda s, x, y: (x.__iadd__(y), x / 2)[1], 2),
    ],
    ids=["add_", "relu_", "relu-inplace", "masked_fill_", "__iadd__"],
)
def test_inplace_call_with_unused_result_survives_dead_code_elimination(fn: Callable[..., Any], n_modules: int) -> None:
    model = build(fn, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = prepare(model, (x, y))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert len(added_modules(gm, model)) == n_modules
    torch.testing.assert_close(gm(x.clone(), y), model(x.clone(), y))


@pytest.mark.parametrize(
    "op, target, expected",
    [
        ("call_method", "add_", True),
        ("call_method", "__iadd__", True),
        ("call_method", "add", False),
        ("call_method", "__add__", False),
        ("call_method", "__invert__", False),
        ("call_function", operator.iadd, True),
        ("call_function", operator.and_, False),  # a trailing underscore that is not in place
        ("call_function", torch.relu_, True),
        ("call_function", torch.relu, False),
        ("call_function", add_2, False),
    ],
)
def test_mutates_input(op: str, target: Any, expected: bool) -> None:
    from fxprep.passes.functional_to_module import mutates_input

    graph = fx.Graph()
    x = graph.placeholder("x")
    assert mutates_input(graph.create_node(op, target, (x, x))) is expected
    assert mutates_input(graph.create_node("call_function", F.relu, (x,), {"inplace": True}))


def test_training_mode_of_added_modules_matches_capture_mode() -> None:
    model = build(lambda s, x: F.relu(x) + 1, 1).train()
    gm = prepare(model, (torch.randn(2, 3),))
    assert all(m.training for m in gm.modules())
    model_e = build(lambda s, x: F.relu(x) + 1, 1).eval()
    gm_e = prepare(model_e, (torch.randn(2, 3),))
    assert not any(m.training for m in gm_e.modules())


def test_deepcopy_and_report_of_prepared_module() -> None:
    def fn(s: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, s.w).softmax(-1) @ y
        return torch.cat([STE.apply(h), 1 - h], dim=1).masked_fill(h.repeat(1, 2) > 0.5, 0.0)

    model = build(fn, 2, {"w": nn.Parameter(torch.randn(4, 6))})
    x, y = torch.randn(3, 6), torch.randn(4, 4)
    gm = prepare(model, (x, y))
    added = added_modules(gm, model)
    report = gm.fxprep_report
    assert sorted(a.name for a in report.added) == sorted(added)
    assert all(a.reason for a in report.added)
    twin = copy.deepcopy(gm)
    assert "fn.linear" in added  # owner (the root), the function its forward called, the op (docs/concepts/names.md)
    assert twin.get_submodule("fn.linear").weight is not model.w
    torch.testing.assert_close(twin(x * 2, y), gm(x * 2, y))
    torch.testing.assert_close(gm(x * 2, y), model(x * 2, y))


# --- the same pass on a Dynamo capture ----------------------------------------------------------
def _by_id(*names: str) -> list[Case]:
    every = ACTIVATIONS + PRELU + ARITHMETIC + OTHER_ELEMENTWISE + PRODUCTS_AND_REDUCTIONS + LAYERS + SDPA + INPLACE
    found = [c for c in every if c.id in names]
    assert len(found) == len(names)
    return found


@pytest.mark.parametrize("case", ids(_by_id(
    "F.pad-reflect", "F.softmax-positional", "Tensor.softmax-keyword", "torch.add-alpha", "rsub-literal",
    "sdpa-causal", "F.linear", "F.conv2d-3x1", "F.embedding-padding_idx", "Tensor.masked_fill", "F.max_pool2d-indices",
    "torch.max-binary", "F.leaky_relu-keyword", "Tensor.add_",
)))
def test_dynamo_capture_gets_the_same_modules(case: Case) -> None:
    """Dynamo records other targets for the same op (``torch._C._nn.pad`` for ``F.pad``, no
    ``_stacklevel``): the pass must still produce the same modules."""
    model = build(case.fn, len(case.inputs), case.members() if case.members else None).train(case.training)
    gm = fxprep.prepare_model(model, example_inputs=make_inputs(case.inputs, 0), tracer="dynamo")
    assert gm.fxprep_report.tracer == "dynamo"
    assert remaining_compute_ops(gm) == []
    assert Counter(type(m) for m in added_modules(gm, model).values()) == Counter(case.expect)
    check_callables_round_trip(gm)
    ref, out = run_both(model, gm, make_inputs(case.inputs, seed=1))
    assert_same_output(ref, out)


class _QuantParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return STE.apply(x * self.scale) / self.scale


class _QuantConst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return STE.apply(x * 4) / 4


@pytest.mark.parametrize("cls", [
    _QuantParam,
    _QuantConst,  # inputs do not require grad: Dynamo would inline the forward alone
])
def test_dynamo_autograd_function_is_one_call_with_its_backward(cls: type[nn.Module]) -> None:
    model = cls()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(4, 5),), tracer="dynamo", verify="grad")
    assert gm.fxprep_report.verification.grad
    the_module(gm, model, ops.AutogradFunction)
    assert remaining_compute_ops(gm) == []
    x = torch.randn(4, 5, requires_grad=True)
    gm(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 5))
