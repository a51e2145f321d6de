"""fxprep.load's trust model: names resolve to allow-listed *objects*, never by walking attributes;
a save may set data, never behaviour; the files' size, depth and tensors are checked.

Each exploit here is a save whose manifest checksums were recomputed (checksums prove integrity,
not authorship). On the loader before issue 10 each of them ran code, at load or at the first call,
or crashed with a raw exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithElementwiseAddOp
from fxprep.errors import SerializationError
from tests.helpers_io import _edit, _module, _node


@pytest.fixture
def saved(seed_save):
    return seed_save  # tests/conftest.py


def _resign(directory: Path, name: str) -> None:
    manifest = json.loads((directory / io.MANIFEST).read_text())
    manifest["sha256"][name] = io.format.sha256(directory / name)
    (directory / io.MANIFEST).write_text(json.dumps(manifest))


def _load_and_run(directory: Path, x: torch.Tensor, **kwargs):
    loaded = io.load(directory, **kwargs)
    return loaded(x)


# --- names that walk out of an allow-listed prefix -------------------------------------------------
@pytest.mark.parametrize("fn", [
    "torch.nn.functional.torch.builtins.eval", "torch.fft.torch.os.system", "torch.special.torch.hub.load",
    "torch.nn.functional.torch.builtins.exec", "torch.linalg.torch.os.system", "torch.torch.os.system",
    "torch.ops.aten.__class__", "torch.ops.os.system", "torchvision.ops.torch.os.system", "math.__loader__",
])
def test_names_reaching_out_of_a_namespace_are_refused(saved, tmp_path, fn):
    directory, _, x = saved
    marker = tmp_path / "pwned"

    def change(data):
        node = _node(data, "conv1")
        node.update(op="call_function", target={"fn": fn}, args=[f"touch {marker}"], kwargs={})

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="refusing to load"):
        _load_and_run(directory, x)
    assert not marker.exists()


def test_prefix_tricks_are_refused_even_for_trusted_packages(saved, tmp_path):
    """Trusting a package trusts what it *defines*: a name reaching torch.hub through it is refused."""
    directory, _, x = saved
    _edit(directory, io.GRAPH, lambda data: _node(data, "conv1").update(
        op="call_function", target={"fn": "torchvision.models.detection.ssd.torch.hub.load"}, args=["x"], kwargs={}))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory, trusted_modules=["torchvision"])


def test_fake_quantize_class_behind_a_torch_nn_prefix_never_runs_its_observer(saved, tmp_path):
    """The issue's load-time exploit: a class name that *starts* with torch.nn. but walks to
    FakeQuantize, whose constructor calls ``observer`` = torch.hub.load on a planted hubconf.py."""
    directory, _, _ = saved
    marker = tmp_path / "hubconf_ran"
    (directory / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef m(): pass\n")
    _edit(directory, io.MODULES, lambda data: _module(data, "relu").update(
        kind="init", patch={}, **{"class": "torch.nn.modules.module.torch.ao.quantization.fake_quantize.FakeQuantize"},
        init={"observer": {"$": "fn", "v": "torch.nn.functional.torch.hub.load"}, "repo_or_dir": str(directory),
              "model": "m", "source": "local", "trust_repo": True}))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)
    assert not marker.exists()


@pytest.mark.parametrize("cls", [
    "torch.ao.quantization.fake_quantize.FakeQuantize", "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.modules.module.torch.nn.modules.conv.Conv2d", "torch.fx.graph_module.GraphModule",
])
def test_classes_outside_the_allow_list_are_refused(saved, cls):
    directory, _, _ = saved
    _edit(directory, io.MODULES, lambda data: _module(data, "relu").update(kind="state", attrs={}, **{"class": cls}))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)


# --- a save sets data, never behaviour ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["forward", "extra_repr", "_conv_forward", "__call__", "__class__", "register_buffer",
                                  "_call_impl", "state_dict"])
def test_attributes_cannot_replace_methods(saved, name):
    directory, _, _ = saved
    _edit(directory, io.MODULES, lambda data: _module(data, "conv1").update(
        patch={"": {name: {"$": "fn", "v": "torch.nn.functional.relu"}}}))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)


def test_state_attribute_forward_is_refused(saved):
    directory, _, _ = saved
    _edit(directory, io.MODULES, lambda data: _module(data, "relu").update(
        kind="state", attrs={"forward": {"$": "fn", "v": "torch.sigmoid"}}))
    with pytest.raises(SerializationError, match="'forward'"):
        io.load(directory)


def test_bound_op_fn_swap_still_goes_through_the_allow_list(tmp_path):
    model = ModelWithElementwiseAddOp().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(1, 3, 8, 8),) * 2)
    directory = io.save(gm, tmp_path / "s")
    _edit(directory, io.MODULES, lambda data: _module(data, "add").update(fn="torch.nn.functional.torch.builtins.eval"))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)


@pytest.mark.parametrize("slot_name", ["forward", "__dict__", "training", "_parameters", "register_buffer"])
def test_tensor_slot_named_like_a_method_is_refused(saved, slot_name):
    directory, _, _ = saved

    def change(data):
        slot = next(s for s in data["tensors"] if s["module"] == "conv1" and s["name"] == "bias")
        slot["name"] = slot_name

    _edit(directory, io.MODULES, change)
    with pytest.raises(SerializationError):
        io.load(directory)


def test_getattr_cannot_fetch_a_method_to_call(saved, tmp_path):
    """``max([path], key=getattr(x.numpy(), "tofile"))`` writes a file through names that are all
    allow-listed one by one; fetching a method with getattr is refused."""
    directory, _, x = saved
    marker = tmp_path / "written"

    def change(data):
        nodes = data["nodes"]
        first = nodes[0]["name"]
        at = next(i for i, n in enumerate(nodes) if n["target"] == "conv1")
        nodes[at:at] = [
            {"name": "as_numpy", "op": "call_method", "target": "numpy", "args": [{"$": "node", "v": first}], "kwargs": {}},
            {"name": "writer", "op": "call_function", "target": {"fn": "builtins.getattr"},
             "args": [{"$": "node", "v": "as_numpy"}, "tofile"], "kwargs": {}},
            {"name": "written", "op": "call_function", "target": {"fn": "builtins.max"},
             "args": [[str(marker)]], "kwargs": {"key": {"$": "node", "v": "writer"}}},
        ]

    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="method"):
        _load_and_run(directory, x)
    assert not marker.exists()


@pytest.mark.parametrize("method", ["tofile", "dump", "from_file", "format", "save"])
def test_call_method_only_calls_tensor_methods(saved, method):
    directory, _, _ = saved
    _edit(directory, io.GRAPH, lambda data: _node(data, "conv1").update(op="call_method", target=method))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)


def test_module_names_cannot_inject_code_into_the_generated_forward(saved, tmp_path):
    """fx writes a non-identifier child name as ``getattr(self, "<name>")`` into the code it
    executes: a name with a quote in it would be code."""
    directory, _, x = saved
    marker = tmp_path / "injected"
    assert "." not in str(marker)  # a dot would split the name into a path
    evil = f'relu"), getattr(getattr(__import__("pathlib"), "Path")({str(marker)!r}), "touch")(), getattr(self, "conv1'

    def tree(data):  # the same Conv2d, also registered under the crafted name
        data["modules"].append({"path": evil, "kind": "same_as", "of": "conv1", "training": False})

    _edit(directory, io.MODULES, tree)
    _edit(directory, io.GRAPH, lambda data: _node(data, "conv1").update(target=evil))
    with pytest.raises(SerializationError):
        _load_and_run(directory, x)
    assert not marker.exists()


def test_allow_list_holds_objects_and_refuses_file_and_global_state_functions():
    policy = io.TrustPolicy()
    assert policy.function("torch.nn.functional.gelu") is torch.nn.functional.gelu
    assert policy.function("torch.add") is torch.add
    assert policy.function("torch.ops.aten._assert_scalar.default") is torch.ops.aten._assert_scalar.default
    for name in ["torch.nn.functional.relu", "torch.ops.aten.add.Tensor"]:  # no prepared graph names them (issue 63)
        with pytest.raises(SerializationError, match="not on fxprep's default list"):
            policy.function(name)
    for name in ["torch.load", "torch.save", "torch.compile", "torch.manual_seed", "torch.set_default_dtype",
                 "torch.from_file", "torch.set_num_threads", "torch.hub.load", "torch.ops.aten.from_file.default",
                 "torch.ops.aten.save", "operator.attrgetter", "operator.methodcaller", "operator.itemgetter",
                 "operator.call", "builtins.eval", "builtins.open", "builtins.__import__", "torch.cond",
                 "torch.nn.functional.handle_torch_function", "torch.random.manual_seed", "torch.vmap"]:
        with pytest.raises(SerializationError, match="refusing to load"):
            policy.function(name)


def test_trusted_modules_resolve_by_identity(tmp_path):
    """A trusted package's object is found under its own canonical name only."""
    policy = io.TrustPolicy(("tests",))
    from tests.helpers_io import Opaque

    assert policy.module_class("tests.helpers_io.Opaque") is Opaque
    for name in ["tests.helpers_io.torch.nn.Linear", "tests.helpers_io.nn.Linear", "tests.helpers_io.Opaque.__init__",
                 "tests.helpers_io.pickle.loads", "tests.helpers_io.json.loads"]:
        with pytest.raises(SerializationError):
            policy.module_class(name)
        with pytest.raises(SerializationError):
            policy.function(name)
    with pytest.raises(fxprep.InvalidInput):
        io.load(tmp_path, trusted_modules="torchvision")


