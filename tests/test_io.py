"""fxprep.io: save/load round trips without pickle, tied weights, and refusal of tampered files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep import io, ops
from fxprep.cli.demo import ModelWithElementwiseAddOp, ModelWithFunctionalReLU, ModelWithReusedReLU
from fxprep.errors import SerializationError
from tests.helpers_io import Holder, Opaque, Tied, _edit, _module, _node


def roundtrip(gm, tmp_path: Path, example, **load_kwargs):
    """Save, load, and check the loaded module is the same graph computing the same values."""
    directory = io.save(gm, tmp_path / "saved", example_inputs=example)
    loaded = io.load(directory, **load_kwargs)
    assert loaded.code == gm.code
    args = example if isinstance(example, tuple) else (example,)
    with torch.no_grad():
        expected, got = gm(*args), loaded(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)
    assert list(loaded.state_dict()) == list(gm.state_dict())
    for key, value in gm.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    for key, value in loaded.state_dict().items():  # misaligned data makes CPU kernels differ in the last bits
        assert value.numel() == 0 or value.data_ptr() % 64 == 0, key
    assert [(n, type(m).__qualname__) for n, m in loaded.named_modules()] == \
           [(n, type(m).__qualname__) for n, m in gm.named_modules()][:1] + \
           [(n, type(m).__qualname__) for n, m in gm.named_modules()][1:]
    return loaded


# --- round trips --------------------------------------------------------------------------------
@pytest.mark.smoke
@pytest.mark.parametrize("cls, n_inputs", [(ModelWithFunctionalReLU, 1), (ModelWithReusedReLU, 1), (ModelWithElementwiseAddOp, 2)])
def test_seed_models_round_trip(tmp_path, cls, n_inputs):
    model = cls().eval()
    x = tuple(torch.randn(1, 3, 32, 32) for _ in range(n_inputs))
    gm = fxprep.prepare_model(model, example_inputs=x)
    loaded = roundtrip(gm, tmp_path, x)
    assert loaded.fxprep_report.verification.status == "passed"
    assert any("loaded from" in n for n in loaded.fxprep_report.notes)
    assert [m.name for m in loaded.fxprep_report.added] == [m.name for m in gm.fxprep_report.added]


@pytest.mark.smoke
def test_resnet18_round_trip_and_files(tmp_path):
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x)
    loaded = roundtrip(gm, tmp_path, x)
    saved = tmp_path / "saved"
    assert sorted(p.name for p in saved.iterdir()) == sorted([io.MANIFEST, io.GRAPH, io.MODULES, io.WEIGHTS, io.CODE])
    manifest = json.loads((saved / io.MANIFEST).read_text())
    assert manifest["inputs"] == [{"name": None, "shape": [1, 3, 64, 64], "dtype": "float32"}]
    assert manifest["torch_version"] == torch.__version__ and manifest["report"]["model"] == "ResNet"
    modules = {e["path"]: e for e in json.loads((saved / io.MODULES).read_text())["modules"]}
    assert modules["conv1"]["kind"] == "init"
    assert modules["conv1"]["init"] == {
        "in_channels": 3, "out_channels": 64, "kernel_size": {"$": "tuple", "v": [7, 7]},
        "stride": {"$": "tuple", "v": [2, 2]}, "padding": {"$": "tuple", "v": [3, 3]},
        "dilation": {"$": "tuple", "v": [1, 1]}, "bias": False,  # arguments equal to their default are left out
    }
    add = modules["layer1.0.add"]
    assert add["kind"] == "bound_op" and add["class"] == "fxprep.ops.Add" and add["kwargs"] == {}
    assert add["fn"] in ("operator.add", "operator.iadd")  # fx sees `out + identity`, Dynamo `out += identity`
    assert add["args"] == [{"$": "slot", "v": 0}, {"$": "slot", "v": 1}]
    assert isinstance(loaded.get_submodule("layer1.0.add"), ops.Add)
    # the BatchNorm buffers (running stats, num_batches_tracked) come back as buffers, persistent
    assert torch.equal(loaded.bn1.running_var, model.bn1.running_var)
    assert loaded.bn1.num_batches_tracked.dtype == torch.int64


def test_tied_and_shared_weights_stay_tied(tmp_path):
    from safetensors import safe_open

    model = Tied().eval()
    ids = torch.randint(0, 10, (2, 5))
    gm = fxprep.prepare_model(model, example_inputs=ids)
    assert gm.fxprep_report.unrolled, "the reused Linear should be unrolled"
    copy = gm.fxprep_report.unrolled[0].copies[0]
    loaded = roundtrip(gm, tmp_path, ids)
    assert loaded.head.weight is loaded.emb.weight
    assert loaded.get_submodule(copy).weight is loaded.proj.weight
    assert isinstance(loaded.proj.weight, nn.Parameter) and loaded.proj.weight.requires_grad
    assert "scale" in loaded._non_persistent_buffers_set and "scale" not in loaded.state_dict()
    assert torch.equal(loaded.unused, model.unused)
    with safe_open(str(tmp_path / "saved" / io.WEIGHTS), "pt") as f:
        keys = set(f.keys())
    assert "head.weight" not in keys and "emb.weight" in keys and f"{copy}.weight" not in keys
    # one optimiser step moves every call site
    with torch.no_grad():
        loaded.emb.weight.add_(1.0)
    assert torch.equal(loaded.head.weight, loaded.emb.weight)
    loaded.load_state_dict(model.state_dict(), strict=True)


def _leaf_cases():
    return [
        (nn.MultiheadAttention(8, 2, batch_first=True, kdim=6, vdim=6), lambda: (torch.randn(2, 3, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 6))),
        (nn.MultiheadAttention(8, 2, bias=False, add_bias_kv=True), lambda: (torch.randn(3, 2, 8),) * 3),
        (nn.LayerNorm((4, 5), eps=1e-3, elementwise_affine=False), lambda: (torch.randn(2, 4, 5),)),
        (nn.LayerNorm(5, bias=False), lambda: (torch.randn(2, 5),)),
        (nn.GroupNorm(2, 4), lambda: (torch.randn(2, 4, 3),)),
        (nn.BatchNorm1d(4, momentum=None, affine=False), lambda: (torch.randn(3, 4),)),
        (nn.Embedding(7, 3, padding_idx=1, max_norm=2.0), lambda: (torch.tensor([[0, 1, 6]]),)),
        (nn.ConvTranspose2d(2, 4, 3, stride=2, output_padding=1, groups=2, dilation=2), lambda: (torch.randn(1, 2, 5, 5),)),
        (nn.Conv1d(2, 4, 3, padding="same", padding_mode="reflect", bias=False), lambda: (torch.randn(1, 2, 9),)),
        (nn.Conv3d(1, 2, (1, 2, 3)), lambda: (torch.randn(1, 1, 3, 4, 5),)),
        (nn.GRU(4, 6, num_layers=2, batch_first=True, bidirectional=True), lambda: (torch.randn(2, 3, 4),)),
        (nn.LSTM(4, 6, proj_size=3), lambda: (torch.randn(3, 2, 4),)),
        (nn.PReLU(3, init=0.1), lambda: (torch.randn(2, 3),)),
        (nn.GELU(approximate="tanh"), lambda: (torch.randn(4),)),
        (nn.Softmax(dim=0), lambda: (torch.randn(3, 2),)),
        (nn.Upsample(scale_factor=2.0, mode="bilinear", align_corners=True), lambda: (torch.randn(1, 1, 3, 3),)),
        (nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False, divisor_override=2), lambda: (torch.randn(1, 1, 4, 4),)),
        (nn.MaxPool1d(2, return_indices=True), lambda: (torch.randn(1, 2, 6),)),
        (nn.AdaptiveAvgPool2d((2, None)), lambda: (torch.randn(1, 1, 5, 3),)),
        (nn.ZeroPad2d((1, 2, 0, 1)), lambda: (torch.randn(1, 1, 2, 2),)),
        (nn.Unflatten(1, (2, 3)), lambda: (torch.randn(2, 6),)),
        (nn.PixelShuffle(2), lambda: (torch.randn(1, 4, 2, 2),)),
        (nn.Dropout(0.3), lambda: (torch.randn(5),)),
        (nn.Identity(), lambda: (torch.randn(2),)),
        (nn.RMSNorm(6, eps=1e-5), lambda: (torch.randn(2, 6),)),
        (nn.Bilinear(3, 4, 2), lambda: (torch.randn(2, 3), torch.randn(2, 4))),
        (nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, activation="gelu", batch_first=True), lambda: (torch.randn(2, 3, 8),)),
    ]


class Wrap(nn.Module):
    """One leaf (torch.nn leaves are never traced into), called with one to three inputs."""

    def __init__(self, leaf: nn.Module):
        super().__init__()
        self.leaf = leaf

    def forward(self, x):
        return self.leaf(x)


class Wrap2(Wrap):
    def forward(self, x, y):
        return self.leaf(x, y)


class Wrap3(Wrap):
    def forward(self, x, y, z):
        return self.leaf(x, y, z)


@pytest.mark.parametrize("leaf, inputs", _leaf_cases(), ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_torch_nn_leaves_round_trip(tmp_path, leaf, inputs):
    torch.manual_seed(0)
    x = inputs()
    model = (Wrap, Wrap2, Wrap3)[len(x) - 1](leaf).eval()
    gm = fxprep.prepare_model(model, example_inputs=x)
    loaded = roundtrip(gm, tmp_path, x)
    assert type(loaded.leaf) is type(leaf) and loaded.leaf.extra_repr() == leaf.extra_repr()
    entry = next(e for e in json.loads((tmp_path / "saved" / io.MODULES).read_text())["modules"] if e["path"] == "leaf")
    assert entry["kind"] in ("init", "state")


def test_common_leaves_are_rebuilt_by_their_constructor():
    """The readable form (constructor arguments) is used for the everyday layers, not the fallback."""
    for leaf, _ in _leaf_cases():
        if isinstance(leaf, (nn.GRU, nn.LSTM, nn.TransformerEncoderLayer)):
            continue
        kwargs = io.init_kwargs(leaf)
        assert kwargs is not None, type(leaf)
        with torch.device("meta"):
            rebuilt = type(leaf)(**kwargs)
        assert rebuilt.extra_repr() == leaf.extra_repr()


class Functional(nn.Module):
    """Keyword arguments, dtypes, slices, infinities, a tensor constant and shape arithmetic."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.q(x)
        att = F.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.5)
        att = att.masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1, dtype=torch.float64).float()
        y = torch.cat([att[:, 1:], x[..., :4].repeat(1, 1, 2)[:, :-1]], dim=1)
        y = y.reshape(y.shape[0], -1) + torch.tensor([2.0])
        return F.interpolate(y[:, None], scale_factor=2.0, mode="linear").clamp(min=-1e4, max=float("inf"))


