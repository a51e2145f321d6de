"""More tiny vision-language models, in the style of :mod:`tests.vlm_models` (random weights, built
from config classes, ``input_ids`` holding exactly as many image tokens as the vision tower makes):
the Qwen3-VL family, GLM-4V, anyres Llava-Next / OneVision, InternVL, PaliGemma, SmolVLM, Aya
Vision, Gemma3n (a timm MobileNetV5 tower) and LFM2-VL (NaFlex patches)."""

from __future__ import annotations

import torch
import transformers as tf

from .vlm_models import IMG, V, _g, _ids, text_common

MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}  # head_dim 16


def _qwen_grid_inputs(grid, patch, temporal=2):
    """pixel_values (n_patches, 3*T*p*p) for ``grid`` and ids with prod(grid)/4 image tokens per image."""
    n_patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(n_patches, 3 * temporal * patch * patch, generator=_g(1))
    ids = [5, 6]
    for t, h, w in grid.tolist():
        ids += [102] + [IMG] * (t * h * w // 4) + [103, 7]
    ids = torch.tensor([ids + [8, 9]])
    return ids, pixel_values


def _qwen_grid_call(patch: int) -> dict[str, torch.Tensor]:
    """The Qwen-style keyword inputs: two images of 4x4 and 4x6 patches (16 + 24 -> 4 + 6 tokens)."""
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    ids, pixel_values = _qwen_grid_inputs(grid, patch)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
            "image_grid_thw": grid, "mm_token_type_ids": (ids == IMG).int()}


def qwen3_vl():
    vision = tf.Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                    num_position_embeddings=64, deepstack_visual_indexes=[0])
    text = tf.Qwen3VLTextConfig(**text_common(head_dim=16, rope_parameters=dict(MROPE, mrope_interleaved=True)))
    cfg = tf.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                           video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = tf.Qwen3VLForConditionalGeneration(cfg).eval()
    return model, _qwen_grid_call(16)


def qwen3_vl_moe():
    vision = tf.Qwen3VLMoeVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                       num_position_embeddings=64, deepstack_visual_indexes=[0])
    text = tf.Qwen3VLMoeTextConfig(**text_common(head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                 num_experts_per_tok=2, decoder_sparse_step=1,
                                                 rope_parameters=dict(MROPE, mrope_interleaved=True)))
    cfg = tf.Qwen3VLMoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                              video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = tf.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    return model, _qwen_grid_call(16)


def glm4v():
    vision = tf.Glm4vVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=56, patch_size=14,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
    text = tf.Glm4vTextConfig(**text_common(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}))
    cfg = tf.Glm4vConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                         video_token_id=101, image_start_token_id=102, image_end_token_id=103,
                         video_start_token_id=104, video_end_token_id=105)
    model = tf.Glm4vForConditionalGeneration(cfg).eval()
    return model, _qwen_grid_call(14)


def internvl():
    vision = tf.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=[32, 32], patch_size=[8, 8])
    text = tf.Qwen2Config(**text_common())
    cfg = tf.InternVLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=IMG,
                            image_seq_length=4, downsample_ratio=0.5, vision_feature_layer=-1,
                            vision_feature_select_strategy="default")
    model = tf.InternVLForConditionalGeneration(cfg).eval()
    # two tiles 32x32: 4x4 patches (+cls dropped) -> pixel shuffle 0.5 -> 2x2 = 4 tokens per tile
    pixel_values = torch.randn(2, 3, 32, 32, generator=_g(1))
    ids = _ids(3, 8, 3, extra_before=[102], extra_after=[103])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values}


def paligemma():
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8, vision_use_head=False)
    text = tf.GemmaConfig(**text_common(head_dim=16))
    cfg = tf.PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                             vocab_size=V, projection_dim=64, hidden_size=64)
    model = tf.PaliGemmaForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 32, 32, generator=_g(1))  # 4x4 = 16 image tokens
    ids = torch.cat([torch.full((1, 16), IMG), _ids(4, 0, 3)], dim=1)  # image first, then prompt + suffix
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, -3:] = 1  # prefix (image + prompt) bidirectional, suffix causal
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "token_type_ids": token_type_ids}


