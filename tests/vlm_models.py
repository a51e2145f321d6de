"""Tiny vision-language models built from their config classes (no hub), with realistic inputs.

Each builder returns the model (eval mode, random weights) and its keyword inputs: ``input_ids``
with as many image tokens as the vision tower makes from ``pixel_values`` (after merging / pixel
shuffle), and ``image_grid_thw`` / ``image_sizes`` / aspect-ratio inputs where the model takes them.
"""

from __future__ import annotations

import inspect

import torch
import transformers as tf

V = 128  # vocab
IMG = 100  # image token id

def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)

def _ids(n_text_before, n_img, n_text_after, batch=1, img=IMG, seed=0, extra_before=(), extra_after=()):
    g = _g(seed)
    rows = []
    for _ in range(batch):
        a = torch.randint(1, 90, (n_text_before,), generator=g).tolist()
        c = torch.randint(1, 90, (n_text_after,), generator=g).tolist()
        rows.append(a + list(extra_before) + [img] * n_img + list(extra_after) + c)
    return torch.tensor(rows)

def text_common(**kw):
    d = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    d.update(kw)
    return d

def qwen2_vl():
    vision = tf.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                    spatial_merge_size=2, temporal_patch_size=2)
    text = tf.Qwen2VLTextConfig(**text_common(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}))
    cfg = tf.Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                           video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = tf.Qwen2VLForConditionalGeneration(cfg).eval()
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # 16 + 24 patches -> 4 + 6 tokens
    n_patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(n_patches, 3 * 2 * 14 * 14, generator=_g(1))
    ids = torch.tensor([[5, 6, 102] + [IMG] * 4 + [103, 7, 102] + [IMG] * 6 + [103, 8, 9]])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values, "image_grid_thw": grid,
                   "mm_token_type_ids": (ids == IMG).int()}

def qwen2_5_vl():
    vision = tf.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                       window_size=56, fullatt_block_indexes=[1])
    text = tf.Qwen2_5_VLTextConfig(**text_common(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}))
    cfg = tf.Qwen2_5_VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                              video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    grid = torch.tensor([[1, 8, 8]])  # 64 patches -> 16 tokens; window 56px = 4 patches = 2 merged
    n_patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(n_patches, 3 * 2 * 14 * 14, generator=_g(1))
    ids = torch.tensor([[5, 6, 102] + [IMG] * 16 + [103, 8, 9]])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values, "image_grid_thw": grid,
                   "mm_token_type_ids": (ids == IMG).int()}

def pixtral_vision(**kw):
    d = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
             patch_size=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    d.update(kw)
    return tf.PixtralVisionConfig(**d)

def llava_pixtral():
    vision = pixtral_vision()
    text = tf.MistralConfig(**text_common(head_dim=16))
    cfg = tf.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                         vision_feature_layer=-1, vision_feature_select_strategy="full", image_seq_length=1)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    # one image 32x48 px (padded to 48x48): 4x6 = 24 patch tokens
    pixel_values = torch.randn(1, 3, 48, 48, generator=_g(1))
    image_sizes = torch.tensor([[32, 48]])
    ids = _ids(3, 24, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values, "image_sizes": image_sizes}

def mistral3():
    vision = pixtral_vision()
    text = tf.MistralConfig(**text_common(head_dim=16))
    cfg = tf.Mistral3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                            spatial_merge_size=2, vision_feature_layer=-1)
    model = tf.Mistral3ForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 48, 48, generator=_g(1))
    image_sizes = torch.tensor([[32, 48]])  # 4x6 patches -> merged 2x3 = 6 tokens
    ids = _ids(3, 6, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values, "image_sizes": image_sizes}