def test_functional_ops_round_trip(tmp_path):
    model = Functional().eval()
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 8, dtype=torch.bool)
    mask[0, -1] = False
    gm = fxprep.prepare_model(model, example_inputs=(x, mask))
    loaded = roundtrip(gm, tmp_path, (x, mask))
    kinds = {type(m).__name__ for m in loaded.modules()}
    assert {"ScaledDotProductAttention", "MaskedFill", "Softmax", "Concat", "Add", "Interpolate", "Clamp"} <= kinds
    sdpa = next(m for m in loaded.modules() if isinstance(m, ops.ScaledDotProductAttention))
    assert sdpa.kwargs == {"is_causal": True, "scale": 0.5}


def test_small_vision_transformer_round_trip(tmp_path):
    import torchvision

    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision zero-initialises the head: outputs would be all 0
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    loaded = roundtrip(gm, tmp_path, x)
    assert isinstance(loaded.encoder.layers.encoder_layer_0.self_attention, nn.MultiheadAttention)
    assert loaded.class_token.shape == (1, 1, 32)


@pytest.mark.smoke
def test_tiny_bert_round_trip(tmp_path):
    import transformers

    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    inputs = {"input_ids": torch.randint(0, 99, (1, 8))}
    gm = fxprep.prepare_model(model, example_inputs=inputs, tracer="auto")
    directory = io.save(gm, tmp_path / "bert", example_inputs=inputs)
    loaded = io.load(directory)  # only torch.nn layers and fxprep ops: nothing from transformers to trust
    assert loaded.code == gm.code
    kinds = {json.loads(line.rstrip(",\n"))["kind"] for line in (directory / io.MODULES).read_text().splitlines()
             if line.startswith('  {"path"')}
    assert kinds <= {"root", "container", "init", "bound_op"}
    with torch.no_grad():
        a, b = gm(**inputs), loaded(**inputs)
    assert type(a) is type(b)  # the ModelOutput comes back through the saved calling convention
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert torch.equal(x, y)


