"""The zoo's models: which ones, and how each is built at a small size with its example input.

Data shared by the zoo tests (tests/test_zoo.py, test_zoo_fx.py, test_reuse.py) and the benchmarks
that run the same models (benchmarks/allowlist_usage.py, load_bench.py); the tests' expectations
(known failures, subsets) stay in the test files.
"""

from __future__ import annotations

from typing import Any

import torch
import torchvision
import torchvision.models as tv_models
from torch import nn

from .helpers import TV_VIT_KWARGS


def _image(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------------
# torchvision, built for the Dynamo path (tests/test_zoo.py)
# --------------------------------------------------------------------------------------------------
TV_CLASSIFICATION = sorted(tv_models.list_models(module=tv_models))  # all 80
TV_SEGMENTATION = sorted(tv_models.list_models(module=tv_models.segmentation))
TV_VIDEO = sorted(tv_models.list_models(module=tv_models.video))
TV_FLOW = sorted(tv_models.list_models(module=tv_models.optical_flow))
TV_DETECTION = ["fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn", "ssdlite320_mobilenet_v3_large"]

TV_INPUT = {"inception_v3": 75, "maxvit_t": 224, "alexnet": 64}


def build_torchvision(name: str) -> tuple[nn.Module, Any]:
    from torchvision import models

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"weights": None, **TV_VIT_KWARGS.get(name, {})}
    if name in TV_SEGMENTATION or name in TV_DETECTION:
        kwargs["weights_backbone"] = None
    if name in ("googlenet", "inception_v3"):
        kwargs["init_weights"] = True
    model = models.get_model(name, **kwargs).eval()
    if name in TV_DETECTION:
        return model, ([_image(3, 64, 64)],)
    if name in TV_VIDEO:
        # MViT's positional embeddings fix 16x224x224; S3D pools over 16 frames; Swin3D needs 64 px.
        t, hw = (16, 224) if name.startswith(("mvit", "s3d")) else (4, 64) if name.startswith("swin3d") else (4, 32)
        return model, (_image(1, 3, t, hw, hw),)
    if name in TV_FLOW:
        return model, (_image(1, 3, 128, 128), _image(1, 3, 128, 128))
    size = TV_INPUT.get(name, 64 if name in TV_SEGMENTATION else 32)
    if name.startswith(("swin", "convnext", "regnet", "efficientnet", "mnasnet", "mobilenet", "densenet")):
        size = 64
    if "image_size" in TV_VIT_KWARGS.get(name, {}):
        size = TV_VIT_KWARGS[name]["image_size"]
    return model, (_image(1, 3, size, size),)


