"""Randomly composed models for the property and fuzz tests (tests/test_property.py, test_fuzz.py).

A model is an ``nn.Module`` whose ``forward`` interprets a static *program*: a tuple of :class:`Op`
records stored on the module. The program is plain Python data, so ``torch.fx`` unrolls the
interpreter loop while tracing and sees only the tensor operations. :func:`programs` draws one
(hypothesis), :class:`ProgramNet` runs it, :class:`Snapshot` and :func:`assert_same_outputs` check
what the tests demand of a prepared one. The in-place rule the generator keeps is described in
tests/test_property.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

SIZE = 4  # spatial size; nn.Linear / F.linear act on the last dimension, so every value keeps it
BATCH = 2  # train-mode BatchNorm needs more than one value per channel
CHANNELS = (1, 2, 3, 4)

# Attribute names are drawn from the names fxprep gives the modules it creates, so collisions
# between the user's attributes and generated names are exercised on purpose.
NAME_POOL = ("add", "mul", "cat", "relu", "relu_1", "linear", "conv2d", "tanh", "sigmoid", "gelu",
             "softmax", "weight", "scale", "block", "layer")

UNARY = ("conv", "linear", "bn", "relu_mod", "dropout", "f_relu", "sigmoid", "tanh", "gelu", "softmax",
         "scalar", "relu_", "param_mul", "flinear", "buffer_add", "reuse", "block",
         # views, shape arithmetic, constructors, fixed-mode ops: things that must stay (or not stay) functional
         "transpose", "pad", "scale_by_size", "zeros_add", "rsub", "se", "f_dropout", "f_dropout_fixed",
         "masked_fill", "chunk_swap", "len_mul", "reshape")
BINARY = ("add", "mul", "add_alpha", "cat", "iadd", "where", "matmul")
MODULE_KINDS = ("conv", "linear", "bn", "relu_mod", "dropout", "block")


@dataclass(frozen=True)
class Op:
    """One step of a program: ``kind`` applied to ``srcs`` (indices into the value list)."""

    kind: str
    srcs: tuple[int, ...]
    name: str = ""  # attribute holding this op's module / Parameter / buffer (or the reused module)
    arg: Any = None  # conv: (out_channels, kernel, bias); linear/flinear: bias; relu_mod: inplace;
    # buffer_add: persistent; block: the nested Program


@dataclass(frozen=True)
class Program:
    ops: tuple[Op, ...]
    in_channels: int
    out_channels: int
    output: tuple[str, int] = ("tensor", -1)  # (form, index of the auxiliary output)
    aliases_input: bool = False  # the result may be the input tensor itself (an eval-mode Dropout)


@dataclass
class _Scope:
    """Generation state of one program level: channels and liveness of each value, and the modules
    defined so far (name -> (kind, input channels or None for any, output channels or None for same,
    in place, may return its input))."""

    channels: list[int]
    alive: list[bool]
    groups: list[int]  # values in one group may share memory (views; Dropout in eval returns its input)
    names: set[str] = field(default_factory=set)
    modules: dict[str, tuple[str, int | None, int | None, bool, bool]] = field(default_factory=dict)
    protected: bool = False  # group 0 (the block's input) belongs to the caller: no in-place op on it


def _fresh_name(draw: Callable[..., Any], scope: _Scope) -> str:
    base = draw(st.sampled_from(NAME_POOL))
    name, i = base, 0
    while name in scope.names:
        i += 1
        name = f"{base}_{i}"
    scope.names.add(name)
    return name


@st.composite
def programs(draw: Callable[..., Any], in_channels: int | None = None, depth: int = 0) -> Program:
    """A random program; ``depth`` > 0 is a nested block (no further nesting, one tensor output)."""
    c0 = in_channels if in_channels is not None else draw(st.sampled_from(CHANNELS))
    scope = _Scope(channels=[c0], alive=[True], groups=[0], protected=depth > 0)
    kinds = UNARY + BINARY if depth == 0 else tuple(k for k in UNARY + BINARY if k != "block")
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 8 if depth == 0 else 4))):
        live = [v for v, a in enumerate(scope.alive) if a]
        kind = draw(st.sampled_from(kinds))
        i = draw(st.sampled_from(live))
        c = scope.channels[i]
        out_c, inplace, alias, arg, name = c, False, False, None, ""
        srcs: tuple[int, ...] = (i,)
        if kind == "reuse":
            usable = [n for n, m in scope.modules.items() if m[1] is None or m[1] == c]
            if usable:
                name = draw(st.sampled_from(usable))
                _, _, mod_out, inplace, alias = scope.modules[name]
                out_c = c if mod_out is None else mod_out
            else:
                kind = "f_relu"
        if kind in BINARY:
            partners = [v for v in live if kind == "cat" or scope.channels[v] == c]
            if kind == "iadd":  # eager refuses ``a += b`` when b is a different view of a's memory
                partners = [v for v in partners if v == i or scope.groups[v] != scope.groups[i]]
            j = draw(st.sampled_from(partners))
            srcs = (i, j)
            out_c = c + scope.channels[j] if kind == "cat" else c
            inplace = alias = kind == "iadd"
        elif kind in MODULE_KINDS + ("param_mul", "flinear", "buffer_add"):
            name = _fresh_name(draw, scope)
            if kind == "conv":
                arg = (draw(st.sampled_from(CHANNELS)), draw(st.sampled_from((1, 3))), draw(st.booleans()))
                out_c = arg[0]
            elif kind in ("linear", "flinear", "buffer_add"):
                arg = draw(st.booleans())  # bias / bias / persistent
            elif kind == "relu_mod":
                arg = inplace = alias = draw(st.booleans())
            elif kind == "dropout":
                alias = True  # nn.Dropout in eval mode returns its input object
            elif kind == "block":
                arg = draw(programs(in_channels=c, depth=depth + 1))
                out_c, alias = arg.out_channels, arg.aliases_input
            if kind in MODULE_KINDS:
                scope.modules[name] = (kind, c if kind in ("conv", "bn", "block") else None,
                                       out_c if kind in ("conv", "block") else None, inplace, alias)
        elif kind == "relu_":
            inplace = alias = True
        elif kind in ("transpose", "reshape", "f_dropout"):
            alias = True  # views, and F.dropout(training=False) returns its input object
        if inplace and scope.protected and scope.groups[i] == 0:
            # Would mutate the caller's tensor (a block's input): use the out-of-place twin.
            inplace = alias = False
            if kind == "relu_mod":
                arg = False
                scope.modules[name] = ("relu_mod", None, None, False, False)
            elif kind == "iadd":
                kind = "add"
            else:  # relu_ or a reused in-place ReLU
                kind, name, srcs, out_c = "f_relu", "", (i,), c
        if inplace:  # consumed: neither the mutated tensor nor anything aliasing it is read again
            for v, g in enumerate(scope.groups):
                if g == scope.groups[i]:
                    scope.alive[v] = False
        ops.append(Op(kind, srcs, name, arg))
        scope.channels.append(out_c)
        scope.alive.append(True)
        scope.groups.append(scope.groups[i] if alias else len(scope.groups))
    form = "tensor" if depth else draw(st.sampled_from(("tensor", "tuple", "dict", "nested", "list", "with_size")))
    aux = draw(st.sampled_from([v for v, a in enumerate(scope.alive) if a]))
    return Program(tuple(ops), c0, scope.channels[-1], (form, aux), aliases_input=scope.groups[-1] == 0)


class ProgramNet(nn.Module):
    """Runs a :class:`Program`; its modules, Parameters and buffers are attributes named in the ops."""

    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        channels = [program.in_channels]
        for op in program.ops:
            c = channels[op.srcs[0]]
            out_c = c
            if op.kind == "conv":
                out_c, k, bias = op.arg
                self.add_module(op.name, nn.Conv2d(c, out_c, k, padding=k // 2, bias=bias))
            elif op.kind == "linear":
                self.add_module(op.name, nn.Linear(SIZE, SIZE, bias=op.arg))
            elif op.kind == "bn":
                self.add_module(op.name, nn.BatchNorm2d(c))
            elif op.kind == "relu_mod":
                self.add_module(op.name, nn.ReLU(inplace=op.arg))
            elif op.kind == "dropout":
                self.add_module(op.name, nn.Dropout(0.3))
            elif op.kind == "block":
                self.add_module(op.name, ProgramNet(op.arg))
                out_c = op.arg.out_channels
            elif op.kind == "param_mul":
                self.register_parameter(op.name, nn.Parameter(torch.randn(c, 1, 1)))
            elif op.kind == "flinear":
                self.register_parameter(op.name, nn.Parameter(torch.randn(SIZE, SIZE) / 2))
                if op.arg:
                    self.register_parameter(op.name + "_bias", nn.Parameter(torch.randn(SIZE)))
            elif op.kind == "buffer_add":
                self.register_buffer(op.name, torch.randn(c, 1, 1), persistent=op.arg)
            elif op.kind == "reuse":
                reused = getattr(self, op.name)
                if isinstance(reused, nn.Conv2d):
                    out_c = reused.out_channels
                elif isinstance(reused, ProgramNet):
                    out_c = reused.program.out_channels
            elif op.kind == "cat":
                out_c = c + channels[op.srcs[1]]
            channels.append(out_c)
        assert channels[-1] == program.out_channels, (channels, program)

    def forward(self, x: torch.Tensor) -> Any:
        values = [x]
        for op in self.program.ops:
            a = values[op.srcs[0]]
            b = values[op.srcs[1]] if len(op.srcs) > 1 else None
            values.append(self._run(op, a, b))
        form, aux = self.program.output
        if form == "tuple":
            return values[-1], values[aux]
        if form == "dict":
            return {"out": values[-1], "aux": values[aux]}
        if form == "nested":
            return {"out": values[-1], "pair": (values[aux], values[-1])}
        if form == "list":
            return [values[aux], values[-1]]
        if form == "with_size":
            return values[-1], values[-1].shape[1]
        return values[-1]

    def _run(self, op: Op, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        k = op.kind
        if k in ("conv", "linear", "bn", "relu_mod", "dropout", "block", "reuse"):
            return getattr(self, op.name)(a)
        if k == "f_relu":
            return F.relu(a)
        if k == "sigmoid":
            return torch.sigmoid(a)
        if k == "tanh":
            return a.tanh()
        if k == "gelu":
            return F.gelu(a, approximate="tanh")
        if k == "softmax":
            return a.softmax(dim=-1)
        if k == "scalar":
            return a * 0.5 + 1.0
        if k == "relu_":
            return a.relu_()
        if k == "param_mul":
            return a * getattr(self, op.name)
        if k == "flinear":
            return F.linear(a, getattr(self, op.name), getattr(self, op.name + "_bias") if op.arg else None)
        if k == "buffer_add":
            return a + getattr(self, op.name)
        if k == "transpose":
            return a.transpose(-1, -2)
        if k == "pad":
            return F.pad(a[..., 1:], (0, 1), value=0.5)
        if k == "scale_by_size":
            return a / a.size(-1) ** 0.5  # Python arithmetic on a size: never a module
        if k == "zeros_add":
            return a + torch.zeros(a.shape[0], 1, 1, 1)  # a constructor sized from a traced shape
        if k == "rsub":
            return 1.0 - a
        if k == "se":
            return a * a.mean((2, 3), keepdim=True).sigmoid()
        if k == "f_dropout":
            return F.dropout(a, 0.25, self.training)  # follows .train()/.eval()
        if k == "f_dropout_fixed":
            return F.dropout(a, 0.25, True)  # always drops, whatever the mode
        if k == "masked_fill":
            return a.masked_fill(a < 0, 0.1)
        if k == "chunk_swap":
            lo, hi = a.chunk(2, dim=-1)  # unpacking a traced chunk
            return torch.cat([hi, lo], dim=-1)
        if k == "len_mul":
            return a * len(a)
        if k == "reshape":
            return a.reshape(a.shape[0], -1).reshape(a.shape)
        assert b is not None
        if k == "add":
            return a + b
        if k == "mul":
            return torch.mul(a, b)
        if k == "add_alpha":
            return torch.add(a, b, alpha=0.5)
        if k == "cat":
            return torch.cat([a, b], dim=1)
        if k == "iadd":
            a += b
            return a
        if k == "where":
            return torch.where(a > b, a, b * 0.5)
        if k == "matmul":
            return a @ b / SIZE
        raise AssertionError(k)


def _double_output(module: nn.Module, args: Any, output: Any) -> Any:
    return output * 2


def _halve_input(module: nn.Module, args: Any) -> Any:
    return (args[0] * 0.5,)


def _hook_ids(m: nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(d) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                    m._state_dict_hooks, m._load_state_dict_pre_hooks))


@dataclass
class Snapshot:
    """What prepare_model promises not to touch on the user's model."""

    state: dict[str, torch.Tensor]
    tensor_ids: list[tuple[str, int]]
    tree: list[tuple[str, int, type, bool, tuple[tuple[int, ...], ...], list[tuple[str, int]]]]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            state={k: v.detach().clone() for k, v in model.state_dict().items()},
            tensor_ids=[(k, id(v)) for k, v in model.state_dict(keep_vars=True).items()],
            tree=[(n, id(m), type(m), m.training, _hook_ids(m), sorted((k, id(v)) for k, v in vars(m).items()))
                  for n, m in model.named_modules(remove_duplicate=False)],
        )

    def assert_unchanged(self, model: nn.Module) -> None:
        now = Snapshot.of(model)
        assert now.tree == self.tree, "module tree, training flags, hooks or attributes of the original changed"
        assert now.tensor_ids == self.tensor_ids, "parameter/buffer objects or state_dict keys of the original changed"
        changed = [k for k in self.state if not torch.equal(now.state[k], self.state[k])]
        assert not changed, f"values of the original changed: {changed}"


def _flat(value: Any, path: str = "out") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _flat(v, f"{path}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [x for i, v in enumerate(value) for x in _flat(v, f"{path}[{i}]")]
    return [(path, value)]


def assert_same_outputs(model: nn.Module, gm: fx.GraphModule, x: torch.Tensor) -> None:
    """Our own comparison (not fxprep's verifier): same structure, same values, same RNG draws."""
    x_ref, x_got = x.clone(), x.clone()
    torch.manual_seed(1)
    with torch.no_grad():
        ref = model(x_ref)
    torch.manual_seed(1)
    with torch.no_grad():
        got = gm(x_got)
    torch.testing.assert_close(x_got, x_ref, msg=lambda m: f"the input was mutated differently: {m}")
    assert type(got) is type(ref)
    ref_flat, got_flat = _flat(ref), _flat(got)
    assert [p for p, _ in ref_flat] == [p for p, _ in got_flat]
    for (path, r), (_, g) in zip(ref_flat, got_flat):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, p=path: f"{p}: {m}")


def build(program: Program, seed: int) -> tuple[ProgramNet, torch.Tensor]:
    torch.manual_seed(seed)
    model = ProgramNet(program)
    return model, torch.randn(BATCH, program.in_channels, SIZE, SIZE)