def idefics3():
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=32, patch_size=8)
    text = tf.LlamaConfig(**text_common())
    cfg = tf.Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=IMG, scale_factor=2)
    model = tf.Idefics3ForConditionalGeneration(cfg).eval()
    # (batch, num_images, C, H, W); 16 patches per image -> scale 2 -> 4 tokens per image
    pixel_values = torch.randn(1, 2, 3, 32, 32, generator=_g(1))
    ids = _ids(3, 8, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "pixel_attention_mask": torch.ones(1, 2, 32, 32, dtype=torch.bool)}

def mllama():
    vision = tf.MllamaVisionConfig(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                                   intermediate_size=64, vision_output_dim=64, image_size=28, patch_size=14,
                                   max_num_tiles=2, intermediate_layers_indices=[0],
                                   supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = tf.MllamaTextConfig(**text_common(num_hidden_layers=3, cross_attention_layers=[1],
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    cfg = tf.MllamaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG)
    model = tf.MllamaForConditionalGeneration(cfg).eval()
    # (batch, num_images, num_tiles, C, H, W)
    pixel_values = torch.randn(1, 1, 2, 3, 28, 28, generator=_g(1))
    ids = _ids(2, 1, 5)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "aspect_ratio_ids": torch.tensor([[2]]), "aspect_ratio_mask": torch.tensor([[[1, 1]]]),
                   "cross_attention_mask": torch.ones(1, ids.shape[1], 1, 2, dtype=torch.long)}

def gemma3():
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    text = tf.Gemma3TextConfig(**text_common(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                             layer_types=["sliding_attention", "full_attention"]))
    cfg = tf.Gemma3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=102, eoi_token_index=103, image_token_index=IMG)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 32, 32, generator=_g(1))
    ids = _ids(3, 4, 3, extra_before=[102], extra_after=[103])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "token_type_ids": (ids == IMG).long()}

def _llama4_text_output_class():
    """``MoeCausalLMOutputWithPast`` with the ``image_outputs`` field the multimodal forward reads.

    transformers 5.24's ``Llama4ForConditionalGeneration.forward`` ends with
    ``image_outputs=outputs.image_outputs`` on its language model's output, which has no such
    field, so every call of the model fails. Its language model is given this output class (and
    nothing else changes) so the whole model, vision tower to MoE text, runs and can be prepared."""
    from dataclasses import dataclass
    from typing import Any

    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    @dataclass
    class WithImageOutputs(MoeCausalLMOutputWithPast):
        image_outputs: Any = None

    class Llama4TextWithImageOutputs(tf.Llama4ForCausalLM):
        def forward(self, *args, **kwargs):
            return WithImageOutputs(**super().forward(*args, **kwargs))

    return Llama4TextWithImageOutputs


def llama4(*, as_released: bool = False):
    """``as_released``: the model exactly as this transformers builds it (see
    :func:`_llama4_text_output_class`: it may fail on every call)."""
    vision = tf.Llama4VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                   vision_output_dim=32, image_size=28, patch_size=14, pixel_shuffle_ratio=0.5,
                                   projector_input_dim=32, projector_output_dim=32,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    text = tf.Llama4TextConfig(**text_common(head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
                                             num_experts_per_tok=1, interleave_moe_layer_step=1,
                                             attention_chunk_size=16, no_rope_layer_interval=2,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    cfg = tf.Llama4Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                          boi_token_index=102, eoi_token_index=103)
    model = tf.Llama4ForConditionalGeneration(cfg).eval()
    if not as_released and "outputs.image_outputs" in inspect.getsource(tf.Llama4ForConditionalGeneration.forward):
        model.language_model.__class__ = _llama4_text_output_class()
    # 28/14 = 2x2 patches (+ cls dropped) -> pixel shuffle 0.5 -> 1 token per tile
    pixel_values = torch.randn(1, 3, 28, 28, generator=_g(1))
    ids = _ids(3, 1, 3, extra_before=[102], extra_after=[103])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values}

BUILDERS = {f.__name__: f for f in (llava_pixtral, qwen2_vl, qwen2_5_vl, mistral3, idefics3, mllama, gemma3, llama4)}
