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


def test_a_refused_last_candidate_does_not_stop_an_earlier_one_that_builds() -> None:
    """GPT-Neo's old top-level-only config (its 24 per-layer attention kinds for 2 layers) is refused
    by transformers, the tiny one with one layer of each kind is not: candidates are taken one at a
    time, so the refused last one is never reached (all were made up front before, and the refusal
    stopped the spec)."""
    built = specs.resolve("transformers:gpt_neo")
    assert built.model.config.num_layers == 2
