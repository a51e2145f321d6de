"""``transformers:TYPE`` builds a tiny model at every level of a composite config.

The spec's config used to shrink the top level only: a VLM's language model and vision tower, an
encoder-decoder's two halves and a mixture of experts' experts kept their real sizes, so
``fxprep prepare transformers:llava`` allocated 7 billion parameters (and was killed), Mixtral's
experts failed on their grouped matmuls, and Qwen3.5-MoE kept no full-attention layer. Sizes are
counted on ``meta`` (no memory); the end-to-end runs build the real (tiny) models.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

from fxprep import cli
from fxprep.cli import specs
from fxprep.cli.tiny import tiny_config


def _meta_params(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    return sum(p.numel() for p in model.parameters())


# composite configs (a language model, a vision tower, two halves) and mixtures of experts: each was
# billions of parameters from the old spec (llava 6.9e9, qwen2_vl 7.2e10, t5gemma 5.6e9, gemma3 2.7e9)
@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "t5gemma", "gemma3", "mixtral", "deepseek_v3", "qwen3_moe"])
def test_every_level_is_tiny(model_type: str) -> None:
    config = tiny_config(model_type)
    assert _meta_params(config) < 3_000_000
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, transformers.PretrainedConfig) and "hidden_size" in sub.to_dict():
            assert sub.hidden_size == 32, name


def test_layer_kinds_survive_the_cut() -> None:
    """Two layers keep one of each kind, in order: a sliding-window and a full-attention layer."""
    text = tiny_config("gemma3").text_config
    assert text.num_hidden_layers == 2
    assert text.layer_types == ["sliding_attention", "full_attention"]


def test_experts_are_few_and_aligned() -> None:
    config = tiny_config("mixtral")
    assert config.num_local_experts == 4 and config.num_experts_per_tok == 2
    assert (config.intermediate_size * 2) % 16 == 0  # grouped matmul rows of 16 bytes, in bf16 too


def test_a_config_whose_model_does_not_build_gives_way_to_the_next() -> None:
    """Some sizes transformers checks only when it builds the model: the next config is taken
    (llava's next keeps its sub-configs' layer counts, at width 32)."""
    refused = []

    def build(config):
        if not refused:
            refused.append(config)
        if config is refused[0]:
            raise ValueError("a size check of the model's own")
        with torch.device("meta"):
            return transformers.AutoModel.from_config(config)

    model = specs._tiniest("llava", build)
    assert refused[0].text_config.num_hidden_layers == 2
    assert model.config is not refused[0]
    assert model.config.text_config.num_hidden_layers > 2 and model.config.text_config.hidden_size == 32


def test_a_tiny_model_that_would_not_fit_is_refused_before_it_is_built(monkeypatch) -> None:
    """Built on meta first: one larger than half the memory is a SpecError, not a killed process."""
    monkeypatch.setattr(specs, "memory_bytes", lambda: 100_000)  # tiny llava is ~41k parameters, 164 kB
    with pytest.raises(specs.SpecError, match="even its tiny config has"):
        specs.resolve("transformers:llava")


runner = CliRunner()


@pytest.mark.parametrize("model_type", ["llava", "mixtral", "t5gemma"])
def test_prepare_composite_and_moe_types_from_the_command_line(model_type: str, tmp_path) -> None:
    result = runner.invoke(cli.app, ["prepare", f"transformers:{model_type}", "--json"])
    assert result.exit_code == 0, result.output
    assert '"passed"' in result.output.splitlines()[-1]


def test_decoder_ids_without_a_top_level_vocabulary_are_not_an_internal_error() -> None:
    """Dia's composite config has no top-level ``vocab_size``: the decoder ids were drawn below it
    (an internal error, exit 1). Now the ids are made, and Dia itself refuses them (its decoder
    ids have a channel dimension): the model's error, exit 2, said as such."""
    result = runner.invoke(cli.app, ["prepare", "transformers:dia"])
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and "The model itself failed" in result.output


def test_a_type_transformers_cannot_build_at_all_is_a_spec_error() -> None:
    """The last config failing too was transformers' exception raw (the CLI's "internal error")."""

    def build(config):
        raise TypeError("unsupported operand type(s) for //: 'NoneType' and 'NoneType'")

    with pytest.raises(specs.SpecError, match="transformers cannot build 'llava' from a tiny config"):
        specs._tiniest("llava", build)


