"""fxprep.load's self-check (fxprep.io.selfcheck): a re-signed save that loads must not fail on its
first call. Each edit below gave, before the self-check, a module that loaded without complaint and
raised inside torch when called (the tamper fuzzer found them: tests/test_tamper_fuzz.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from tests.test_io import _edit, _module, _node


@pytest.fixture
def saved(tmp_path):
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    return io.save(gm, tmp_path / "saved"), gm, x


def _edit_manifest(directory, change) -> None:
    path = directory / io.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_untouched_save_records_its_outputs_and_loads(saved):
    directory, gm, x = saved
    record = json.loads((directory / io.MANIFEST).read_text())["self_check"]
    with torch.no_grad():
        expected = gm(x)
    assert record["run"] == "outputs"
    assert record["outputs"] == {"shape": list(expected.shape), "dtype": "float32"}
    with torch.no_grad():
        assert torch.equal(io.load(directory)(x), expected)


def test_call_that_lost_its_argument_is_refused_naming_the_node(saved):
    directory, _, x = saved
    names = {}

    def change(data):
        node = _node(data, "conv1")
        names["conv1"] = node["name"]
        node["args"] = []

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match=rf"stopped at node '{names['conv1']}' with TypeError"):
        io.load(directory)


def test_call_given_an_extra_argument_is_refused(saved):
    directory, _, x = saved

    def change(data):
        node = _node(data, "fc1")
        node["args"] = node["args"] * 2

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="does not describe the module that was saved"):
        io.load(directory)


@pytest.mark.parametrize("field,value", [("stride", [1, 1, 1]), ("dilation", []), ("padding", None)])
def test_convolution_with_impossible_arguments_is_refused(saved, field, value):
    directory, _, x = saved

    def change(data):
        init = _module(data, "conv1")["init"]
        init[field] = {"$": "tuple", "v": value} if value is not None else None

    _edit(directory, io.MODULES, change)
    with pytest.raises(SerializationError):
        io.load(directory)


def test_changed_stride_changes_the_form_and_is_refused(saved):
    directory, _, x = saved
    _edit(directory, io.MODULES, lambda data: _module(data, "conv1")["init"].update(stride={"$": "tuple", "v": [2, 2]}))
    with pytest.raises(SerializationError, match="when it was saved, it returned"):
        io.load(directory)


def test_input_guard_that_rejects_its_own_example_is_refused(saved):
    directory, _, x = saved

    def change(manifest):
        manifest["input_guard"]["params"]["x"]["shape"] = [None, 3, 32]

    _edit_manifest(directory, change)
    with pytest.raises(SerializationError, match="stopped at node 'input guard' with InputMismatch"):
        io.load(directory)


@pytest.mark.parametrize("record", [None, {"run": "maybe"}, [], {"run": "outputs", "outputs": {"shape": [1, 11], "dtype": "float32"}},
                                    {"run": "none", "why": "no example inputs recorded"}])
def test_missing_or_edited_record_is_refused(saved, record):
    directory, _, _ = saved

    def change(manifest):
        if record is None:
            del manifest["self_check"]
        else:
            manifest["self_check"] = record

    _edit_manifest(directory, change)
    with pytest.raises(SerializationError, match="self_check|was saved"):
        io.load(directory)


def test_training_flag_must_be_a_bool(saved):
    directory, _, _ = saved
    _edit(directory, io.MODULES, lambda data: _module(data, "conv1").update(training={"$": "fn", "v": "torch.relu"}))
    with pytest.raises(SerializationError, match="training="):
        io.load(directory)


class DataDependent(nn.Module):
    """``nonzero``: an output size no fake run can know, so the self-check stops there, at save and
    at load alike, and the save still loads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.nonzero(y > 0), y


def test_module_that_cannot_run_on_fake_tensors_still_loads(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    gm = fxprep.prepare_model(DataDependent().eval(), example_inputs=x, tracer="fx")
    directory = io.save(gm, tmp_path / "s")
    record = json.loads((directory / io.MANIFEST).read_text())["self_check"]
    assert record["run"] == "stopped" and record["error"] != "TypeError"
    loaded = io.load(directory)
    with torch.no_grad():
        for a, b in zip(loaded(x), gm(x)):
            assert torch.equal(a, b)


def test_module_saved_without_example_inputs_loads(tmp_path):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval())
    directory = io.save(gm, tmp_path / "s")
    assert json.loads((directory / io.MANIFEST).read_text())["self_check"]["run"] == "none"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(io.load(directory)(x), gm(x))


def test_self_check_leaves_a_train_mode_module_as_saved(tmp_path):
    """BatchNorm in train mode updates its statistics on every run: the fake runs at save and load
    must not (nor rebind any buffer to a fake tensor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    gm = fxprep.prepare_model(model, example_inputs=x)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    directory = io.save(gm, tmp_path / "s")
    loaded = io.load(directory)
    for module in (gm, loaded):
        state = module.state_dict()
        assert state.keys() == before.keys()
        for k, v in before.items():
            assert type(state[k]) is torch.Tensor and torch.equal(state[k], v), k
