"""``oneshot(..., pipeline="fxprep")`` gives the model ``pipeline="sequential"`` gives, bit for bit,
wherever llm-compressor's own subgraphs reproduce the model: GPTQ on dense, MoE (linearised by
oneshot) and vision-language models, in float32 and bfloat16, and every modifier whose hooks sit on
modules the graph calls (AWQ's on attention and MLP parents, SmoothQuant's on norms, static activation
observers on every Linear, the KV-cache observers on attention). A stage that handed a layer another
mask, or a hook that did not fire as in eager, changes the quantized weights and fails these tests.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers as tf
from compressed_tensors.offload import offload_module
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
from llmcompressor.pipelines.cache import IntermediatesCache

import fxprep.compat.llmcompressor as fxlc

from .lc_models import batches_loader, built, causal_lm, oneshot_state, states_equal, token_data


def gptq() -> GPTQModifier:
    return GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])


def both(make_model, recipe, data, **options) -> tuple[dict, dict]:
    """The quantized states of two fresh copies of a model, one per pipeline."""
    states = {}
    for pipeline in ("fxprep", "sequential"):
        states[pipeline] = oneshot_state(make_model(), recipe(), data, pipeline, **options)
    return states["fxprep"], states["sequential"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen2_moe"])
def test_gptq_w4a16_is_bit_identical(model_type):
    ours, theirs = both(lambda: causal_lm(model_type), gptq, token_data())
    assert any(k.endswith("weight_scale") for k in ours)  # quantized, with scales and zero points
    assert states_equal(ours, theirs) == []
    assert fxlc.last_capture().report.verification.status == "passed"


def test_gptq_bfloat16_is_bit_identical():
    ours, theirs = both(lambda: causal_lm("llama", dtype=torch.bfloat16), gptq, token_data())
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert states_equal(ours, theirs) == []


def _qwen2_vl() -> torch.nn.Module:
    vision = tf.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=128, num_heads=2, patch_size=14,
                                    spatial_merge_size=2, temporal_patch_size=2)
    text = tf.Qwen2VLTextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0})
    config = tf.Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=100,
                              video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    return tf.Qwen2VLForConditionalGeneration(config).eval()


def _image_batches() -> list[dict[str, torch.Tensor]]:
    """Three prompts, each with one image of another grid (16, 24, 24 patches: 4, 6, 6 image tokens)."""
    out = []
    for i, (h, w) in enumerate([(4, 4), (4, 6), (6, 4)]):
        ids = torch.tensor([[5 + i, 6, 102] + [100] * (h * w // 4) + [103, 7, 8]])
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_grid_thw": torch.tensor([[1, h, w]]),
                    "pixel_values": torch.randn(h * w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(i)),
                    "mm_token_type_ids": (ids == 100).int()})
    return out


def test_gptq_on_qwen2_vl_is_bit_identical():
    recipe = lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*visual.*"])  # noqa: E731
    ours, theirs = both(lambda: built(_qwen2_vl), recipe, batches_loader(_image_batches()))
    assert "model.language_model.layers.1.mlp.down_proj.weight_scale" in ours
    assert states_equal(ours, theirs) == []


@pytest.fixture
def no_pinning(monkeypatch):
    """AWQ pins cached activations (``Tensor.pin_memory``), which needs an accelerator: on this CPU
    machine pinning is made a no-op, for both pipelines alike (it only speeds up copies to a GPU)."""
    monkeypatch.setattr(IntermediatesCache, "_pin_intermediate", lambda self, intermediate: None)


STATIC_W8A8 = {"g": {"targets": ["Linear"],
                     "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                     "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                           "dynamic": False}}}
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
RECIPES = {
    "awq": lambda: [AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"])],
    "smoothquant+gptq-w8a8": lambda: [SmoothQuantModifier(smoothing_strength=0.8),
                                      GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
    "static-w8a8": lambda: QuantizationModifier(config_groups=STATIC_W8A8, ignore=["lm_head"]),
    "kv-cache-fp8": lambda: QuantizationModifier(kv_cache_scheme=KV_FP8),
}
# what each recipe must have calibrated (a modifier whose hooks never fired leaves these out or at their init)
CALIBRATED = {"awq": "model.layers.1.mlp.up_proj.weight_scale", "smoothquant+gptq-w8a8": "model.layers.0.mlp.up_proj.weight_scale",
              "static-w8a8": "model.layers.1.self_attn.o_proj.input_scale", "kv-cache-fp8": "model.layers.1.self_attn.k_scale"}


@pytest.mark.usefixtures("no_pinning")
@pytest.mark.parametrize("name", list(RECIPES))
def test_modifiers_hooking_called_modules_are_bit_identical(name):
    ours, theirs = both(lambda: causal_lm("llama"), RECIPES[name], token_data())
    assert CALIBRATED[name] in ours and bool(ours[CALIBRATED[name]].abs().sum() > 0)
    assert states_equal(ours, theirs) == []


def _on_disk(model: torch.nn.Module) -> torch.nn.Module:
    folder = tempfile.mkdtemp(prefix="fxprep-lc-offload-")
    for module in model.modules():
        if module._parameters or module._buffers:
            offload_module(module, "cpu", "disk", offload_dir=folder)
    return model


def test_disk_offloaded_model_is_captured_on_meta_and_checked_on_its_weights():
    ours, theirs = both(lambda: _on_disk(causal_lm("llama")), gptq, token_data())
    capture = fxlc.last_capture()
    assert capture.twin.device.type == "meta"  # nothing read from disk to capture
    assert capture.check is not None and capture.check.equal and capture.check.calls == 2
    assert states_equal(ours, theirs) == []
