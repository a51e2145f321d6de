"""fxprep.save / load of parametrized layers (fxprep.io.parametrized): torch's weight_norm
(wav2vec2's and HuBERT's positional convolution) is saved as the plain torch.nn layer, its g and v,
and the parametrization's kind; the load applies torch's own weight_norm again. Any other
parametrization is refused at save, and a file naming one at load."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import fxprep
from fxprep import io
from fxprep.errors import SerializationError
from tests.helpers_io import _edit, _module

_AUDIO = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
          "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
          "num_conv_pos_embedding_groups": 2}
_POS_CONV = "encoder.pos_conv_embed.conv"


def _audio(name: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config, model = {"hubert": (transformers.HubertConfig, transformers.HubertModel),
                     "wav2vec2": (transformers.Wav2Vec2Config, transformers.Wav2Vec2Model)}[name]
    torch.manual_seed(0)
    return model(config(**_AUDIO)).eval().to(dtype), torch.randn(1, 800, dtype=dtype)


def _assert_torchs_weight_norm(conv: nn.Module, base: type, dim: int) -> None:
    """The module is what torch.nn.utils.parametrizations.weight_norm makes of a ``base`` layer."""
    assert type(conv).__bases__ == (base,) and parametrize.is_parametrized(conv, "weight")
    assert "weight" not in conv._parameters
    (norm,) = conv.parametrizations.weight
    assert type(norm) is parametrizations._WeightNorm and norm.dim == dim
    assert set(conv.parametrizations.weight._parameters) == {"original0", "original1"}


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["hubert", "wav2vec2"])
def test_audio_model_with_weight_norm_saves_and_loads_computing_the_same(name, dtype, tmp_path):
    model, x = _audio(name, dtype)
    _assert_torchs_weight_norm(model.get_submodule(_POS_CONV), nn.Conv1d, 2)  # what this test is about
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    directory = fxprep.save(gm, tmp_path / "saved")
    entry = _module(json.loads((directory / io.MODULES).read_text()), _POS_CONV)
    assert entry["class"] == "torch.nn.modules.conv.Conv1d" and entry["parametrize"] == {"weight": {"kind": "weight_norm", "dim": 2}}
    assert json.loads((directory / io.MANIFEST).read_text())["self_check"]["run"] == "outputs"

    loaded = fxprep.load(directory, trusted_modules=("transformers",))  # its self-check ran on the loaded module
    conv = loaded.get_submodule(_POS_CONV)
    _assert_torchs_weight_norm(conv, nn.Conv1d, 2)
    assert len(conv._load_state_dict_pre_hooks) == 1  # torch's own compat hook (weight_g / weight_v state dicts)
    _assert_same_state(gm, loaded)
    with torch.no_grad():
        for inp in (x, torch.randn(1, 800, dtype=dtype)):
            want, got = gm(inp), loaded(inp)
            assert got.last_hidden_state.dtype == dtype
            assert torch.equal(got.last_hidden_state, want.last_hidden_state)
        hidden = torch.randn(1, 32, 20, dtype=dtype)
        assert torch.equal(conv(hidden), gm.get_submodule(_POS_CONV)(hidden))


class _ConvNet(nn.Module):
    def __init__(self, dim: int = 0):
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1), dim=dim)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean(-1))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_conv1d_with_weight_norm_saves_and_loads(dim, tmp_path):
    torch.manual_seed(0)
    model, x = _ConvNet(dim).eval(), torch.randn(2, 4, 10)
    with torch.no_grad():  # g and v no longer what weight_norm computed from the weight: saved as they are
        model.conv.parametrizations.weight.original0.mul_(1.5)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    loaded = fxprep.load(fxprep.save(gm, tmp_path / "saved"))
    _assert_torchs_weight_norm(loaded.conv, nn.Conv1d, dim if dim >= 0 else -1)
    _assert_same_state(gm, loaded)
    assert loaded.conv.parametrizations.weight.original1.requires_grad
    with torch.no_grad():
        assert torch.equal(loaded(x), gm(x)) and torch.equal(loaded(x + 1), model(x + 1))


class _Scale(nn.Module):
    """A user's parametrization (not one fxprep knows)."""

    def forward(self, w):
        return w * 2


class _Named(nn.Module):
    """Named like torch's own, to show that the class object decides, not its name."""

    def __init__(self):
        super().__init__()
        self.dim = 0

    def forward(self, w):
        return w


_Named.__name__ = _Named.__qualname__ = "_WeightNorm"
_Named.__module__ = parametrizations.__name__


