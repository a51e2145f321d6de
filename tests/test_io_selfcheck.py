"""fxprep.load's self-check (fxprep.io.selfcheck): a re-signed save that loads must compute what the
saved module computed. Each edit below gave, before the self-check, a module that loaded without
complaint and then raised inside torch when called, or returned other values (the tamper fuzzer
found them: tests/test_tamper_fuzz.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from tests.helpers_io import _edit, _module, _node


def _edit_manifest(directory, change) -> None:
    path = directory / io.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_untouched_save_records_its_outputs_and_loads(seed_save):
    directory, gm, x = seed_save
    record = json.loads((directory / io.MANIFEST).read_text())["self_check"]
    with torch.no_grad():
        expected = gm(x)
    assert record["run"] == "outputs" and record["device"] == "cpu"
    assert {k: v for k, v in record["outputs"].items() if k != "sums"} == {"shape": list(expected.shape), "dtype": "float32"}
    assert len(record["outputs"]["sums"]) == 3
    with torch.no_grad():
        assert torch.equal(io.load(directory)(x), expected)


def test_call_that_lost_its_argument_is_refused_naming_the_node(seed_save):
    directory, _, x = seed_save
    names = {}

    def change(data):
        node = _node(data, "conv1")
        names["conv1"] = node["name"]
        node["args"] = []

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match=rf"stopped at node '{names['conv1']}' with TypeError"):
        io.load(directory)


def test_call_given_an_extra_argument_is_refused(seed_save):
    directory, _, x = seed_save

    def change(data):
        node = _node(data, "fc1")
        node["args"] = node["args"] * 2

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="does not describe the module that was saved"):
        io.load(directory)


@pytest.mark.parametrize("field,value", [("stride", [1, 1, 1]), ("dilation", []), ("padding", None)])
def test_convolution_with_impossible_arguments_is_refused(seed_save, field, value):
    directory, _, x = seed_save

    def change(data):
        init = _module(data, "conv1")["init"]
        init[field] = {"$": "tuple", "v": value} if value is not None else None

    _edit(directory, io.MODULES, change)
    with pytest.raises(SerializationError):
        io.load(directory)


def test_changed_stride_changes_the_form_and_is_refused(seed_save):
    directory, _, x = seed_save
    _edit(directory, io.MODULES, lambda data: _module(data, "conv1")["init"].update(stride={"$": "tuple", "v": [2, 2]}))
    with pytest.raises(SerializationError, match="when it was saved, it returned"):
        io.load(directory)


def test_input_guard_that_rejects_its_own_example_is_refused(seed_save):
    directory, _, x = seed_save

    def change(manifest):
        manifest["input_guard"]["params"]["x"]["shape"] = [None, 3, 32]

    _edit_manifest(directory, change)
    with pytest.raises(SerializationError, match="stopped at node 'input guard' with InputMismatch"):
        io.load(directory)


@pytest.mark.parametrize("record", [None, {"run": "maybe"}, [], {"run": "outputs", "outputs": {"shape": [1, 11], "dtype": "float32"}},
                                    {"run": "none", "why": "no example inputs recorded"}])
def test_missing_or_edited_record_is_refused(seed_save, record):
    directory, _, _ = seed_save

    def change(manifest):
        if record is None:
            del manifest["self_check"]
        else:
            manifest["self_check"] = record

    _edit_manifest(directory, change)
    with pytest.raises(SerializationError, match="self_check|was saved"):
        io.load(directory)


def test_training_flag_must_be_a_bool(seed_save):
    directory, _, _ = seed_save
    _edit(directory, io.MODULES, lambda data: _module(data, "conv1").update(training={"$": "fn", "v": "torch.relu"}))
    with pytest.raises(SerializationError, match="training="):
        io.load(directory)


def test_swapped_weights_of_one_shape_are_refused(tmp_path):
    """Two tensors of the same shape and dtype swapped in the weights header (the form is unchanged:
    only the values show it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    directory = io.save(fxprep.prepare_model(model, example_inputs=torch.randn(2, 8)), tmp_path / "s")
    path = directory / io.WEIGHTS
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    by_form: dict = {}
    for key, entry in header.items():
        if key != "__metadata__":
            by_form.setdefault((entry["dtype"], tuple(entry["shape"])), []).append(key)
    a, b = next(keys for keys in by_form.values() if len(keys) >= 2)[:2]
    header[a], header[b] = header[b], header[a]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    _edit_manifest(directory, lambda m: m["sha256"].update({io.WEIGHTS: io.format.sha256(path)}))
    with pytest.raises(SerializationError, match="values differ"):
        io.load(directory)


class DataDependent(nn.Module):
    """``nonzero``: an output size only a run on real values knows; the probe runs it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.nonzero(y > 0), y


def test_data_dependent_module_is_checked_by_its_values(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    gm = fxprep.prepare_model(DataDependent().eval(), example_inputs=x, tracer="fx")
    directory = io.save(gm, tmp_path / "s")
    record = json.loads((directory / io.MANIFEST).read_text())["self_check"]
    assert record["run"] == "outputs" and record["outputs"]["tuple"][0]["dtype"] == "int64"
    loaded = io.load(directory)
    with torch.no_grad():
        for a, b in zip(loaded(x), gm(x)):
            assert torch.equal(a, b)
    _edit(directory, io.MODULES, lambda data: _module(data, "fc").update(training=True))  # harmless: no dropout
    io.load(directory)


class OneRowEmbedding(nn.Module):
    """Runs on its example (ids 0) and fails on the probe (ids 1): the failure is the record."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_module_that_fails_on_the_probe_records_where_and_still_loads(tmp_path):
    ids = torch.zeros(2, 3, dtype=torch.long)
    gm = fxprep.prepare_model(OneRowEmbedding().eval(), example_inputs=ids)
    directory = io.save(gm, tmp_path / "s")
    record = json.loads((directory / io.MANIFEST).read_text())["self_check"]
    emb = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "emb")
    assert (record["run"], record["node"], record["error"]) == ("stopped", emb, "IndexError")
    with torch.no_grad():
        assert torch.equal(io.load(directory)(ids), gm(ids))
    # the same save whose embedding lost its input stops there with another error: refused
    _edit(directory, io.GRAPH, lambda data: _node(data, "emb").update(args=[]))
    with pytest.raises(SerializationError, match="does not describe"):
        io.load(directory)


