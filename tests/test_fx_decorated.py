"""torch.fx through a decorated ``forward``, functions it is told to call whole found where the
``forward``'s own code looks them up, and a dataclass attribute handed to such a function read from
the model rather than rebuilt.

transformers wraps every model's ``forward`` in decorators taking ``(*args, **kwargs)``; plain fx
fails on them ("co_varnames is too small"). The llm-compressor pipeline traces the code around the
decoder layers with fx (:mod:`fxprep.compat.llmcompressor.subgraphs`), its mask builders called
whole: these are the tracer's pieces it rests on, each tested here on small models of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

import fxprep
from fxprep.capture.fx import through_wrapper
from fxprep.errors import TraceFailure

from .helpers_models import llama_inputs, tiny_llama


def doubles_output(fn: Any) -> Any:
    """A decorator that does something (doubles the result), its wrapper naming no parameter."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) * 2

    return wrapped


class Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @doubles_output
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, scale: float = 3.0) -> torch.Tensor:
        y = self.fc(x) * scale
        return y if bias is None else y + bias


def test_fx_traces_a_forward_behind_a_wrapper_and_keeps_what_the_wrapper_does() -> None:
    model = Doubled().eval()
    x, bias = torch.randn(2, 4), torch.randn(4)
    with pytest.raises(ValueError, match="co_varnames"):  # plain fx: the wrapper's code has no names
        fx.symbolic_trace(model)
    gm = fxprep.prepare_model(model, example_inputs={"x": x, "bias": bias}, tracer="fx", fallback="error", progress=False)
    assert fxprep.get_report(gm).tracer == "fx"
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"][:2] == ["x", "bias"]
    assert torch.equal(gm(x, bias), model(x, bias=bias))  # the wrapper's doubling is in the graph
    assert torch.equal(gm(x, bias), (model.fc(x) * 3.0 + bias) * 2)


def test_the_made_signature_is_the_wrapped_functions() -> None:
    import inspect

    made = through_wrapper(Doubled.forward)
    assert made is not Doubled.forward
    def described(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert described(made) == described(inspect.unwrap(Doubled.forward))

    def plain(self: Any, x: Any) -> Any:
        return x

    assert through_wrapper(plain) is plain  # nothing wrapped: unchanged
    named = functools.wraps(plain)(lambda self, x: x)  # a wrapper naming the same parameters
    assert through_wrapper(named) is named


def gate(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    """Data-dependent: fx cannot trace it, but can call it whole."""
    if x.sum() > 0:
        return x * cfg.factor
    return x - cfg.factor


@dataclasses.dataclass
class Settings:
    factor: float = 2.0


def record(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    assert isinstance(cfg, Settings)
    return x * cfg.factor


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.settings = Settings()

    @deprecate_kwarg("y", "99.0.0", new_name="x")  # transformers' own: its wrapper's globals are another module's
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return record(gate(self.fc(x), self.settings), self.settings)


def test_functions_to_call_whole_are_found_where_a_decorated_forward_looks_them_up() -> None:
    model = Gated().eval()
    x = torch.randn(2, 4)
    with pytest.raises(TraceFailure):  # without: fx traces into gate and stops at its `if`
        fxprep.prepare_model(model, example_inputs=(x,), tracer="fx", fallback="error", progress=False)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="fx", fallback="error", progress=False,
                              autowrap_functions=(gate, record))
    called = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert gate in called and record in called
    for sign in (1.0, -1.0):  # both sides of gate's `if`: it runs whole at each call
        y = sign * torch.ones(2, 4) * 10
        assert torch.equal(gm(y), model(y))


def test_a_dataclass_attribute_handed_to_a_function_is_the_models_own_object() -> None:
    model = Gated().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="fx", fallback="error", progress=False,
                              autowrap_functions=(gate, record))
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "settings"]
    assert reads and not any(n.target is Settings for n in gm.graph.nodes)  # read, not rebuilt from its fields
    assert gm.get_submodule("").settings is model.settings  # the model's own object, not a copy
    assert torch.equal(gm(x), model(x))


def test_fx_gets_past_a_transformers_decorated_forward() -> None:
    """A tiny Llama under fx alone: past its decorators (this failed with "co_varnames is too small"),
    then either captured and verified, or stopped somewhere other than the decorator."""
    model = tiny_llama()
    try:
        gm = fxprep.prepare_model(model, example_inputs=llama_inputs(), tracer="fx", fallback="error", progress=False)
    except TraceFailure as err:
        assert "co_varnames" not in str(err) and "decorator taking" not in str(err)
    else:
        assert fxprep.get_report(gm).verification.status == "passed"


class Recasts(nn.Module):
    """Overwrites a tensor attribute in its forward, as CTRL does (``self.pos_encoding =
    self.pos_encoding.to(device)``): while tracing, the attribute holds the trace's Proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(16, 4)  # a plain tensor attribute, neither parameter nor buffer
        self.fc = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.table = self.table.to(self.fc.weight.dtype)
        return self.fc(self.table[ids])


def test_an_attribute_the_forward_overwrites_is_read_from_the_model_not_the_trace() -> None:
    model = Recasts().eval()
    table = model.table
    ids = torch.tensor([[1, 5, 7]])
    gm = fxprep.prepare_model(model, example_inputs=(ids,), tracer="fx", fallback="error", progress=False)
    assert model.table is table  # restored on the model
    other = torch.tensor([[0, 2]])
    assert torch.equal(gm(other), model(other))
