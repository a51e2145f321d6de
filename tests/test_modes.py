"""Mode sharing, as the README states it, and ``copy=True`` for an independent prepared module."""

from __future__ import annotations

import torch
from torch import nn

import fxprep


class Scale(nn.Module):
    """A module of the user's own: traced into unless excluded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.skip = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.skip(x.mean((2, 3))))


def _model() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def test_shared_by_default_as_the_readme_says():
    """gm.train() flips the user's child modules but not the user's root; a train-mode run of gm
    updates the user's BatchNorm statistics (the documented price of sharing)."""
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    gm = fxprep.prepare_model(model, example_inputs=x)
    gm.train()
    assert model.bn.training and model.conv.training and not model.training
    before = model.bn.running_mean.clone()
    gm(x)
    assert not torch.equal(model.bn.running_mean, before)


def test_copy_gives_an_independent_module():
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fxprep.prepare_model(model, example_inputs=x, copy=True)
    assert gm.fxprep_report.verification.status == "passed"
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)

    ours = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not ours & {t.untyped_storage().data_ptr() for t in gm.state_dict().values()}
    assert not {id(m) for m in model.modules()} & {id(m) for m in gm.modules()}

    gm.train()
    gm(x)  # updates the copy's BatchNorm statistics only
    with torch.no_grad():
        gm.get_submodule("conv").weight.add_(1.0)
    assert not any(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_copy_keeps_excluded_modules_excluded():
    """modules_to_exclude name the user's objects; with copy=True their copies stay leaves."""
    model = _model()
    gm = fxprep.prepare_model(model, [model.skip], example_inputs=torch.randn(2, 3, 8, 8), copy=True)
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "skip" in called and gm.get_submodule("skip") is not model.skip


def test_copy_of_an_uncopyable_model_is_a_clear_error():
    model = _model()
    model.lock = __import__("threading").Lock()  # deepcopy cannot take a lock
    try:
        fxprep.prepare_model(model, example_inputs=torch.randn(2, 3, 8, 8), copy=True)
    except fxprep.InvalidInput as err:
        assert "cannot be deep-copied" in str(err)
    else:
        raise AssertionError("no error")
