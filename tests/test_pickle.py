"""Prepared modules survive pickle, copy.deepcopy and torch.save/torch.load(weights_only=False).

AIMET (and users) pickle and deep-copy models freely; torch.fx re-creates ``gm._tracer_cls()`` to
re-trace the generated code on unpickling, so whatever fxprep prepared must re-trace there.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torchvision
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithElementwiseAddOp, ModelWithFunctionalReLU, ModelWithReusedReLU


def _torch_round_trip(gm: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {
    "pickle": lambda gm: pickle.loads(pickle.dumps(gm)),
    "deepcopy": copy.deepcopy,
    "torch.save": _torch_round_trip,
}


class ShapeArithmetic(nn.Module):
    """Constructors sized from traced shapes and len(): what fxprep's tracer records as calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        pad = torch.zeros(x.size(0), 4)
        return self.fc(x) + pad + len(x)


def _check(gm: nn.Module, how: str, *inputs: torch.Tensor) -> None:
    again = ROUND_TRIPS[how](gm)
    with torch.no_grad():
        for a, b in zip(torch.utils._pytree.tree_leaves(gm(*inputs)), torch.utils._pytree.tree_leaves(again(*inputs))):
            assert torch.equal(a, b)
    assert list(again.state_dict()) == list(gm.state_dict())
    assert again.fxprep_report.verification.status == gm.fxprep_report.verification.status


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
@pytest.mark.parametrize("cls, n", [(ModelWithFunctionalReLU, 1), (ModelWithReusedReLU, 1), (ModelWithElementwiseAddOp, 2),
                                    (ShapeArithmetic, 1)])
def test_seed_models(cls, n, tracer, how):
    shape = (2, 4) if cls is ShapeArithmetic else (1, 3, 32, 32)
    inputs = tuple(torch.randn(*shape) for _ in range(n))
    gm = fxprep.prepare_model(cls().eval(), example_inputs=inputs, tracer=tracer)
    _check(gm, how, *inputs)


def test_fx_path_without_example_inputs_pickles():
    """The AIMET-style call (no inputs, fx only) is exactly what AIMET's own tests pickle."""
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval())
    _check(gm, "pickle", torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_resnet18(tracer):
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x, tracer=tracer)
    _check(gm, "torch.save", x)


def test_tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
    again = pickle.loads(pickle.dumps(gm))
    with torch.no_grad():
        assert torch.equal(gm(input_ids=ids).logits, again(input_ids=ids).logits)


def test_loaded_module_pickles(tmp_path):
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    loaded = fxprep.load(fxprep.save(fxprep.prepare_model(model, example_inputs=x), tmp_path / "saved"))
    _check(loaded, "pickle", x)


def test_torch_save_file_loads_in_a_fresh_process(tmp_path):
    """What a user does with torch.save: the file loads where only fxprep and torch are imported."""
    import subprocess
    import sys

    gm = fxprep.prepare_model(ShapeArithmetic().eval(), example_inputs=torch.randn(2, 4))
    path = tmp_path / "gm.pt"
    torch.save(gm, path)
    x = torch.randn(2, 4)
    torch.save(x, tmp_path / "x.pt")
    torch.save(gm(x), tmp_path / "y.pt")
    code = (f"import torch; gm = torch.load({str(path)!r}, weights_only=False); "
            f"x = torch.load({str(tmp_path / 'x.pt')!r}); y = torch.load({str(tmp_path / 'y.pt')!r}); "
            f"assert torch.equal(gm(x), y); print(type(gm).__mro__[1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "PreparedModule"


def test_op_modules_holding_closures_pickle():
    """F.max_pool2d is a closure made by torch's boolean_dispatch: pickle cannot reach it by reference."""
    import torch.nn.functional as F

    class Pooling(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 2) + F.avg_pool2d(x, 2)

    x = torch.randn(1, 2, 4, 4)
    gm = fxprep.prepare_model(Pooling().eval(), example_inputs=x)
    _check(gm, "pickle", x)
    _check(gm, "torch.save", x)


def test_a_graph_of_thousands_of_nodes_pickles():
    """fx nodes are a linked list: pickling them as objects recurses once per node."""
    model = nn.Sequential(*[nn.Linear(4, 4) if i % 2 else nn.ReLU() for i in range(1600)]).eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x, tracer="fx")
    assert len(gm.graph.nodes) > 1600
    _check(gm, "pickle", x)