def test_module_saved_without_example_inputs_loads(tmp_path):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval())
    directory = io.save(gm, tmp_path / "s")
    assert json.loads((directory / io.MANIFEST).read_text())["self_check"]["run"] == "none"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(io.load(directory)(x), gm(x))


def test_self_check_leaves_a_train_mode_module_as_saved(tmp_path):
    """BatchNorm in train mode updates its statistics on every run: the probe runs at save and load
    must not."""
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


@pytest.mark.parametrize("device", [None, "", "gpu0", 3, ["cpu"]])
def test_record_naming_no_device_is_refused(seed_save, device):
    """The tamper fuzzer's find: with the record's device edited, the values went uncompared, and a
    second edit (an argument duplicated in the graph) loaded and computed other outputs."""
    directory, _, _ = seed_save
    _edit_manifest(directory, lambda m: m["self_check"].update(device=device))
    with pytest.raises(SerializationError, match="self_check"):
        io.load(directory)


def test_a_save_said_to_be_from_another_device_is_still_compared_by_value(tmp_path):
    """Claiming the save was made on a GPU loosens the tolerance; it does not switch the check off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    directory = io.save(fxprep.prepare_model(model, example_inputs=torch.randn(2, 8)), tmp_path / "s")
    _edit_manifest(directory, lambda m: m["self_check"].update(device="cuda"))
    io.load(directory)  # an honest save from another device loads

    def scale(manifest):
        sums = manifest["self_check"]["outputs"]["sums"]
        sums[0] = sums[0] + 0.5 * sums[1]  # values half the outputs' magnitude away

    _edit_manifest(directory, scale)
    with pytest.raises(SerializationError, match="values differ"):
        io.load(directory)
