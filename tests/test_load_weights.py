"""``fxprep.load_weights``: a graph prepared on ``meta`` materialised from a checkpoint.

Checked against transformers' own ``from_pretrained`` on the same files (sharded safetensors with
an index, written by ``save_pretrained(max_shard_size=...)``): the outputs are equal, tied weights
stay tied, non-persistent buffers (rotary ``inv_freq``, BERT's ``position_ids``) are recomputed,
a bfloat16 checkpoint loads, and checkpoints that do not fit fail with errors naming what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import fxprep
from fxprep.errors import InvalidInput

LLAMA = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
IDS = torch.randint(0, 99, (1, 8), generator=torch.Generator().manual_seed(0))


def _meta_prepared(cls: Any, config: Any, example: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    with torch.device("meta"):
        model = cls._from_config(config, **kwargs).eval()
    meta_example = {k: v.to("meta") for k, v in example.items()}
    return model, fxprep.prepare_model(model, example_inputs=meta_example, verify=False)


def _tensors_on_meta(module: nn.Module) -> list[str]:
    found = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
    found += [f"{n}.{b}" for n, m in module.named_modules() for b, t in m._buffers.items() if t is not None and t.is_meta]
    return found


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).eval().save_pretrained(path, max_shard_size="20KB")
    return path


def test_sharded_checkpoint_gives_what_from_pretrained_gives(llama_dir: Path) -> None:
    assert (llama_dir / "model.safetensors.index.json").is_file()
    assert len(list(llama_dir.glob("*.safetensors"))) > 3  # really sharded
    reference = LlamaForCausalLM.from_pretrained(llama_dir).eval()
    model, gm = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS})
    assert fxprep.load_weights(gm, llama_dir) is gm
    assert _tensors_on_meta(gm) == [] and _tensors_on_meta(model) == []
    with torch.no_grad():
        got = gm(input_ids=IDS).logits
        want = reference(input_ids=IDS, use_cache=False).logits
    assert torch.equal(got, want)
    # tied weights stay one tensor; the rotary buffer no checkpoint holds is recomputed exactly
    assert gm.lm_head.weight is gm.model.embed_tokens.weight
    assert torch.equal(gm.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert "recomputed" in " ".join(fxprep.get_report(gm).notes)
    # verification on real inputs, against the original (now materialised too)
    assert fxprep.verify_prepared(gm, {"input_ids": IDS}).status == "passed"
    assert fxprep.get_report(gm).verification.status == "passed"


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    reference = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    _, gm = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS}, dtype=torch.bfloat16)
    fxprep.load_weights(gm, tmp_path)
    assert gm.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(gm(input_ids=IDS).logits, reference(input_ids=IDS, use_cache=False).logits)
    # the same checkpoint into a graph prepared in float32: refused, unless asked to cast
    _, gm32 = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS})
    with pytest.raises(fxprep.WeightsError, match=r"dtype torch.bfloat16 in the checkpoint.*pass dtype=torch.float32"):
        fxprep.load_weights(gm32, tmp_path)
    assert _tensors_on_meta(gm32)  # nothing changed
    fxprep.load_weights(gm32, tmp_path, dtype=torch.float32)
    reference32 = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(gm32(input_ids=IDS).logits, reference32(input_ids=IDS, use_cache=False).logits)
    _, gm_other = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS})
    with pytest.raises(fxprep.WeightsError, match="prepare the model in torch.bfloat16"):
        fxprep.load_weights(gm_other, tmp_path, dtype=torch.bfloat16)


def test_mismatched_checkpoints_name_what_is_wrong(llama_dir: Path) -> None:
    state = LlamaForCausalLM.from_pretrained(llama_dir).state_dict()
    _, gm = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS})
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(fxprep.WeightsError, match=r"1 missing key\(s\): model.layers.1.mlp.up_proj.weight"):
        fxprep.load_weights(gm, missing)
    with pytest.raises(fxprep.WeightsError, match=r"unexpected key\(s\).*model.layers.9.gate"):
        fxprep.load_weights(gm, {**state, "model.layers.9.gate": torch.zeros(2)})
    wrong = {**state, "model.norm.weight": torch.ones(33)}
    with pytest.raises(fxprep.WeightsError, match=r"model.norm.weight: shape \[33\] in the checkpoint, \[32\]"):
        fxprep.load_weights(gm, wrong)
    tied = {**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1}
    with pytest.raises(fxprep.WeightsError, match="tied"):
        fxprep.load_weights(gm, tied)
    with pytest.raises(InvalidInput, match="only .safetensors"):
        torch.save(state, llama_dir / "pytorch_model.bin")
        fxprep.load_weights(gm, llama_dir / "pytorch_model.bin")
    os.remove(llama_dir / "pytorch_model.bin")
    with pytest.raises(InvalidInput, match="no such file"):
        fxprep.load_weights(gm, llama_dir / "nothing.safetensors")


def test_single_file_and_state_dict_sources(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None).eval()
    save_file(reference.state_dict(), str(tmp_path / "model.safetensors"))
    x = torch.randn(1, 3, 32, 32)
    for source in (tmp_path / "model.safetensors", tmp_path, reference.state_dict()):
        with torch.device("meta"):
            model = torchvision.models.resnet18(weights=None).eval()
        gm = fxprep.prepare_model(model, example_inputs=x.to("meta"), verify=False)
        fxprep.load_weights(gm, source)
        assert gm.get_submodule("layer1.0.bn1").num_batches_tracked.dtype == torch.int64
        with torch.no_grad():
            assert torch.equal(gm(x), reference(x))


def test_bert_position_ids_are_recomputed(tmp_path: Path) -> None:
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(tmp_path)
    reference = BertModel.from_pretrained(tmp_path).eval()
    example = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
    _, gm = _meta_prepared(BertModel, config, example)
    fxprep.load_weights(gm, tmp_path)
    with torch.no_grad():
        got, want = gm(**example), reference(**example)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    notes = " ".join(fxprep.get_report(gm).notes)
    assert "embeddings.position_ids" in notes and "embeddings.token_type_ids" in notes


class Positional(nn.Module):
    """A buffer computed at construction from the module's own settings."""

    def __init__(self, dim: int, length: int):
        super().__init__()
        self.dim, self.length = dim, length
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("table", torch.arange(length * dim, dtype=torch.float32).view(length, dim) / 100,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.table[: x.shape[0]]


class Hidden(nn.Module):
    """A buffer computed from an argument the module does not keep: cannot be recomputed."""

    def __init__(self, dim: int, scale: float):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("scales", torch.full((dim,), scale), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scales


def test_buffers_of_other_modules(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Positional(4, 8).eval()
    with torch.device("meta"):
        model = Positional(4, 8).eval()
    x = torch.randn(3, 4)
    gm = fxprep.prepare_model(model, example_inputs=x.to("meta"), verify=False)
    fxprep.load_weights(gm, reference.state_dict())
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))

    reference = Hidden(4, 3.0).eval()
    with torch.device("meta"):
        model = Hidden(4, 3.0).eval()
    gm = fxprep.prepare_model(model, example_inputs=x.to("meta"), verify=False)
    with pytest.raises(fxprep.WeightsError, match=r"could not be recomputed.*scales"):
        fxprep.load_weights(gm, reference.state_dict())
    # its value can be given in the source
    fxprep.load_weights(gm, {**reference.state_dict(), "scales": reference.scales})
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


def test_a_copy_shares_the_original_and_verify_needs_it(llama_dir: Path) -> None:
    import copy

    model, gm = _meta_prepared(LlamaForCausalLM, LlamaConfig(**LLAMA), {"input_ids": IDS})
    twin = copy.deepcopy(gm)
    assert twin.meta["fxprep_original"].model is model  # the model is not copied along
    with pytest.raises(InvalidInput, match="load_weights first"):
        fxprep.verify_prepared(gm, {"input_ids": IDS})
    fxprep.load_weights(gm, llama_dir)
    plain = torch.fx.GraphModule(gm, gm.graph)
    with pytest.raises(InvalidInput, match="does not know the model"):
        fxprep.verify_prepared(plain, {"input_ids": IDS})


def test_block_reuse_page_example_runs(tmp_path: Path, monkeypatch: Any) -> None:
    """docs/concepts/block-reuse.md (the LLM example that was the README's): prepared on meta, one
    decoder layer captured and the other stamped out, then filled by load_weights and verified."""
    from tests.helpers_docs import DOCS, run_page

    monkeypatch.chdir(tmp_path)
    scope = run_page(DOCS / "concepts" / "block-reuse.md", tmp_path)
    gm = scope["gm"]
    assert _tensors_on_meta(gm) == []
    assert fxprep.get_report(gm).reuse["captured"] == {"model.layers.0": ["model.layers.1"]}


# --- issue 28: the index is data from whoever wrote the checkpoint -------------------------------------
class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _small_on_meta() -> Any:
    with torch.device("meta"):
        model = _Small().eval()
    return fxprep.prepare_model(model, example_inputs=torch.randn(2, 4, device="meta"), verify=False)


def _sharded(directory: Path, weight_map: Any, reference: nn.Module) -> Path:
    """``a.*`` in shard ``a.safetensors``, ``b.*`` in ``b.safetensors``, and the index given."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    state = reference.state_dict()
    save_file({k: v for k, v in state.items() if k.startswith("a.")}, str(directory / "a.safetensors"))
    save_file({k: v for k, v in state.items() if k.startswith("b.")}, str(directory / "b.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("where", ["parent", "absolute", "dotdot_inside"])
def test_shards_outside_the_checkpoint_directory_are_refused(tmp_path: Path, where: str) -> None:
    """A shard named ``../elsewhere/x.safetensors`` or by an absolute path was read: any local file
    could be put into the model. Now a WeightsError names the field and the shard."""
    torch.manual_seed(0)
    reference = _Small().eval()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file({k: v for k, v in reference.state_dict().items() if k.startswith("b.")}, str(elsewhere / "x.safetensors"))
    outside = {"parent": "../elsewhere/x.safetensors", "absolute": str(elsewhere / "x.safetensors"),
               "dotdot_inside": "sub/../../elsewhere/x.safetensors"}[where]
    directory = _sharded(tmp_path / "ckpt", {"a.weight": "a.safetensors", "a.bias": "a.safetensors",
                                             "b.weight": outside, "b.bias": outside}, reference)
    gm = _small_on_meta()
    with pytest.raises(fxprep.WeightsError, match=r"'weight_map'\['b\.(weight|bias)'\].*outside the checkpoint"):
        fxprep.load_weights(gm, directory)


@pytest.mark.parametrize("weight_map, field", [
    ([["a.weight", "a.safetensors"]], "'weight_map' must map"), (None, "'weight_map' must map"),
    ("a.safetensors", "'weight_map' must map"), ({"a.weight": None}, r"'weight_map'\['a.weight'\] must be a shard"),
    ({"a.weight": 3}, r"'weight_map'\['a.weight'\] must be a shard"),
])
def test_malformed_index_is_a_weights_error_naming_the_field(tmp_path: Path, weight_map: Any, field: str) -> None:
    """``weight_map`` a list or null gave a raw AttributeError."""
    directory = _sharded(tmp_path / "ckpt", weight_map, _Small())
    with pytest.raises(fxprep.WeightsError, match=field):
        fxprep.load_weights(_small_on_meta(), directory)


def test_index_that_is_not_an_object_is_a_weights_error(tmp_path: Path) -> None:
    directory = _sharded(tmp_path / "ckpt", {}, _Small())
    (directory / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(fxprep.WeightsError, match="not an object"):
        fxprep.load_weights(_small_on_meta(), directory)
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(fxprep.WeightsError, match="not readable JSON"):
        fxprep.load_weights(_small_on_meta(), directory)


def test_symlinked_shards_still_load(tmp_path: Path) -> None:
    """The Hugging Face cache is made of links (snapshots/<rev>/x.safetensors -> ../../blobs/<sha>):
    a shard that is a link, even to a file outside the directory, is followed as before."""
    torch.manual_seed(0)
    reference = _Small().eval()
    blobs = tmp_path / "blobs"
    real = _sharded(blobs, {}, reference)
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for name in ("a.safetensors", "b.safetensors"):
        (snapshot / name).symlink_to(real / name)
    import json

    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "a.safetensors", "a.bias": "a.safetensors", "b.weight": "b.safetensors", "b.bias": "b.safetensors"}}))
    gm = fxprep.load_weights(_small_on_meta(), snapshot)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


# --- issue 28: every exception out of load_weights is an FxprepError naming what to fix ----------------
_MAP = {"a.weight": "a.safetensors", "a.bias": "a.safetensors", "b.weight": "b.safetensors", "b.bias": "b.safetensors"}


def _rewrite_header(path: Path, edit: Any) -> None:
    """``path``'s safetensors header edited by ``edit(header)``, the tensor data kept: a header that
    lies about the sizes of the data after it."""
    import json
    import struct

    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def _shape(header: dict[str, Any], key: str, shape: list[int]) -> None:
    header[key]["shape"] = shape


def _offsets(header: dict[str, Any], key: str, offsets: list[int]) -> None:
    header[key]["data_offsets"] = offsets


@pytest.mark.parametrize("damage", ["truncated", "empty", "header_shape", "header_offsets", "header_dtype", "garbage"])
def test_damaged_shard_is_a_weights_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    """A shard cut short by a failed download, or whose header lies about the sizes of the data after
    it, was an InvalidInput ("the arguments are of the wrong kind") carrying safetensors' bare
    message; now a WeightsError naming the file and what to do."""
    directory = _sharded(tmp_path / "ckpt", _MAP, _Small())
    shard = directory / "b.safetensors"
    raw = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(raw[:-7])
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "header_shape":
        _rewrite_header(shard, lambda h: _shape(h, "b.weight", [1000, 1000]))
    elif damage == "header_offsets":
        _rewrite_header(shard, lambda h: _offsets(h, "b.weight", [0, 10**12]))
    elif damage == "header_dtype":
        _rewrite_header(shard, lambda h: h["b.weight"].update(dtype="F64"))
    else:
        shard.write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(fxprep.WeightsError, match=r"cannot read .*b\.safetensors as safetensors .*truncated, damaged"):
        fxprep.load_weights(_small_on_meta(), directory)


def test_missing_or_unnameable_shard_is_a_weights_error(tmp_path: Path) -> None:
    """A shard the index lists but the directory lacks was an InvalidInput; a shard name longer than
    the system allows made ``Path.is_file`` raise a raw ``OSError: File name too long``."""
    directory = _sharded(tmp_path / "ckpt", _MAP, _Small())
    (directory / "b.safetensors").unlink()
    with pytest.raises(fxprep.WeightsError, match=r"names shard 'b\.safetensors'.*not a file in.*download is incomplete"):
        fxprep.load_weights(_small_on_meta(), directory)
    long = "x" * 300 + ".safetensors"
    directory = _sharded(tmp_path / "ckpt2", {**_MAP, "b.weight": long, "b.bias": long}, _Small())
    with pytest.raises(fxprep.WeightsError, match=r"'weight_map'\['b\.(bias|weight)'\]: .*cannot be looked up"):
        fxprep.load_weights(_small_on_meta(), directory)


def test_shard_holding_other_keys_and_directory_without_weights_are_weights_errors(tmp_path: Path) -> None:
    directory = _sharded(tmp_path / "ckpt", {**_MAP, "b.weight": "a.safetensors"}, _Small())
    with pytest.raises(fxprep.WeightsError, match=r"does not hold what model.safetensors.index.json says"):
        fxprep.load_weights(_small_on_meta(), directory)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"pickled")
    with pytest.raises(fxprep.WeightsError, match=r"no \*\.safetensors\.index\.json and 0 .safetensors files.*convert"):
        fxprep.load_weights(_small_on_meta(), empty)


def test_shard_of_the_wrong_shape_or_dtype_names_the_tensor(tmp_path: Path) -> None:
    """A valid file whose tensor does not fit the parameter: refused before anything changes."""
    torch.manual_seed(0)
    reference = _Small().eval()
    state = reference.state_dict()
    save_file({**state, "b.weight": torch.zeros(3, 4)}, str(tmp_path / "shape.safetensors"))
    save_file({**state, "b.weight": state["b.weight"].to(torch.int32)}, str(tmp_path / "dtype.safetensors"))
    gm = _small_on_meta()
    with pytest.raises(fxprep.WeightsError, match=r"b\.weight: shape \[3, 4\] in the checkpoint, \[2, 4\] in the module"):
        fxprep.load_weights(gm, tmp_path / "shape.safetensors")
    with pytest.raises(fxprep.WeightsError, match=r"b\.weight: dtype torch\.int32 in the checkpoint, torch\.float32"):
        fxprep.load_weights(gm, tmp_path / "dtype.safetensors")
    assert gm.b.weight.is_meta  # nothing changed


@pytest.mark.parametrize("device", ["gpu0", "nope:0", 3.5])
def test_unusable_device_is_an_invalid_input(tmp_path: Path, device: Any) -> None:
    """``device="gpu0"`` raised torch's raw RuntimeError, a float its TypeError."""
    directory = _sharded(tmp_path / "ckpt", _MAP, _Small())
    gm = _small_on_meta()
    with pytest.raises(InvalidInput, match=r"device=.* is not a device this process can use"):
        fxprep.load_weights(gm, directory, device=device)
    assert gm.b.weight.is_meta


@pytest.mark.parametrize("value", ["meta", "sparse"])
def test_state_dict_of_tensors_without_values_is_refused(value: str) -> None:
    """A meta tensor in a state_dict was "loaded": the module kept a weight with no values."""
    state = dict(_Small().state_dict())
    state["a.bias"] = torch.empty(4, device="meta") if value == "meta" else torch.zeros(4).to_sparse()
    with pytest.raises(InvalidInput, match=r"state_dict\['a.bias'\] is a .*load_weights takes dense tensors"):
        fxprep.load_weights(_small_on_meta(), state)



@pytest.mark.parametrize(("model_type", "cls_name"), [("falcon_h1", "FalconH1ForCausalLM"),
                                                      ("paligemma", "PaliGemmaForConditionalGeneration")])
def test_a_buffer_the_model_fills_from_above_is_recomputed(tmp_path: Path, model_type: str, cls_name: str) -> None:
    """Buffers the whole model's ``_init_weights`` does not fill on their owner, which were "could
    not be recomputed": Falcon-H1's ``mup_vector`` of each layer's mixer is filled by the whole
    model's initialisation run on the model (not the mixer); PaliGemma's Gemma text model scales
    its embeddings by a buffer only Gemma's own ``_init_weights`` knows, not the VLM's."""
    import transformers

    from fxprep.cli.tiny import tiny_config

    cls = getattr(transformers, cls_name)
    config = tiny_config(model_type)
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(tmp_path)
    with torch.device("meta"):
        model = cls(config).eval()
    # static shapes: Falcon-H1's shape-general capture costs a minute on two cores, and shapes are not the point here
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS.to("meta")}, verify=False, dynamic=False)
    fxprep.load_weights(gm, tmp_path)
    assert not _tensors_on_meta(gm)
    reference = cls.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=IDS).logits, reference(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)
