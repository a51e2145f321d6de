"""A Dynamo trace with symbolic sizes runs without the fake-tensor cache, a static one with it
(issue 60: a cache hit rebuilds its output over SymInts, dearer than the op's fake kernel; with
static sizes the cache pays). What each trace ran with is read from Dynamo's own config as the
trace starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo.export import default_route, dynamo_export, symbolic_sizes
from fxprep.core.inputs import ExampleInputs


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


def _cache_flags(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Dynamo's fake-tensor cache switch as each trace from now on starts (a spy that calls through)."""
    seen: list[bool] = []
    real = torch._dynamo.export

    def export(f: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(bool(torch._dynamo.config.fake_tensor_cache_enabled))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch._dynamo, "export", export)
    return seen


def test_a_trace_with_declared_dimensions_runs_without_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _cache_flags(monkeypatch)
    call = ExampleInputs((torch.randn(2, 8),), {})
    dim = torch.export.Dim.AUTO
    dynamo_export(_Mlp(), call, default_route(), {"x": {0: dim}})
    dynamo_export(_Mlp(), call, default_route(), {"x": None})  # a spec that declares nothing: static
    dynamo_export(_Mlp(), call, default_route(), None)
    with symbolic_sizes():  # inputs marked dynamic (the branch traces)
        dynamo_export(_Mlp(), call, default_route(), None)
    assert seen == [False, True, True, False]
    assert torch._dynamo.config.fake_tensor_cache_enabled  # put back after each


def test_a_prepare_traces_with_the_cache_only_where_sizes_are_static(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Mlp().eval()
    seen = _cache_flags(monkeypatch)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 8),), progress=False)
    # a plain module's positional input: the static capture, then the batch probe's trace with the
    # batch symbolic (its branches on the batch)
    assert seen == [True, False], seen
    x = torch.randn(5, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    seen.clear()
    fxprep.prepare_model(model, example_inputs=(torch.randn(2, 8),), dynamic="batch", progress=False)
    assert seen and not any(seen), seen  # the batch declared: every trace symbolic