# --- resource limits ------------------------------------------------------------------------------
def test_json_nested_100000_deep_is_a_serialization_error(saved):
    directory, _, _ = saved
    deep = '{"class_name": "M", "nodes": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (directory / io.GRAPH).write_text(deep)
    _resign(directory, io.GRAPH)
    with pytest.raises(SerializationError, match="nested deeper"):
        io.load(directory)


def test_json_nested_past_the_depth_limit(saved):
    directory, _, _ = saved
    _edit(directory, io.GRAPH, lambda data: _node(data, "conv2").update(kwargs={"a": json.loads("[" * 150 + "]" * 150)}))
    with pytest.raises(SerializationError, match="nested deeper"):
        io.load(directory)


def test_size_and_count_limits(saved, monkeypatch):
    directory, _, _ = saved
    monkeypatch.setitem(io.format.LIMITS, "json_bytes", 1000)
    with pytest.raises(SerializationError, match="more than any fxprep save"):
        io.load(directory)
    monkeypatch.setitem(io.format.LIMITS, "json_bytes", 2**30)
    monkeypatch.setitem(io.format.LIMITS, "entries", 3)
    with pytest.raises(SerializationError, match="more than any fxprep save"):
        io.load(directory)


def test_huge_integers_and_nan_literals_are_file_errors(saved):
    directory, _, _ = saved
    (directory / io.GRAPH).write_text('{"nodes": [' + "9" * 10_000 + "]}")
    _resign(directory, io.GRAPH)
    with pytest.raises(SerializationError, match="not valid JSON"):
        io.load(directory)
    (directory / io.GRAPH).write_text('{"nodes": [NaN]}')
    _resign(directory, io.GRAPH)
    with pytest.raises(SerializationError, match="not valid JSON"):
        io.load(directory)