def test_a_config_of_unknown_size_is_never_built_for_real() -> None:
    """Llava's last two candidates keep its language model and vision tower at their real sizes:
    when one cannot be built on ``meta`` (so its size is unknown), it is not built at all. Cohere
    Compass's allocated 8 GB on its way to the error it raised on ``meta`` too."""
    real: list[object] = []

    def build(config):
        if torch.empty(0).device.type != "meta":
            real.append(config)
        raise KeyError("full_attention")

    with pytest.raises(specs.SpecError, match="KeyError"):
        specs._tiniest("llava", build)
    assert len(real) == 2  # the two tiny at every level
    assert all(c.text_config.hidden_size == 32 and c.vision_config.hidden_size == 32 for c in real)


def test_a_refused_last_candidate_does_not_stop_an_earlier_one_that_builds() -> None:
    """GPT-Neo's old top-level-only config (its 24 per-layer attention kinds for 2 layers) is refused
    by transformers, the tiny one with one layer of each kind is not: candidates are taken one at a
    time, so the refused last one is never reached (all were made up front before, and the refusal
    stopped the spec)."""
    built = specs.resolve("transformers:gpt_neo")
    assert built.model.config.num_layers == 2


def _runs(model_type: str) -> specs.BuiltModel:
    built = specs.resolve(f"transformers:{model_type}")
    with torch.no_grad():
        built.model(**built.example_inputs)
    return built


@pytest.mark.parametrize("model_type", ["mistral4", "deepseek_v3", "kimi_linear", "longcat_flash"])
def test_latent_attention_head_sizes_shrink_together(model_type: str) -> None:
    """Multi-head latent attention ties ``head_dim`` to the rotary part (DeepSeek) or to the whole
    head (Mistral 4, rotary half of it): ``head_dim`` alone made tiny was a model that failed on its
    own ids (rotary tables of 4 for queries of 32)."""
    config = _runs(model_type).model.config
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    rope = rope_parameters.get("partial_rotary_factor", 1.0)
    assert config.qk_rope_head_dim <= 8 and config.kv_lora_rank <= 16
    assert config.qk_rope_head_dim in (config.head_dim, int(config.head_dim * rope))


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "glm4v"])
def test_rotary_sections_from_the_modelling_code_fit_the_tiny_head(model_type: str) -> None:
    """Qwen2-VL's and GLM-4V's ``mrope_section`` default lives in their modelling code, sized for the
    real head (16+24+24 halves of 128): the tiny config now states sections for its head."""
    text = _runs(model_type).model.config.text_config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head // 2


@pytest.mark.parametrize(("model_type", "names"), [
    ("clip", {"input_ids", "pixel_values"}),  # both towers: ids alone fail
    ("whisper", {"input_features", "decoder_input_ids"}),
    ("parakeet_ctc", {"input_features"}),  # frames then bins
    ("cohere_asr", {"input_features", "decoder_input_ids"}),  # the encoder config's 128 bins, not 80
    ("dac", {"input_values"}),  # a channel axis
    ("audio-spectrogram-transformer", {"input_values"}),  # a filter bank: frames x mel bins, not a waveform
    ("deepseek_ocr2_sam_vision_model", {"pixel_values"}),  # main_input_name left at the default input_ids
])
def test_inputs_are_what_the_model_runs_on(model_type: str, names: set[str]) -> None:
    built = _runs(model_type)
    assert set(built.example_inputs) == names
    for name in names & {"input_features", "input_values", "pixel_values"}:
        assert built.example_inputs[name].is_floating_point(), name  # integer "features" before


def test_prepare_a_dual_encoder_from_the_command_line() -> None:
    result = runner.invoke(cli.app, ["prepare", "transformers:clip", "--json"])
    assert result.exit_code == 0, result.output
    assert '"passed"' in result.output.splitlines()[-1]


def test_a_model_whose_inputs_the_config_does_not_tell_asks_for_them() -> None:
    result = runner.invoke(cli.app, ["prepare", "transformers:patchtst"])
    assert result.exit_code == 2, result.output
    assert "--input NAME=DIMS" in result.output and "internal error" not in result.output


