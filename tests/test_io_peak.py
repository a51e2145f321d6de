"""The self-check's forward budget (fxprep.io.peak): ``load`` runs each node of the loaded graph on fake
tensors before it runs it, and refuses a node that would take the tensors alive past
``LIMITS["forward_bytes"]``. The tamper fuzzer found the case: an input guard edited to a probe of
2**14 x 2**14 token ids (2 GiB, within the probe budget) made a small model's self-check allocate
8 GiB at its embedding and as much at each layer after it, and the test worker was killed for memory."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from fxprep.io import format as io_format
from fxprep.io import peak
from tests.test_io import Tied


def _edit_guard(directory, change) -> None:
    path = directory / io.MANIFEST
    manifest = json.loads(path.read_text())
    (param,) = manifest["input_guard"]["params"].values()
    change(param)
    path.write_text(json.dumps(manifest))


def _tied_save(tmp_path):
    torch.manual_seed(0)
    gm = fxprep.prepare_model(Tied().eval(), example_inputs=torch.randint(0, 10, (2, 5)), progress=False)
    return io.save(gm, tmp_path / "tied")


def _real_calls(monkeypatch, name: str) -> list[tuple[int, ...]]:
    """The input shapes ``torch.nn.functional.<name>`` was called with on real (not fake) tensors."""
    real, calls = getattr(F, name), []

    def recording(x, *args, **kwargs):
        if not isinstance(x, FakeTensor):
            calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(F, name, recording)
    return calls


def test_allocations_follow_what_ops_make_and_free():
    """Sizes worked out by hand: a 1024 x 1024 float32 tensor is 4 MiB; a view or an in-place op
    makes nothing; a result dropped before the next is made does not add to the peak."""
    mib4 = 1024 * 1024 * 4
    with FakeTensorMode():
        x = torch.empty(1024, 1024)
        counter = peak._Allocations()
        with counter:
            v = x.view(-1)
            x.add_(1)
            assert counter.peak == 0
            y = x + 1
            del y
            z = x * 2
            assert counter.live == mib4
            w = torch.cat([x, z])
            assert counter.live == 3 * mib4
            del z, w, v
    assert counter.peak == 3 * mib4 and counter.live == 0


def test_a_guard_edited_to_a_huge_probe_is_refused_before_the_layer_runs(tmp_path, monkeypatch):
    """The fuzzer's case, at its real size and the real budget: the guard's shape check dropped
    (kind "leaf") and the example made 2**14 x 2**14 ids. The probe (2 GiB) is within the probe budget;
    the embedding would make 8 GiB. It never runs on the real probe."""
    directory = _tied_save(tmp_path)

    def change(param):
        param["kind"] = "leaf"
        param["example"]["shape"] = [2**14, 2**14]

    _edit_guard(directory, change)
    calls = _real_calls(monkeypatch, "embedding")
    with pytest.raises(SerializationError, match=r"would need 8,589,934,592 bytes .*forward_bytes.*It did not run"):
        io.load(directory)
    assert calls == []


def test_the_budget_counts_what_is_alive_and_names_the_node(tmp_path, monkeypatch):
    """Small sizes, a small budget: 2**12 x 5 ids (160 KiB, held by the caller throughout) embed to
    640 KiB, which runs; the first projection's 640 KiB beside both passes 1 MiB and does not run on
    the real tensors."""
    directory = _tied_save(tmp_path)
    _edit_guard(directory, lambda param: param.update(kind="leaf", example={"shape": [2**12, 5], "dtype": "int64"}))
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 2**20)
    embedded, projected = _real_calls(monkeypatch, "embedding"), _real_calls(monkeypatch, "linear")
    with pytest.raises(SerializationError, match=r"node '\w+' would need 655,360 bytes with 819,200 already in use"):
        io.load(directory)
    assert embedded == [(2**12, 5)] and projected == []


class _NonzeroRows(nn.Module):
    """``nonzero``'s output size depends on the values: the fake run cannot follow it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > -100).float().sum(0)


def test_a_node_the_fake_run_cannot_follow_is_counted_after_it_ran(tmp_path, monkeypatch):
    x = torch.randn(64, 64)
    gm = fxprep.prepare_model(_NonzeroRows(), example_inputs=x, progress=False)
    directory = io.save(gm, tmp_path / "nonzero")
    assert io.load(directory) is not None  # within the default budget
    # every element is kept: 4096 rows of two int64 indices, 64 KiB, beside the 16 KiB input and its
    # 4 KiB boolean mask
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 48 * 1024)
    with pytest.raises(SerializationError, match=r"node 'nonzero' would need 65,536 bytes with 20,480 already in use"):
        io.load(directory)


def test_save_refuses_a_forward_past_the_budget_and_writes_nothing(tmp_path, monkeypatch):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval(), example_inputs=torch.randn(1, 3, 32, 32), progress=False)
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 2**16)
    with pytest.raises(SerializationError, match=r"cannot save to .*load would refuse it: save a module prepared "
                                                 r"with smaller example inputs"):
        io.save(gm, tmp_path / "seed")
    assert not (tmp_path / "seed").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_model_saves_and_loads_within_the_budget(tmp_path, dtype):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).to(dtype).eval()
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    gm = fxprep.prepare_model(model, example_inputs=x, progress=False)
    loaded = io.load(io.save(gm, tmp_path / "resnet"))
    with torch.no_grad():
        assert torch.equal(loaded(x), gm(x))


def test_the_fake_run_writes_nothing_into_the_module():
    """Train-mode BatchNorm counts its batches in a buffer (in place): run node by node with each node
    run on fake tensors first, it counts one batch, as eager does, and computes what eager computes."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x, progress=False)
    before = int(model.bn1.num_batches_tracked)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = peak.Bounded(gm, io_format.LIMITS["forward_bytes"]).run(x)
    assert int(model.bn1.num_batches_tracked) == before + 1
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(out, model(x))