def smolvlm():
    vision = tf.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8)
    text = tf.LlamaConfig(**text_common())
    cfg = tf.SmolVLMConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=IMG, scale_factor=2)
    model = tf.SmolVLMForConditionalGeneration(cfg).eval()
    # (batch, num_images, C, H, W); 16 patches per image -> scale 2 -> 4 tokens per image
    pixel_values = torch.randn(1, 2, 3, 32, 32, generator=_g(1))
    ids = _ids(3, 8, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "pixel_attention_mask": torch.ones(1, 2, 32, 32, dtype=torch.bool)}


def aya_vision():
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8, vision_use_head=False)
    text = tf.Cohere2Config(**text_common(sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    cfg = tf.AyaVisionConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                             downsample_factor=2, vision_feature_layer=-1, vision_feature_select_strategy="full")
    model = tf.AyaVisionForConditionalGeneration(cfg).eval()
    # two tiles 32x32: 4x4 patches -> pixel shuffle 2 -> 4 tokens per tile
    pixel_values = torch.randn(2, 3, 32, 32, generator=_g(1))
    ids = _ids(3, 8, 3, extra_before=[102], extra_after=[103])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values}


# image 20x64 px -> best pinpoint (32, 64) -> base tile + 1x2 tiles of 32x32 (4x4 patches each); the 4x8 grid is
# unpadded to 2x8 and gets a newline column: 16 (base) + 2 * 9 = 34 image tokens.
ANYRES_PINPOINTS = [[32, 64], [64, 32], [64, 64]]
ANYRES_TOKENS = 34


def llava_next():
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=32, patch_size=8, projection_dim=32)
    text = tf.MistralConfig(**text_common(head_dim=16))
    cfg = tf.LlavaNextConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                             vision_feature_layer=-2, vision_feature_select_strategy="default",
                             image_grid_pinpoints=ANYRES_PINPOINTS, image_seq_length=16)
    model = tf.LlavaNextForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 3, 32, 32, generator=_g(1))  # (batch, tiles, C, H, W)
    ids = _ids(3, ANYRES_TOKENS, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "image_sizes": torch.tensor([[20, 64]])}


def llava_onevision():
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8, vision_use_head=False)
    text = tf.Qwen2Config(**text_common())
    cfg = tf.LlavaOnevisionConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG,
                                  video_token_index=101, vision_feature_layer=-1, vision_feature_select_strategy="full",
                                  image_grid_pinpoints=ANYRES_PINPOINTS, vision_aspect_ratio="anyres_max_9")
    model = tf.LlavaOnevisionForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 3, 32, 32, generator=_g(1))
    ids = _ids(3, ANYRES_TOKENS, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "image_sizes": torch.tensor([[20, 64]])}


def qwen3_5():
    vision = tf.Qwen3_5VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                    num_position_embeddings=64)
    # hybrid text: one Gated-DeltaNet (linear attention) layer + one full-attention layer
    text = tf.Qwen3_5TextConfig(**text_common(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                              linear_value_head_dim=16, linear_num_key_heads=2,
                                              linear_num_value_heads=4,
                                              layer_types=["linear_attention", "full_attention"],
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5,
                                                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}))
    cfg = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMG,
                           video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    return model, _qwen_grid_call(16)


# Gemma3n token layout (as in the release, scaled down): text ids < 128, vision ids 128..135, audio ids 136..143.
G3N_TEXT_VOCAB, G3N_VISION_OFFSET, G3N_AUDIO_OFFSET = 128, 128, 136
G3N_BOI, G3N_EOI, G3N_IMG = 127, 128, 129
# small MobileNetV5 encoder (same block kinds as mobilenetv5_300m_enc: edge residual, universal inverted residual,
# multi-query attention); 128x128 px -> /32 -> 4x4, MSFA pools to 2x2 = 4 soft tokens of 2048 channels (fixed in timm)
G3N_ARCH = [
    ["er_r1_k3_s2_e4_c16"],
    ["uir_r1_a3_k5_s2_e6_c24"],
    ["uir_r1_a5_k5_s2_e6_c32", "mqa_r1_k3_h2_v2_s1_d16_c32", "uir_r1_a0_k0_s1_e2_c32"],
    ["uir_r1_a5_k5_s2_e6_c48", "mqa_r1_k3_h2_s1_d16_c48", "uir_r1_a0_k0_s1_e2_c48"],
]


