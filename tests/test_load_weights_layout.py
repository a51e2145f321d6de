"""``load_weights`` from checkpoints in the hub's layout, which transformers 5 converts on loading.

``save_pretrained`` writes what the hub holds: a mixture of experts' weights one tensor per expert
(the model keeps one 3D tensor per layer), a VLM's language model under ``language_model.model.*``
(the model has ``model.language_model.*``), GPT-NeoX's head as ``embed_out`` (``lm_head``). Each
test first checks that the files really are in another layout than the model's state_dict (so the
test means something), then that a graph prepared on ``meta`` and filled by ``load_weights`` gives
exactly what ``from_pretrained`` gives. A mixture of experts prepared on ``meta`` also runs on the
CPU: the capture took the non-CPU branch of transformers' token count per expert (an integer
``histc``, which has no CPU kernel).
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fxprep
from fxprep.errors import WeightsError

from . import vlm_models

IDS = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def _mixtral() -> Any:
    return tf.MixtralForCausalLM(tf.MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2)).eval()


def _gpt_neox() -> Any:
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**TEXT)).eval()


BUILDERS = {"mixtral": _mixtral, "gpt_neox": _gpt_neox, "llava": lambda: vlm_models.llava_pixtral()[0],
            "qwen2_vl": lambda: vlm_models.qwen2_vl()[0]}


def _written(name: str, path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model ``name`` (seeded) in ``dtype``, written to ``path`` in shards; its class and config."""
    torch.manual_seed(0)
    model = BUILDERS[name]().to(dtype)
    model.save_pretrained(path, max_shard_size="30KB")
    keys = {k for f in glob.glob(str(path / "*.safetensors")) for k in safe_open(f, "pt").keys()}
    assert keys - set(model.state_dict()), "the files are in the model's own layout: the test would prove nothing"
    return type(model), model.config


def _prepared_on_meta(cls: Any, config: Any) -> Any:
    with torch.device("meta"):
        model = cls._from_config(config).eval()
    return fxprep.prepare_model(model, example_inputs={"input_ids": IDS.to("meta")}, verify=False)


def _reference(cls: Any, path: Path) -> torch.Tensor:
    with torch.no_grad():
        return cls.from_pretrained(path).eval()(input_ids=IDS, use_cache=False).logits


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_checkpoint_in_the_hub_layout_loads_onto_a_graph_prepared_on_meta(tmp_path: Path, name: str) -> None:
    cls, config = _written(name, tmp_path)
    gm = _prepared_on_meta(cls, config)
    fxprep.load_weights(gm, tmp_path)
    with torch.no_grad():
        got = gm(input_ids=IDS).logits
    torch.testing.assert_close(got, _reference(cls, tmp_path), rtol=0, atol=0)
    note = next(n for n in gm.fxprep_report.notes if n.startswith("weights loaded"))
    assert "converted by transformers' from_pretrained" in note


def test_a_mixture_of_experts_in_bfloat16_restored_by_load(tmp_path: Path) -> None:
    """What ``fxprep prepare DIR --meta -o OUT`` does, then a user's ``load`` and ``load_weights``:
    the loaded graph has no original model, so the class comes from the checkpoint's config.json."""
    cls, config = _written("mixtral", tmp_path / "ckpt", torch.bfloat16)
    gm = _prepared_on_meta(cls, config)
    fxprep.load_weights(gm, tmp_path / "ckpt")
    fxprep.save(gm, tmp_path / "fx")
    loaded = fxprep.load(tmp_path / "fx")
    fxprep.load_weights(loaded, tmp_path / "ckpt")
    with torch.no_grad():
        got = loaded(input_ids=IDS).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _reference(cls, tmp_path / "ckpt"), rtol=0, atol=0)


def test_a_key_no_layout_has_a_place_for_is_still_an_error(tmp_path: Path) -> None:
    cls, config = _written("gpt_neox", tmp_path)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["gpt_neox.layers.0.smuggled.weight"] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"weight_map": {', f'"weight_map": {{"gpt_neox.layers.0.smuggled.weight": "{shard.name}", ', 1))
    gm = _prepared_on_meta(cls, config)
    with pytest.raises(WeightsError, match="smuggled"):
        fxprep.load_weights(gm, tmp_path)
    assert all(t.is_meta for t in gm.state_dict().values())  # nothing changed


def test_a_mixture_of_experts_captured_on_meta_counts_tokens_on_every_device(tmp_path: Path) -> None:
    """The count per expert is an integer ``histc`` in the graph Dynamo captured on ``meta``; the
    prepared graph counts in float32 and casts back, which the CPU runs (the same counts)."""
    cls, config = _written("mixtral", tmp_path)
    gm = _prepared_on_meta(cls, config)
    histograms = [n for n in gm.graph.nodes if n.op == "call_module" and "histc" in n.target]
    assert histograms
    for node in histograms:
        source = node.args[0]
        assert getattr(source, "target", None) == "to" and source.args[1] is torch.float32
    fxprep.load_weights(gm, tmp_path)
    fxprep.verify_prepared(gm, {"input_ids": IDS})


def test_a_device_map_puts_a_converted_checkpoint_where_it_says(tmp_path: Path) -> None:
    """The device-map path converts too: a layer on ``disk`` is written to the offload folder (the
    converted tensors have no file of their own to point at) and read back when it runs."""
    cls, config = _written("mixtral", tmp_path / "ckpt")
    gm = _prepared_on_meta(cls, config)
    fxprep.load_weights(gm, tmp_path / "ckpt", device_map={"": "cpu", "model.layers.1": "disk"},
                        offload_dir=tmp_path / "offload")
    assert any((tmp_path / "offload").iterdir())
    with torch.no_grad():
        got = gm(input_ids=IDS).logits
    torch.testing.assert_close(got, _reference(cls, tmp_path / "ckpt"), rtol=0, atol=0)