def _linear_model(kind: str) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    if kind == "chain":  # torch's weight_norm, then a user's parametrization on top
        parametrizations.weight_norm(model[2], "weight", 0)
    parametrize.register_parametrization(model[2], "weight", _Named() if kind == "same-name" else _Scale())
    return model.eval()


@pytest.mark.parametrize("kind", ["user", "same-name", "chain"])
def test_other_parametrizations_are_refused_at_save_naming_module_and_class(kind, tmp_path):
    gm = fxprep.prepare_model(_linear_model(kind), example_inputs=(torch.randn(1, 4),))
    with pytest.raises(SerializationError, match=r"cannot save module '2' .*tensor 'weight' is parametrized by .*_(Scale|WeightNorm)"):
        fxprep.save(gm, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_orthogonal_is_refused_at_save(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    parametrizations.orthogonal(model[2])
    gm = fxprep.prepare_model(model.eval(), example_inputs=(torch.randn(1, 4),))
    with pytest.raises(SerializationError, match=r"module '2' .*parametrized by torch\.nn\.utils\.parametrizations\._Orthogonal"):
        fxprep.save(gm, tmp_path / "saved")


class _UserLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.weight


def test_weight_norm_outside_torch_nn_or_with_more_hooks_is_refused_at_save(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), parametrizations.weight_norm(_UserLayer()))
    gm = fxprep.prepare_model(model.eval(), example_inputs=(torch.randn(1, 4),))
    with pytest.raises(SerializationError, match=r"module '1' .*weight_norm on torch\.nn layers only.*_UserLayer is not one"):
        fxprep.save(gm, tmp_path / "user")
    model = _ConvNet(2).eval()
    model.conv.register_forward_hook(lambda m, args, out: out * 2)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4, 10),))
    with pytest.raises(SerializationError, match=r"module 'conv' .*not what that rebuilds \(other hooks"):
        fxprep.save(gm, tmp_path / "hooked")


def test_old_hook_weight_norm_is_refused_with_what_to_do(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(FutureWarning):
        nn.utils.weight_norm(model[2])
    gm = fxprep.prepare_model(model.eval(), example_inputs=(torch.randn(1, 4),))
    with pytest.raises(SerializationError, match=r"module '2' .*hooks.*parametrizations\.weight_norm instead"):
        fxprep.save(gm, tmp_path / "saved")


@pytest.fixture
def conv_save(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 10)
    gm = fxprep.prepare_model(_ConvNet(2).eval(), example_inputs=(x,))
    return fxprep.save(gm, tmp_path / "saved"), gm, x


@pytest.mark.parametrize("edit, error", [
    ({"weight": {"kind": "tests.test_io_parametrize._Scale", "dim": 2}}, r"names parametrization 'tests\.test_io_parametrize\._Scale'"),
    ({"weight": {"kind": "orthogonal", "dim": 2}}, r"names parametrization 'orthogonal'"),
    ({"weight": {"kind": "weight_norm", "dim": 2, "fn": {"$": "fn", "v": "os.system"}}}, "malformed parametrization"),
    ({"forward": {"kind": "weight_norm", "dim": 0}}, r"cannot parametrize 'forward'"),
    ({"weight": {"kind": "weight_norm", "dim": True}}, "malformed dim"),
    ({"weight": {"kind": "weight_norm", "dim": 7}}, "weight_norm of 'weight' with dim 7 failed"),
    ({"weight": {"kind": "weight_norm", "dim": 0}}, r"saved shape \(1, 1, 3\) does not fit the module"),
    ({}, "malformed parametrizations"),
])
def test_a_save_naming_another_parametrization_is_refused_at_load(conv_save, edit, error):
    directory, _, _ = conv_save
    _edit(directory, io.MODULES, lambda data: _module(data, "conv").update(parametrize=edit))
    with pytest.raises(SerializationError, match=error):
        fxprep.load(directory)


def test_a_save_without_its_parametrization_is_refused_at_load(conv_save):
    directory, gm, x = conv_save
    _edit(directory, io.MODULES, lambda data: _module(data, "conv").pop("parametrize"))
    with pytest.raises(SerializationError, match=r"the parent's constructor did not create a torch\.nn\.modules\.container\.ModuleDict"):
        fxprep.load(directory)
    with torch.no_grad():  # the untouched save loads (so the refusals above are the edits')
        _edit(directory, io.MODULES, lambda data: _module(data, "conv").update(parametrize={"weight": {"kind": "weight_norm", "dim": 2}}))
        assert torch.equal(fxprep.load(directory)(x), gm(x))
