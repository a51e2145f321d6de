"""A GraphModule whose code is generated at first use (fxprep.core.lazy), and fx captures that
generate their code once."""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
from torch import nn

import fxprep
from fxprep.core.lazy import LazyGraphModule


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.fc(x).relu() * scale


def _lazy() -> tuple[_Net, LazyGraphModule]:
    net = _Net()
    return net, LazyGraphModule(net, fx.symbolic_trace(net).graph, "Net")


def test_made_without_code_then_generated_by_a_call() -> None:
    net, gm = _lazy()
    assert not gm.generated and "_code" not in gm.__dict__
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), net(x))
    assert gm.generated
    torch.testing.assert_close(gm(x, 3.0), net(x, 3.0))  # the second call through fx's own wrapper


def test_code_signature_and_str_generate_it() -> None:
    _, gm = _lazy()
    assert "relu" in gm.code and gm.generated
    _, gm = _lazy()
    assert list(inspect.signature(gm.forward).parameters) == ["x", "scale"]
    _, gm = _lazy()
    assert "relu" in str(gm)


def test_an_instance_forward_still_wins() -> None:
    _, gm = _lazy()
    gm.__dict__["forward"] = lambda x: x + 1
    assert gm(torch.zeros(1)).item() == 1.0 and not gm.generated


def test_a_graph_changed_before_the_first_call_runs_as_changed() -> None:
    net, gm = _lazy()
    relu = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "relu")
    relu.target = "sigmoid"
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), torch.sigmoid(net.fc(x)) * 2.0)


def test_an_fx_prepare_generates_its_graphs_code_once(monkeypatch) -> None:
    """fx's GraphModule generates code when it is made; the capture's module is rewritten by the
    passes and recompiled after them, so the capture's own generation (and a second one for the
    names of concrete arguments) were thrown away."""
    made: list[int] = []
    original = fx.Graph.python_code

    def counted(self: fx.Graph, *args, **kwargs):
        made.append(len(self.nodes))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counted)
    net = _Net().eval()
    gm = fxprep.prepare_model(net, concrete_args={"scale": 2.0}, example_inputs=(torch.randn(2, 4),), tracer="fx",
                              progress=False)
    assert len(made) == 1, made
    torch.testing.assert_close(gm(torch.ones(2, 4)), net(torch.ones(2, 4)))
