"""A capture leaves the example's tensors' Dynamo marks as it found them (``capture.dynamo.marks``).

``torch._dynamo.export`` with a ``dynamic_shapes`` spec clears the inputs' marks and sets its own on
the tensor objects; left there, the next capture of the same example traced those dimensions
symbolically although it declared none (the static fallback chain after a shape-general first try).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

from fxprep.capture.dynamo.export import default_route, dynamo_export
from fxprep.core.inputs import ExampleInputs


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu() * x.shape[0]


# torch 2.8 too (make test-oldest): where torch keeps the marks is its own, and has moved before
pytestmark = pytest.mark.smoke


def _marks(t: torch.Tensor) -> dict[str, object]:
    return {k: v for k, v in vars(t).items() if k.startswith("_dynamo")}


def _symbolic_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """The placeholders whose traced value has a symbolic size."""
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            out.append(node.name)
    return out


def test_a_dynamic_capture_leaves_no_mark_on_the_inputs() -> None:
    x = torch.randn(3, 4)
    call = ExampleInputs((), {"x": x})
    dynamo_export(Scaled().eval(), call, default_route(), {"x": {0: Dim.AUTO}})
    assert _marks(x) == {}


def test_a_static_capture_after_a_dynamic_one_is_static() -> None:
    x = torch.randn(3, 4)
    call = ExampleInputs((), {"x": x})
    model = Scaled().eval()
    gm, _ = dynamo_export(model, call, default_route(), {"x": {0: Dim.AUTO}})
    assert _symbolic_inputs(gm), "the dynamic capture itself traced a symbolic batch"
    static, _ = dynamo_export(model, call, default_route(), None)
    assert _symbolic_inputs(static) == []
    assert torch.equal(static(x), model(x))


def test_the_users_own_marks_stay() -> None:
    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    before = {k: set(v) for k, v in _marks(x).items()}
    dynamo_export(Scaled().eval(), ExampleInputs((), {"x": x}), default_route(), {"x": {0: Dim.AUTO, 1: None}})
    assert {k: set(v) for k, v in _marks(x).items()} == before