def gemma3n():
    from timm.models._efficientnet_builder import decode_arch_def

    vision = tf.Gemma3nVisionConfig(hidden_size=2048, vocab_size=8, vocab_offset=G3N_VISION_OFFSET,
                                    model_args={"block_args": decode_arch_def(G3N_ARCH), "stem_size": 16,
                                                "msfa_output_resolution": 2})
    audio = tf.Gemma3nAudioConfig(vocab_size=8, vocab_offset=G3N_AUDIO_OFFSET, input_feat_size=16, hidden_size=32,
                                  conf_num_attention_heads=2, conf_num_hidden_layers=1,
                                  sscp_conv_channel_size=[8, 8])
    text = tf.Gemma3nTextConfig(vocab_size=144, vocab_size_per_layer_input=G3N_TEXT_VOCAB, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                hidden_size_per_layer_input=16, laurel_rank=8, altup_num_inputs=4,
                                activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
                                pad_token_id=0, bos_token_id=2, eos_token_id=1)
    cfg = tf.Gemma3nConfig(text_config=text, vision_config=vision, audio_config=audio,
                           vision_soft_tokens_per_image=4, audio_soft_tokens_per_image=4,
                           boi_token_id=G3N_BOI, eoi_token_id=G3N_EOI, image_token_id=G3N_IMG,
                           boa_token_id=126, eoa_token_id=G3N_AUDIO_OFFSET, audio_token_id=G3N_AUDIO_OFFSET + 1)
    model = tf.Gemma3nForConditionalGeneration(cfg).eval()
    pixel_values = torch.randn(1, 3, 128, 128, generator=_g(1))
    ids = _ids(3, 4, 3, img=G3N_IMG, extra_before=[G3N_BOI], extra_after=[G3N_EOI])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "token_type_ids": (ids == G3N_IMG).long()}


def lfm2_vl():
    vision = tf.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    patch_size=8, num_patches=16, vision_use_head=False)
    text = tf.Lfm2Config(**text_common(layer_types=["conv", "full_attention"], block_multiple_of=32,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    cfg = tf.Lfm2VlConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=IMG,
                          projector_hidden_size=64, downsample_factor=2)
    model = tf.Lfm2VlForConditionalGeneration(cfg).eval()
    # NaFlex: two images of 4x4 and 4x6 patches (8 px), padded to 24 patches -> unshuffle 2 -> 4 + 6 tokens
    spatial_shapes = torch.tensor([[4, 4], [4, 6]])
    pixel_values = torch.randn(2, 24, 3 * 8 * 8, generator=_g(1))
    pixel_attention_mask = torch.zeros(2, 24, dtype=torch.bool)
    pixel_attention_mask[0, :16] = True
    pixel_attention_mask[1, :24] = True
    pixel_values[0, 16:] = 0
    ids = torch.tensor([[5, 6, 102] + [IMG] * 4 + [103, 7, 102] + [IMG] * 6 + [103, 8, 9]])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
                   "spatial_shapes": spatial_shapes, "pixel_attention_mask": pixel_attention_mask}


def llava_clip():
    """Llava 1.5's layout: a CLIP tower, one 32 px image (4x4 patches, the CLS token dropped: 16 tokens)."""
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=32, patch_size=8, projection_dim=32)
    cfg = tf.LlavaConfig(vision_config=vision.to_dict(), text_config=tf.LlamaConfig(**text_common()).to_dict(),
                         image_token_index=IMG, vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=16)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    ids = _ids(3, 16, 3)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "pixel_values": torch.randn(1, 3, 32, 32, generator=_g(1))}


BUILDERS = {f.__name__: f for f in (qwen3_vl, qwen3_vl_moe, glm4v, internvl, paligemma, smolvlm, aya_vision, llava_next,
                                    llava_onevision, qwen3_5, gemma3n, lfm2_vl, llava_clip)}
