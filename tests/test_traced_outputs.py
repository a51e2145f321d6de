"""torch._dynamo.export without its second run of the captured graph (fxprep.capture.dynamo.traced_outputs):
the outputs are the trace's own fake values, and the graph and its signature are what torch's own
re-run gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo import traced_outputs
from fxprep.capture.dynamo.export import dynamo_export
from fxprep.core.inputs import ExampleInputs


class _Shapes(nn.Module):
    """Outputs of every kind export matches: tensors, an input returned as it is, a size, None, a
    constant, nested in a dict and a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
        h = self.fc(x).relu()
        return {"h": h, "pair": (h * 2, x), "n": x.shape[0], "none": None, "k": 3, "mask": mask}


CALLS = [ExampleInputs((torch.randn(2, 4),), {}), ExampleInputs((torch.randn(3, 4),), {"mask": torch.ones(3, 4)})]


@pytest.mark.parametrize("call", CALLS, ids=["no mask", "mask"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic batch"])
def test_the_graph_and_its_signature_are_torchs(monkeypatch, call: ExampleInputs, dynamic: bool) -> None:
    model = _Shapes().eval()
    spec = None
    if dynamic:
        batch = torch.export.Dim("b", min=2)
        spec = {"x": {0: batch}, **({"mask": {0: batch}} if call.kwargs else {})}
    ours = dynamo_export(model, call, "dynamo", spec)
    monkeypatch.setattr(traced_outputs, "traced_outputs", lambda gm: None)  # torch's re-run of the graph
    theirs = dynamo_export(model, call, "dynamo", spec)
    assert ours.graph_module.code == theirs.graph_module.code
    other = ExampleInputs((torch.randn(5 if dynamic else call.args[0].shape[0], 4),),
                          {k: torch.ones(5 if dynamic else 3, 4) for k in call.kwargs})
    got, want, eager = ours.graph_module(*other.args, **other.kwargs), theirs.graph_module(*other.args, **other.kwargs), \
        model(*other.args, **other.kwargs)
    for out in (got, want):
        assert out.keys() == eager.keys() and out["n"] == eager["n"] and out["k"] == 3 and out["none"] is None
        torch.testing.assert_close(out["h"], eager["h"])
        torch.testing.assert_close(out["pair"][0], eager["pair"][0])
        assert out["pair"][1] is other.args[0]


def test_export_does_not_run_the_captured_graph_again(monkeypatch) -> None:
    calls: list[object] = []
    original = torch.func.functional_call

    def counted(module, *args, **kwargs):
        calls.append(module)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.func, "functional_call", counted)
    model = _Shapes().eval()
    gm = fxprep.prepare_model(model, example_inputs=CALLS[0], tracer="dynamo", progress=False)
    assert calls == [], f"torch._dynamo.export ran the captured graph {len(calls)} more time(s)"
    torch.testing.assert_close(gm(torch.ones(2, 4))["h"], model(torch.ones(2, 4))["h"])
    assert fxprep.get_report(gm).verification.status == "passed"


def test_a_graph_whose_output_lacks_its_trace_value_is_run_by_torch() -> None:
    gm = torch.fx.symbolic_trace(_Shapes())  # fx's nodes carry no fake values
    assert traced_outputs.traced_outputs(gm) is None