# --------------------------------------------------------------------------------------------------
# timm: one model per family, the smallest variant, at a small input where the family allows it
# --------------------------------------------------------------------------------------------------
# name -> (create_model kwargs, input side)
TIMM_FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    "beit": ("beit_base_patch16_224", {"img_size": 32, "depth": 2}, 32),
    "byoanet": ("halonet26t", {}, 256),
    "byobnet": ("gcresnet33ts", {}, 64),
    "cait": ("cait_xxs24_224", {"img_size": 32, "depth": 2}, 32),
    "coat": ("coat_lite_tiny", {"img_size": 64}, 64),
    "convit": ("convit_tiny", {"img_size": 32}, 32),
    "convmixer": ("convmixer_768_32", {}, 32),
    "convnext": ("convnext_atto", {}, 64),
    "crossvit": ("crossvit_tiny_240", {}, 240),
    "cspnet": ("cspresnet50", {}, 64),
    "davit": ("davit_tiny", {}, 64),
    "deit": ("deit_tiny_patch16_224", {"img_size": 32}, 32),
    "densenet": ("densenet121", {}, 64),
    "dla": ("dla34", {}, 64),
    "dpn": ("dpn48b", {}, 64),
    "edgenext": ("edgenext_xx_small", {}, 64),
    "efficientformer": ("efficientformer_l1", {}, 224),
    "efficientformer_v2": ("efficientformerv2_s0", {}, 224),
    "efficientnet": ("efficientnet_b0", {}, 64),
    "efficientvit_mit": ("efficientvit_b0", {}, 64),
    "efficientvit_msra": ("efficientvit_m0", {}, 224),
    "eva": ("eva02_tiny_patch14_224", {"img_size": 28}, 28),
    "fastvit": ("fastvit_t8", {}, 64),
    "focalnet": ("focalnet_tiny_srf", {}, 64),
    "gcvit": ("gcvit_xxtiny", {}, 224),
    "ghostnet": ("ghostnet_050", {}, 64),
    "hgnet": ("hgnetv2_b0", {}, 64),
    "hiera": ("hiera_tiny_224", {}, 224),
    "hrnet": ("hrnet_w18_small", {}, 64),
    "inception_next": ("inception_next_atto", {}, 64),
    "inception_v3": ("inception_v3", {}, 75),
    "levit": ("levit_128s", {}, 224),
    "maxxvit": ("coatnet_nano_rw_224", {}, 224),
    "metaformer": ("poolformer_s12", {}, 64),
    "mlp_mixer": ("mixer_s32_224", {"img_size": 64}, 64),
    "mobilenetv3": ("mobilenetv3_small_050", {}, 64),
    "mobilevit": ("mobilevit_xxs", {}, 64),
    "mvitv2": ("mvitv2_tiny", {}, 224),
    "nest": ("nest_tiny", {"img_size": 64}, 64),
    "nfnet": ("nfnet_l0", {}, 64),
    "pit": ("pit_ti_224", {"img_size": 64}, 64),
    "pvt_v2": ("pvt_v2_b0", {}, 64),
    "rdnet": ("rdnet_tiny", {}, 64),
    "regnet": ("regnetx_002", {}, 64),
    "repghost": ("repghostnet_050", {}, 64),
    "repvit": ("repvit_m0_9", {}, 64),
    "res2net": ("res2net50_14w_8s", {}, 64),
    "resnest": ("resnest14d", {}, 64),
    "resnet": ("resnet18", {}, 64),
    "resnetv2": ("resnetv2_18", {}, 64),
    "rexnet": ("rexnet_100", {}, 64),
    "selecsls": ("selecsls42b", {}, 64),
    "senet": ("legacy_seresnet18", {}, 64),
    "sequencer": ("sequencer2d_s", {}, 64),
    "sknet": ("skresnet18", {}, 64),
    "starnet": ("starnet_s050", {}, 64),
    "swiftformer": ("swiftformer_xs", {}, 224),
    "swin_transformer": ("swin_tiny_patch4_window7_224", {"img_size": 56, "window_size": 7}, 56),
    "swin_transformer_v2": ("swinv2_tiny_window8_256", {"img_size": 64, "window_size": 4}, 64),
    "tiny_vit": ("tiny_vit_5m_224", {}, 224),
    "tnt": ("tnt_s_patch16_224", {"img_size": 32}, 32),
    "tresnet": ("tresnet_m", {}, 64),
    "twins": ("twins_svt_small", {}, 64),
    "vgg": ("vgg11", {}, 64),
    "visformer": ("visformer_tiny", {}, 224),
    "vision_transformer": ("vit_tiny_patch16_224", {"img_size": 32}, 32),
    "vision_transformer_hybrid": ("vit_tiny_r_s16_p8_224", {"img_size": 64}, 64),
    "vision_transformer_relpos": ("vit_relpos_small_patch16_224", {"img_size": 32}, 32),
    "vision_transformer_sam": ("samvit_base_patch16", {"img_size": 64, "depth": 2}, 64),
    "volo": ("volo_d1_224", {"img_size": 64}, 64),
    "vovnet": ("ese_vovnet19b_dw", {}, 64),
    "xception_aligned": ("xception41", {}, 64),
    "xception": ("legacy_xception", {}, 75),
    "cpubone": ("cpubone_nano", {}, 64),
    "csatv2": ("csatv2", {}, 64),
    "deepseek_vit": ("deepseek_vit_412m", {"depth": 2, "img_size": 28}, 28),
    "efficientvim": ("efficientvim_m1", {}, 64),
    "gemma4_vit": ("gemma4_vit_167m", {"depth": 2}, 64),
    "hardcorenas": ("hardcorenas_a", {}, 64),
    "hieradet_sam2": ("hieradet_small", {}, 64),
    "iformer": ("iformer_t", {}, 64),
    "inception_resnet_v2": ("inception_resnet_v2", {}, 75),
    "inception_v4": ("inception_v4", {}, 75),
    "lowformer": ("lowformer_b0", {}, 64),
    "mobilenetv5": ("mobilenetv5_base", {}, 64),
    "naflexvit": ("naflexvit_base_patch16_gap", {"depth": 2}, 32),
    "nasnet": ("nasnetalarge", {}, 96),
    "pnasnet": ("pnasnet5large", {}, 96),
    "qwen3_vit": ("qwen3_vit_88m", {"depth": 2}, 32),
    "xcit": ("xcit_nano_12_p16_224", {"img_size": 64}, 64),
    "cspnext": ("cspnext_tiny", {}, 64),
    "fasternet": ("fasternet_t0", {}, 64),
    "lcnetv2": ("lcnetv2_small", {}, 64),
    "mambaout": ("mambaout_femto", {}, 64),
    "shvit": ("shvit_s1", {}, 224),
    "swin_transformer_v2_cr": ("swinv2_cr_tiny_224", {"img_size": 64, "window_size": 4}, 64),
    "vitamin": ("vitamin_small_224", {"img_size": 64}, 64),
    "nextvit": ("nextvit_small", {}, 64),
}