@pytest.mark.smoke
def test_saved_module_loads_in_a_fresh_process(tmp_path):
    """No original source, no fxprep state: a new interpreter rebuilds it from the directory alone."""
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    directory = io.save(gm, tmp_path / "s")
    torch.save(x, tmp_path / "x.pt")
    expected = gm(x)
    code = (
        "import sys, torch, fxprep.io as io\n"
        f"gm = io.load({str(directory)!r})\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        f"torch.save(gm(x), {str(tmp_path / 'y.pt')!r})\n"
        "assert 'fxprep.cli' not in sys.modules\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(torch.load(tmp_path / "y.pt"), expected)


def test_module_names_that_are_not_identifiers(tmp_path):
    """nn.Module accepts any dot-free child name (torchvision's regnet has ``block1-0``)."""
    model = nn.Sequential()
    model.add_module("block1-0", nn.Linear(3, 3))
    model.add_module("0", nn.ReLU())
    x = torch.randn(2, 3)
    gm = fxprep.prepare_model(model.eval(), example_inputs=x)
    loaded = roundtrip(gm, tmp_path, x)
    assert isinstance(loaded.get_submodule("block1-0"), nn.Linear)


# --- what cannot be saved is refused at save time --------------------------------------------------
def test_leaf_with_unknown_state_is_refused_at_save(tmp_path):
    model = Holder(Opaque(lambda t: t * 2)).eval()
    gm = fxprep.prepare_model(model, [model.block], example_inputs=torch.randn(2, 4))
    with pytest.raises(SerializationError) as info:
        io.save(gm, tmp_path / "x")
    message = str(info.value)
    assert "tests.helpers_io.Opaque" in message and "'block'" in message and "'fn'" in message


def test_user_leaf_needs_trust_to_load(tmp_path):
    model = Holder(Opaque(torch.tanh)).eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, [model.block], example_inputs=x)
    directory = io.save(gm, tmp_path / "x")
    with pytest.raises(SerializationError, match=r"tests\.helpers_io\.Opaque.*trusted_modules=\['tests.helpers_io'\]"):
        io.load(directory)
    loaded = io.load(directory, trusted_modules=["tests.helpers_io"])
    assert type(loaded.block) is Opaque and loaded.block.fn is torch.tanh
    assert torch.equal(loaded(x), gm(x))


class MethodBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def pick(self, y):
        if y.sum() > 0:
            return y * 2
        return y

    def forward(self, x):
        return self.pick(self.lin(x)).relu()


def test_opaque_method_is_refused_at_save_with_the_reason(tmp_path):
    model = MethodBranch().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))
    assert "pick" in gm.fxprep_report.leaves  # the method's data-dependent branch: an opaque part
    with pytest.raises(SerializationError, match="'pick'.*opaque part.*Save the original model"):
        io.save(gm, tmp_path / "x")


def test_hooks_are_refused_at_save(tmp_path):
    model = Holder(Opaque(torch.tanh)).eval()
    gm = fxprep.prepare_model(model, [model.block], example_inputs=torch.randn(2, 4))
    gm.block.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(SerializationError, match="hooks"):
        io.save(gm, tmp_path / "x")


def test_meta_weights_are_refused_at_save(tmp_path):
    with torch.device("meta"):
        model = ModelWithReusedReLU().eval()
    gm = fxprep.prepare_model(model)
    with pytest.raises(SerializationError, match="meta device"):
        io.save(gm, tmp_path / "x")


# --- tampering: refused with a clear error, never executed ----------------------------------------
@pytest.fixture
def saved(tmp_path):
    model = ModelWithReusedReLU().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32))
    return io.save(gm, tmp_path / "saved")


