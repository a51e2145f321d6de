"""A Dynamo trace with symbolic sizes runs without the fake-tensor cache, a static one with it
(issue 60: a cache hit rebuilds its output over SymInts, dearer than the op's fake kernel; with
static sizes the cache pays). What each trace ran with is read from Dynamo's own config as the
trace starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo.export import default_route, dynamo_export, symbolic_sizes
from fxprep.core.inputs import ExampleInputs

from .helpers import dynamo_traces


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


def test_a_trace_with_declared_dimensions_runs_without_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    traces = dynamo_traces(monkeypatch)
    call = ExampleInputs((torch.randn(2, 8),), {})
    dim = torch.export.Dim.AUTO
    dynamo_export(_Mlp(), call, default_route(), {"x": {0: dim}})
    dynamo_export(_Mlp(), call, default_route(), {"x": None})  # a spec that declares nothing: static
    dynamo_export(_Mlp(), call, default_route(), None)
    with symbolic_sizes():  # inputs marked dynamic (the branch traces)
        dynamo_export(_Mlp(), call, default_route(), None)
    assert [t.cache for t in traces] == [False, True, True, False]
    assert torch._dynamo.config.fake_tensor_cache_enabled  # put back after each


def test_a_prepare_traces_with_the_cache_only_where_sizes_are_static(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Mlp().eval()
    traces = dynamo_traces(monkeypatch)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 8),), progress=False)
    # a plain module's positional input: the static capture, then the batch probe's trace with the
    # batch symbolic (its branches on the batch)
    assert [t.cache for t in traces] == [True, False], traces
    x = torch.randn(5, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    traces.clear()
    fxprep.prepare_model(model, example_inputs=(torch.randn(2, 8),), dynamic="batch", progress=False)
    assert traces and not any(t.cache for t in traces), traces  # the batch declared: every trace symbolic