def build_timm(family: str) -> tuple[nn.Module, Any]:
    import timm

    name, kwargs, size = TIMM_FAMILIES[family]
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).eval()
    return model, (_image(1, 3, size, size),)


# --------------------------------------------------------------------------------------------------
# transformers: tiny configs, random weights, inputs from fxprep.families.transformers.model
# --------------------------------------------------------------------------------------------------
TINY = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=64, num_key_value_heads=1, image_size=32, patch_size=8, d_model=32, d_ff=64,
    num_layers=2, num_heads=2, d_kv=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, n_embd=32, n_layer=2, n_head=2,
    n_positions=64, head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
)
# special token ids of the real vocabularies do not fit a 99-token one
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2, "sep_token_id": 2,
             "cls_token_id": 1, "start_token_id": 1, "unk_token_id": 3, "mask_token_id": 4}
# model type -> (auto class, extra config kwargs)
HF_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # encoders
    "bert": ("AutoModel", {}), "roberta": ("AutoModel", {}), "distilbert": ("AutoModel", {"dim": 32, "hidden_dim": 37, "n_layers": 2}),
    "albert": ("AutoModel", {}), "electra": ("AutoModel", {}), "deberta": ("AutoModel", {}),
    "deberta-v2": ("AutoModel", {}), "xlm-roberta": ("AutoModel", {}), "camembert": ("AutoModel", {}),
    "mpnet": ("AutoModel", {}), "mobilebert": ("AutoModel", {"embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32}),
    "squeezebert": ("AutoModel", {"embedding_size": 32}), "convbert": ("AutoModel", {}), "megatron-bert": ("AutoModel", {}),
    "roformer": ("AutoModel", {}), "ernie": ("AutoModel", {}), "data2vec-text": ("AutoModel", {}),
    "esm": ("AutoModel", {"pad_token_id": 1}), "modernbert": ("AutoModel", {}), "nystromformer": ("AutoModel", {}),
    "rembert": ("AutoModel", {"input_embedding_size": 32, "output_embedding_size": 32}),
    "xlm-roberta-xl": ("AutoModel", {}), "layoutlm": ("AutoModel", {}),
    # decoders
    "gpt2": ("AutoModelForCausalLM", {}), "openai-gpt": ("AutoModelForCausalLM", {}),
    "gpt_neo": ("AutoModelForCausalLM", {"attention_types": [[["global", "local"], 1]], "num_layers": 2}),
    "gptj": ("AutoModelForCausalLM", {"rotary_dim": 8}), "gpt_neox": ("AutoModelForCausalLM", {}),
    "gpt_bigcode": ("AutoModelForCausalLM", {}), "codegen": ("AutoModelForCausalLM", {"rotary_dim": 4, "n_head": 4}),
    "opt": ("AutoModelForCausalLM", {"ffn_dim": 37, "word_embed_proj_dim": 32}), "bloom": ("AutoModelForCausalLM", {}),
    "biogpt": ("AutoModelForCausalLM", {}), "llama": ("AutoModelForCausalLM", {}), "mistral": ("AutoModelForCausalLM", {}),
    "mixtral": ("AutoModelForCausalLM", {}), "qwen2": ("AutoModelForCausalLM", {}), "qwen3": ("AutoModelForCausalLM", {}),
    "qwen2_moe": ("AutoModelForCausalLM", {}), "phi": ("AutoModelForCausalLM", {}), "phi3": ("AutoModelForCausalLM", {}),
    "gemma": ("AutoModelForCausalLM", {}), "gemma2": ("AutoModelForCausalLM", {}), "gemma3_text": ("AutoModelForCausalLM", {}),
    "falcon": ("AutoModelForCausalLM", {}), "starcoder2": ("AutoModelForCausalLM", {}), "stablelm": ("AutoModelForCausalLM", {}),
    "olmo": ("AutoModelForCausalLM", {}), "olmo2": ("AutoModelForCausalLM", {}), "cohere": ("AutoModelForCausalLM", {}),
    "granite": ("AutoModelForCausalLM", {}), "glm": ("AutoModelForCausalLM", {}), "helium": ("AutoModelForCausalLM", {}),
    "smollm3": ("AutoModelForCausalLM", {}), "persimmon": ("AutoModelForCausalLM", {}), "xglm": ("AutoModelForCausalLM", {}),
    "ctrl": ("AutoModelForCausalLM", {"dff": 37}), "mpt": ("AutoModelForCausalLM", {}),
    # encoder-decoders
    "t5": ("AutoModelForSeq2SeqLM", {}), "mt5": ("AutoModelForSeq2SeqLM", {}), "bart": ("AutoModelForSeq2SeqLM", {}),
    "mbart": ("AutoModelForSeq2SeqLM", {}), "pegasus": ("AutoModelForSeq2SeqLM", {}), "marian": ("AutoModelForSeq2SeqLM", {}),
    "blenderbot": ("AutoModelForSeq2SeqLM", {}), "m2m_100": ("AutoModelForSeq2SeqLM", {}),
    # vision
    "vit": ("AutoModelForImageClassification", {}), "deit": ("AutoModel", {}),
    "beit": ("AutoModelForImageClassification", {}),
    "swin": ("AutoModelForImageClassification", {"depths": [1, 1], "num_heads": [1, 2], "window_size": 2, "patch_size": 4}),
    "convnext": ("AutoModelForImageClassification", {"hidden_sizes": [8, 16], "depths": [1, 1]}),
    "resnet": ("AutoModelForImageClassification", {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8}),
    "mobilevit": ("AutoModelForImageClassification", {"image_size": 64, "hidden_sizes": [16, 24, 32], "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64]}),
    "clip": ("AutoModel", {  # CLIPModel: text and vision towers, both inputs, CLIPOutput
        "text_config": {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "max_position_embeddings": 64, **TOKEN_IDS},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        "projection_dim": 16}),
    "segformer": ("AutoModel", {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [8, 16],
                                "patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 2], "mlp_ratios": [2, 2]}),
    "dinov2": ("AutoModel", {}),
    "regnet": ("AutoModelForImageClassification", {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8, "groups_width": 8}),
    "poolformer": ("AutoModelForImageClassification", {"hidden_sizes": [8, 16, 24, 32], "depths": [1, 1, 1, 1]}),
    "bit": ("AutoModelForImageClassification", {"hidden_sizes": [32, 64], "depths": [1, 1], "embedding_size": 32, "num_groups": 2}),
    "convnextv2": ("AutoModelForImageClassification", {"hidden_sizes": [8, 16], "depths": [1, 1]}),
    # audio
    "whisper": ("AutoModel", {"num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 16}),
    "wav2vec2": ("AutoModel", {"conv_dim": [8, 8], "conv_stride": [5, 4], "conv_kernel": [10, 8],
                           "num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 2}),
    "hubert": ("AutoModel", {"conv_dim": [8, 8], "conv_stride": [5, 4], "conv_kernel": [10, 8],
                           "num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 2}),
}


def tiny_config(model_type: str, extra: dict[str, Any]) -> Any:
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    known = set(defaults.to_dict()) | set(getattr(defaults, "attribute_map", {}))
    aliases = getattr(defaults, "attribute_map", {})
    kwargs = {k: v for k, v in TINY.items() if k in known and aliases.get(k) not in extra}
    kwargs.update({k: v for k, v in TOKEN_IDS.items() if isinstance(getattr(defaults, k, None), int)})
    kwargs.update(extra)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    return config


def build_hf(model_type: str) -> tuple[nn.Module, Any]:
    import transformers

    from fxprep.families.transformers.model import example_inputs_for

    auto, extra = HF_ARCHS[model_type]
    config = tiny_config(model_type, extra)
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config).eval()
    example = example_inputs_for(model, batch=1, seq_len=8)
    assert example is not None
    return model, example


# --------------------------------------------------------------------------------------------------
# torchvision, built for the fx path (tests/test_zoo_fx.py), in eval or train mode
# --------------------------------------------------------------------------------------------------
ALL_MODELS: list[str] = sorted(torchvision.models.list_models(module=torchvision.models))

# Smallest input each architecture accepts (default 64x64: five stride-2 stages leave a 2x2 map).
INPUT_SIZE: dict[str, int] = {
    "inception_v3": 75,  # its stem needs >= 75 pixels
    "maxvit_t": 224,  # partition_size 7 must divide every stage: 224 / 32 = 7
}
# In train mode inception_v3's auxiliary head pools 5x5 over Mixed_6e, which is 17x17 only at 299.
TRAIN_INPUT_SIZE: dict[str, int] = {"inception_v3": 299}


def build_fx(name: str, training: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """The model (weights=None, seeded init, in the requested mode) and its smallest valid input;
    batch 2 in train mode, where BatchNorm needs more than one value per channel."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, **TV_VIT_KWARGS.get(name, {})).train(training)
    size = (TRAIN_INPUT_SIZE if training else INPUT_SIZE).get(name, INPUT_SIZE.get(name, 64))
    batch = 2 if training else 1
    if "image_size" in TV_VIT_KWARGS.get(name, {}):
        size = TV_VIT_KWARGS[name]["image_size"]
    return model, torch.randn(batch, 3, size, size)