def test_load_never_unpickles(saved, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("load must not unpickle")

    for target, name in [(torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")]:
        monkeypatch.setattr(target, name, forbidden)
    io.load(saved)


def test_forward_py_is_never_run(saved):
    (saved / io.CODE).write_text("raise SystemExit('forward.py was executed')\n")
    io.load(saved, check_integrity=False)


@pytest.mark.parametrize("name", [io.MANIFEST, io.GRAPH, io.MODULES])
def test_damaged_json(saved, name):
    (saved / name).write_text("{not json")
    with pytest.raises(SerializationError, match="not valid JSON|checksum"):
        io.load(saved)


def test_modified_weights_fail_the_checksum(saved):
    data = bytearray((saved / io.WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (saved / io.WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(SerializationError, match="checksum"):
        io.load(saved)


def test_truncated_weights(saved):
    data = (saved / io.WEIGHTS).read_bytes()
    (saved / io.WEIGHTS).write_bytes(data[:100])
    with pytest.raises(SerializationError, match=io.WEIGHTS):
        io.load(saved, check_integrity=False)


def test_wrong_shapes_in_weights(saved, tmp_path):
    other = ModelWithReusedReLU().eval()
    other.fc2 = nn.Linear(128, 7)
    gm = fxprep.prepare_model(other)
    io.save(gm, tmp_path / "other")
    (saved / io.WEIGHTS).write_bytes((tmp_path / "other" / io.WEIGHTS).read_bytes())
    with pytest.raises(SerializationError, match=r"fc2.weight: saved shape \(7, 128\)"):
        io.load(saved, check_integrity=False)


def test_unknown_format_version(saved):
    manifest = json.loads((saved / io.MANIFEST).read_text())
    manifest["format_version"] = 99
    (saved / io.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SerializationError, match="format version 99"):
        io.load(saved)


@pytest.mark.parametrize("fn", ["os.system", "builtins.eval", "builtins.exec", "builtins.__import__", "torch.load",
                                "operator.attrgetter", "operator.methodcaller", "subprocess.run",
                                "torch.fx.graph_module._exec_with_source", "torch.hub.load", "importlib.import_module",
                                "torch.utils.cpp_extension.load_inline", "torch.Tensor.__reduce_ex__"])
def test_untrusted_function_in_graph_is_refused(saved, tmp_path, fn):
    marker = tmp_path / "pwned"

    def change(data):
        node = _node(data, "conv1")
        node.update(op="call_function", target={"fn": fn}, args=[f"touch {marker}"], kwargs={})

    _edit(saved, io.GRAPH, change)
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(saved)
    assert not marker.exists()


@pytest.mark.parametrize("attr", ["__class__", "__globals__", "_modules", "__dict__"])
def test_private_attribute_access_is_refused(saved, attr):
    def change(data):
        node = _node(data, "conv1")
        x = data["nodes"][0]["name"]
        node.update(op="call_function", target={"fn": "builtins.getattr"}, args=[{"$": "node", "v": x}, attr])

    _edit(saved, io.GRAPH, change)
    with pytest.raises(SerializationError, match="private"):
        io.load(saved)


@pytest.mark.parametrize("method", ["__reduce_ex__", "__getattribute__", "__init_subclass__", "_version"])
def test_private_method_call_is_refused(saved, method):
    _edit(saved, io.GRAPH, lambda data: _node(data, "conv1").update(op="call_method", target=method))
    with pytest.raises(SerializationError, match="private"):
        io.load(saved)


def test_operator_dunder_methods_are_allowed():
    io.check_member("__add__", "method")
    io.check_member("__getitem__", "method")
    with pytest.raises(SerializationError):
        io.check_member("__subclasses__", "method")


@pytest.mark.parametrize("cls", ["subprocess.Popen", "os.PathLike", "torch.nn.functional.relu", "torch.nn.modules.module.Module.__subclasses__",
                                 "collections.OrderedDict"])
def test_untrusted_or_non_module_class_is_refused(saved, cls):
    _edit(saved, io.MODULES, lambda data: _module(data, "relu").update(kind="state", attrs={}, **{"class": cls}))
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(saved)


def test_class_that_cannot_be_imported(saved):
    _edit(saved, io.MODULES, lambda data: _module(data, "relu").update(**{"class": "torch.nn.modules.activation.NoSuchLayer"}))
    with pytest.raises(SerializationError, match="cannot import 'torch.nn.modules.activation.NoSuchLayer'"):
        io.load(saved)


def test_bound_op_with_untrusted_function_is_refused(tmp_path):
    model = ModelWithElementwiseAddOp().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(1, 3, 32, 32),) * 2)
    directory = io.save(gm, tmp_path / "saved")
    _edit(directory, io.MODULES, lambda data: _module(data, "add").update(fn="os.system"))
    with pytest.raises(SerializationError, match="os.system"):
        io.load(directory)
    _edit(directory, io.MODULES, lambda data: _module(data, "add").update(
        fn="builtins.getattr", args=[{"$": "slot", "v": 0}, "__class__"]))
    with pytest.raises(SerializationError, match="private"):
        io.load(directory)


def test_state_attributes_cannot_overwrite_internals(saved):
    _edit(saved, io.MODULES, lambda data: _module(data, "relu").update(kind="state", attrs={"_parameters": 1}))
    with pytest.raises(SerializationError, match="internal|private"):
        io.load(saved)


def test_graph_referencing_unknown_node_or_module(saved):
    _edit(saved, io.GRAPH, lambda data: _node(data, "conv2").update(args=[{"$": "node", "v": "nope"}]))
    with pytest.raises(SerializationError, match="'nope'"):
        io.load(saved)


def test_graph_call_module_outside_the_tree(tmp_path):
    model = ModelWithReusedReLU().eval()
    directory = io.save(fxprep.prepare_model(model), tmp_path / "s")
    _edit(directory, io.GRAPH, lambda data: _node(data, "conv2").update(target="conv9"))
    with pytest.raises(SerializationError, match="conv9"):
        io.load(directory)


def test_unknown_value_tag(saved):
    _edit(saved, io.GRAPH, lambda data: _node(data, "torch.flatten").update(args=[{"$": "pickle", "v": "gASV..."}]))
    with pytest.raises(SerializationError, match="unknown value tag 'pickle'"):
        io.load(saved)


def test_not_a_save_directory(tmp_path):
    with pytest.raises(SerializationError, match="not a directory"):
        io.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SerializationError, match="missing"):
        io.load(tmp_path / "empty")


def test_save_rejects_non_graph_modules(tmp_path):
    with pytest.raises(SerializationError, match="GraphModule"):
        io.save(nn.Linear(2, 2), tmp_path / "x")


def test_inspect_saved_reads_json_only(saved):
    view = io.inspect_saved(saved)
    assert view["class_name"] == "ModelWithReusedReLU" and view["nodes"][0]["op"] == "placeholder"
    whats = [n["what"] for n in view["nodes"]]
    assert whats[1:5] == ["conv1: Conv2d", "relu: ReLU", "conv2: Conv2d", "relu_1: ReLU"]
    relu = next(n for n in view["nodes"] if n["what"] == "relu: ReLU")
    conv2 = next(n for n in view["nodes"] if n["what"] == "conv2: Conv2d")
    assert conv2["inputs"] == [relu["name"]]


def test_trusting_a_library_trusts_its_custom_op_namespace():
    """transformers' MoE layers call torch.ops.transformers.*: trusting 'transformers' covers them,
    while another library's namespace and a look-alike prefix stay refused."""
    policy = io.TrustPolicy(("transformers",))
    policy.check_function("torch.ops.transformers.grouped_mm_fallback")
    for name in ("torch.ops.other.op", "torch.ops.transformersx.op"):
        with pytest.raises(SerializationError, match="refusing to load"):
            policy.check_function(name)
    with pytest.raises(SerializationError, match="refusing to load") as refused:
        io.TrustPolicy().check_function("torch.ops.transformers.grouped_mm_fallback")
    # the way out named is the library, which works, never torch.ops (torch itself, every op)
    assert "trusted_modules=['transformers']" in str(refused.value) and "'torch.ops'" not in str(refused.value)
    import transformers.integrations.moe  # noqa: F401 - registers the op (importing a model does)

    io.TrustPolicy(("transformers",)).function("torch.ops.transformers.grouped_mm_fallback")
    with pytest.raises(SerializationError, match="No trusted_modules entry allows it"):
        io.TrustPolicy(("transformers",)).function("torch.ops.aten.not_a_reviewed_op")
    io.TrustPolicy().check_function("torch.amp.autocast_mode._enter_autocast")  # disabled-autocast regions
