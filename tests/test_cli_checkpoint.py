"""``fxprep prepare path/to/checkpoint`` (issue 27, item 5): a user's own transformers checkpoint.

Checkpoints are written by ``save_pretrained`` here: sharded (``max_shard_size``), bf16, tied
embeddings. The saved result (``-o``) restored by ``fxprep.load`` plus ``load_weights`` gives the
logits ``from_pretrained`` gives.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import fxprep

from .helpers_cli import as_json, invoke

pytestmark = pytest.mark.usefixtures("_restore_process_state")  # tests/conftest.py: undo what the CLI changes

IDS = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tied-embedding Llama in bf16, written in several shards."""
    path = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _expected(path, dtype=torch.bfloat16) -> torch.Tensor:
    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def _restored(saved, path) -> torch.Tensor:
    loaded = fxprep.load(saved)
    fxprep.load_weights(loaded, path)
    with torch.no_grad():
        return loaded(input_ids=IDS).logits


@pytest.mark.parametrize("meta", [False, True], ids=["weights", "meta"])
def test_prepare_checkpoint_saves_what_load_weights_restores(checkpoint, tmp_path, meta: bool) -> None:
    saved = tmp_path / "out"
    args = ["prepare", str(checkpoint), "-o", str(saved), "--json", "-i", "input_ids=1x16:int64"]
    result = invoke(*args, *(["--meta"] if meta else []))
    assert result.exit_code == 0, result.output
    report = as_json(result)["report"]
    assert report["verification"]["status"] == "passed"
    restored = _restored(saved, checkpoint)
    assert restored.dtype == torch.bfloat16
    torch.testing.assert_close(restored, _expected(checkpoint), rtol=0, atol=0)
    loaded = fxprep.load(saved)
    assert loaded.get_submodule("lm_head").weight is loaded.get_submodule("model.embed_tokens").weight  # tied


def test_dtype_device_and_dynamic(checkpoint, tmp_path) -> None:
    saved = tmp_path / "out"
    result = invoke("prepare", str(checkpoint), "--dtype", "float32", "--device", "cpu", "--dynamic",
                    "input_ids:1=seq", "-o", str(saved), "--json")
    assert result.exit_code == 0, result.output
    loaded = fxprep.load(saved)
    assert loaded.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.float32
    fxprep.load_weights(loaded, checkpoint, dtype=torch.float32)
    longer = torch.randint(3, 128, (1, 23), generator=torch.Generator().manual_seed(2))
    model = tf.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=longer).logits, model(input_ids=longer, use_cache=False).logits)


@pytest.mark.parametrize(("args", "text"), [
    (["prepare", "torchvision:resnet18", "--meta"], "apply to a checkpoint directory"),
    (["--dtype", "int3"], "--dtype must be one of"),
    (["--device", "meta"], "use --meta"),
])
def test_checkpoint_usage_errors(checkpoint, args, text) -> None:
    if args[0] != "prepare":
        args = ["prepare", str(checkpoint), *args]
    result = invoke(*args)
    assert result.exit_code == 2 and text in result.output


@pytest.mark.parametrize("meta", [False, True], ids=["weights", "meta"])
def test_a_dual_encoder_checkpoint_gets_both_towers_inputs(tmp_path, meta: bool) -> None:
    """CLIP's forward fails on token ids alone (the only inputs the command gave): the inputs are
    now the first set the model runs on, tried on a ``meta`` twin, so ids and an image."""
    path = tmp_path / "clip"
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(path)
    result = invoke("prepare", str(path), "--json", *(["--meta"] if meta else []))
    assert result.exit_code == 0, result.output
    assert as_json(result)["report"]["verification"]["status"] == "passed"


def test_a_mixture_of_experts_checkpoint_in_the_hub_layout_prepares_on_meta(tmp_path) -> None:
    """``save_pretrained`` writes Mixtral's experts one tensor each (the hub's layout), the model
    holds one 3D tensor per layer: ``--meta`` then failed ("unexpected key(s)"), and the graph
    captured on ``meta`` could not count tokens per expert on the CPU."""
    path = tmp_path / "mixtral"
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    tf.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    saved = tmp_path / "out"
    result = invoke("prepare", str(path), "--meta", "-o", str(saved), "--json", "-i", "input_ids=1x16:int64")
    assert result.exit_code == 0, result.output
    assert as_json(result)["report"]["verification"]["status"] == "passed"
    loaded = fxprep.load(saved)
    fxprep.load_weights(loaded, path)
    model = tf.MixtralForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("meta", [False, True], ids=["weights", "meta"])
def test_a_checkpoint_whose_config_does_not_tell_its_inputs_is_told_to_name_them(tmp_path, meta: bool) -> None:
    """BLIP-2's config gives an image only; its forward also requires token ids. Preparing on the
    image ran every tracer into that and printed advice about opaque modules; the command now says
    what the model said to each input set it built and what the forward takes (exit 2)."""
    from fxprep.cli.tiny import tiny_config

    path = tmp_path / "blip2"
    tf.Blip2Model._from_config(tiny_config("blip-2"), dtype=torch.bfloat16).save_pretrained(path)
    result = invoke("prepare", str(path), "--json", *(["--meta"] if meta else []))
    assert result.exit_code == 2, result.output
    error = as_json(result)
    assert error["error_type"] == "InputsNotRun"
    message = error["error"]
    assert f"(tried on {'meta' if meta else 'cpu'})" in message
    assert "--input pixel_values=1x3x" in message and "missing 1 required positional argument: 'input_ids'" in message
    assert "Name its inputs with --input NAME=DIMS[:DTYPE]" in message
    assert "(required: pixel_values, input_ids)" in message