def test_files_that_are_links_are_refused(saved, tmp_path):
    directory, _, _ = saved
    outside = tmp_path / "elsewhere.json"
    outside.write_text((directory / io.GRAPH).read_text())
    (directory / io.GRAPH).unlink()
    (directory / io.GRAPH).symlink_to(outside)
    with pytest.raises(SerializationError, match="not a regular file"):
        io.load(directory, check_integrity=False)


# --- weights of another dtype / shape -----------------------------------------------------------------
def _retype(directory: Path, key: str, convert) -> None:
    tensors = load_file(str(directory / io.WEIGHTS))
    tensors[key] = convert(tensors[key])
    save_file(tensors, str(directory / io.WEIGHTS), metadata={"format": io.FORMAT})
    _resign(directory, io.WEIGHTS)


def test_weights_of_another_dtype_are_refused_naming_the_tensor(saved):
    directory, _, _ = saved
    _retype(directory, "conv1.weight", lambda t: t.view(torch.int32))
    with pytest.raises(SerializationError, match=r"conv1\.weight.*int32"):
        io.load(directory)


def test_weights_whose_dtype_differs_from_the_record_are_refused(saved):
    directory, _, _ = saved
    _retype(directory, "conv1.bias", lambda t: t.double())
    with pytest.raises(SerializationError, match=r"conv1\.bias.*float64"):
        io.load(directory)


def test_buffer_of_another_dtype_is_refused(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 3, 8, 8)
    directory = io.save(fxprep.prepare_model(model, example_inputs=x), tmp_path / "s")
    _retype(directory, "1.num_batches_tracked", lambda t: t.float())
    with pytest.raises(SerializationError, match=r"1\.num_batches_tracked"):
        io.load(directory)


def test_half_precision_models_still_load(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval().to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    gm = fxprep.prepare_model(model, example_inputs=x)
    loaded = io.load(io.save(gm, tmp_path / "s"))
    assert loaded.get_submodule("0").weight.dtype == torch.bfloat16
    assert torch.equal(loaded(x), gm(x))


def test_graph_fx_cannot_compile_is_a_serialization_error(saved):
    """Found by the tamper fuzzer on the old loader: a placeholder default fx cannot write as code
    (here the type ``int``) made recompile raise a raw SyntaxError."""
    directory, _, _ = saved
    _edit(directory, io.GRAPH, lambda data: data["nodes"][0].update(args=[{"$": "type", "v": "int"}]))
    with pytest.raises(SerializationError, match="does not give a valid module"):
        io.load(directory)