def test_detection_queries_fit_the_anchors_of_a_tiny_image() -> None:
    """RT-DETR picks its queries as the top-k of its anchors: 300 of the 21 a 32x32 image has was
    ``selected index k out of range`` from the model itself."""
    assert _runs("rt_detr").model.config.num_queries == 10


@pytest.mark.parametrize("model_type", ["gptj", "codegen", "deepseek_v2"])
def test_prepare_rotary_part_and_unset_expert_count_types_from_the_command_line(model_type: str) -> None:
    """GPT-J's and CodeGen's rotary part (``rotary_dim`` 64) was wider than the tiny head of 16, and
    DeepSeek-V2's default config names 64 experts but no ``num_experts_per_tok`` (topk of None): the
    model itself failed on its ids (exit 2)."""
    result = runner.invoke(cli.app, ["prepare", f"transformers:{model_type}", "--json"])
    assert result.exit_code == 0, result.output
    assert '"passed"' in result.output.splitlines()[-1]


@pytest.mark.parametrize("model_type", ["bamba", "granitemoehybrid"])
def test_prepare_hybrid_mamba_types_from_the_command_line(model_type: str) -> None:
    """Their Mamba-2 mixers' 128 heads did not divide the tiny expanded width (2 x 32): transformers
    refused every tiny config, and the refusal was lost ("NoneType: None"). ``--dynamic batch``: the
    default shape-general capture of their chunked scan (guards on ``seq % 256``) takes ~40 s here."""
    result = runner.invoke(cli.app, ["prepare", f"transformers:{model_type}", "--json", "--dynamic", "batch"])
    assert result.exit_code == 0, result.output
    assert '"passed"' in result.output.splitlines()[-1]


def test_a_type_whose_every_tiny_config_is_refused_says_why() -> None:
    """Mamba-2's heads x head size must be the expanded width, which no tiny config here gives: the
    refusal is named, not "NoneType: None"."""
    result = runner.invoke(cli.app, ["prepare", "transformers:mamba2"])
    assert result.exit_code == 2
    assert "NoneType: None" not in result.output and "expand" in result.output


@pytest.mark.parametrize(("model_type", "cls"), [
    ("aimv2_text_model", "Aimv2TextModel"),  # a tower's own type, with no place in AutoModel's table
    ("blip_2_vision_model", "Blip2VisionModel"),
    ("blip_text_model", "BlipTextModel"),  # in modeling_blip_text, not beside configuration_blip
])
def test_a_tower_type_builds_its_own_model_class(model_type: str, cls: str) -> None:
    """A sub-config's model type (a text or vision tower) was "Unrecognized configuration class"
    from ``AutoModel`` (exit 2, about a fifth of transformers' types): its family's model class for
    that config is built instead, and it prepares."""
    built = _runs(model_type)
    assert type(built.model).__name__ == cls
    result = runner.invoke(cli.app, ["prepare", f"transformers:{model_type}", "--json"])
    assert result.exit_code == 0, result.output
    assert '"passed"' in result.output.splitlines()[-1]


def test_a_family_base_class_without_a_forward_is_not_built() -> None:
    """ColPali's package holds ``ColPaliPreTrainedModel`` (no forward) beside ``ColPaliForRetrieval``:
    the class built for a config is one with a forward."""
    config_class = type(tiny_config("colpali"))
    cls = specs._own_model_class(config_class)
    assert cls is not None and cls.forward is not torch.nn.Module.forward
    assert cls.config_class is config_class


def test_per_stage_lists_are_cut_with_a_stage_count_of_another_name() -> None:
    """ConvNeXt's ``num_stages`` is what its ``attribute_map`` calls ``num_hidden_layers``: the stages
    were cut to 2 and ``depths`` / ``hidden_sizes`` kept 4 entries, so the model failed on its own
    image (a norm of the fourth stage's width after the second)."""
    config = _runs("convnext").model.config
    assert config.num_stages == len(config.depths) == len(config.hidden_sizes) == 2


def test_experts_counted_under_another_name_are_aligned_too() -> None:
    """Aria counts its experts as ``moe_num_experts``: its grouped matmuls got rows of 37 floats and
    the model failed on its ids ("strides should be multiple of 16 bytes")."""
    config = _runs("aria_text").model.config
    assert (config.intermediate_size * 2) % 16 == 0
