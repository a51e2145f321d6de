"""Shape-general speech models (issue 27, item 3): calibration audio comes in every length.

A speech model's audio input is laid out as transformers' feature extractors make it: a waveform
``input_values`` (batch x samples), a filter bank ``input_features`` (batch x frames x features, or
batch x features x frames for Whisper). Before, only the batch was free (found by the batch probe)
and a clip of any other length was refused. Each model here is prepared at batch 1 with no
``dynamic=`` option and called at batch 3 with another length (a padded mask where it takes one),
against eager, in float32 and bfloat16, with the attention calls recorded on both sides.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

import fxprep
from fxprep.capture.shapes import autodims
from fxprep.capture.shapes.guard_range import interval
from fxprep.core.inputs import ExampleInputs
from fxprep.errors import InputMismatch
from tests.attention_calls import differences, record

_W2V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=32,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2)
_SEQ2SEQ = dict(vocab_size=101, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _padded(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length // 2:] = 0
    return mask


def _check(model: nn.Module, example: dict[str, torch.Tensor], later: dict[str, torch.Tensor],
           dtype: torch.dtype, free: dict[str, dict[int, str]]) -> Any:
    model = model.to(dtype).eval()
    example, later = _cast(example, dtype), _cast(later, dtype)
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert any(f"dynamic dimensions: {free}" in note for note in report.notes), report.notes
    with torch.no_grad():
        got, want = gm(**later)["logits"], model(**later).logits
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same kernels at the same sizes: bit for bit, as in the text suites
        assert torch.equal(got, want)
    assert differences(record(model, later), record(gm, later)) == []
    return gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_waveform_model_runs_at_every_length_and_batch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**_W2V))
    g = torch.Generator().manual_seed(0)
    _check(model, {"input_values": torch.randn(1, 400, generator=g)},
           {"input_values": torch.randn(3, 650, generator=g)}, dtype, {"input_values": {0: "batch", 1: "seq"}})


def test_a_padded_waveform_whose_length_guards_export_cannot_prove_stays_free_where_they_hold() -> None:
    """The stable-layer-norm variant with a padding mask: export's guards on the samples go through the
    convolutions' strides (``seq // 10``) and it offers only multiples of 10 (``seq = 10*_seq``) and an
    unbounded end (``seq <= IntInfinity()``); where the guards hold (30 samples on), the length is free."""
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**_W2V, feat_extract_norm="layer",
                                                                    do_stable_layer_norm=True))
    g = torch.Generator().manual_seed(0)
    free = {"input_values": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    gm = _check(model, {"input_values": torch.randn(1, 400, generator=g), "attention_mask": torch.ones(1, 400, dtype=torch.long)},
                {"input_values": torch.randn(3, 653, generator=g), "attention_mask": _padded(3, 653)}, torch.float32, free)
    with pytest.raises(InputMismatch, match=r"dim 1 is 25, the graph holds for >= 30 only"):
        gm(input_values=torch.randn(1, 25), attention_mask=torch.ones(1, 25, dtype=torch.long))


def test_export_writes_an_unbounded_end_as_int_infinity_and_it_is_read() -> None:
    src = "L['input_values'].size()[1]"
    assert interval([f"30 <= {src} and {src} <= IntInfinity()"], src, 400) == (30, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_filter_bank_of_frames_by_features_has_its_frames_and_decoder_length_free(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = transformers.Speech2TextForConditionalGeneration(transformers.Speech2TextConfig(
        **_SEQ2SEQ, max_source_positions=256, input_feat_per_channel=20, conv_channels=16))
    g = torch.Generator().manual_seed(0)
    example = {"input_features": torch.randn(1, 30, 20, generator=g), "attention_mask": torch.ones(1, 30, dtype=torch.long),
               "decoder_input_ids": torch.tensor([[1, 5, 6, 7]])}
    later = {"input_features": torch.randn(3, 50, 20, generator=g), "attention_mask": _padded(3, 50),
             "decoder_input_ids": torch.randint(3, 101, (3, 9), generator=g)}
    free = {"input_features": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "decoder_input_ids": {0: "batch", 1: "decoder_seq"}}
    _check(model, example, later, dtype, free)


def test_frames_without_a_mask_are_told_from_the_feature_size_the_config_names() -> None:
    torch.manual_seed(0)
    model = transformers.Wav2Vec2BertForCTC(transformers.Wav2Vec2BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=32,
        feature_projection_input_dim=20, output_hidden_size=32, conv_depthwise_kernel_size=3))
    g = torch.Generator().manual_seed(0)
    _check(model, {"input_features": torch.randn(1, 30, 20, generator=g)},
           {"input_features": torch.randn(3, 47, 20, generator=g)}, torch.float32, {"input_features": {0: "batch", 1: "seq"}})


def test_whispers_fixed_frame_count_stays_and_says_where_batch_and_decoder_length_free() -> None:
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        **_SEQ2SEQ, max_source_positions=30, num_mel_bins=20))
    g = torch.Generator().manual_seed(0)
    example = {"input_features": torch.randn(1, 20, 60, generator=g), "decoder_input_ids": torch.tensor([[1, 5, 6, 7]])}
    later = {"input_features": torch.randn(3, 20, 60, generator=g), "decoder_input_ids": torch.randint(3, 101, (3, 9), generator=g)}
    gm = _check(model, example, later, torch.float32,
                {"input_features": {0: "batch"}, "decoder_input_ids": {0: "batch", 1: "decoder_seq"}})
    stays = [n for n in gm.fxprep_report.notes if "input_features dim 2 stays" in n]
    assert stays and "modeling_whisper.py" in stays[0] and "expected_seq_length" in stays[0]
    with pytest.raises(InputMismatch, match="modeling_whisper.py"):
        gm(input_features=torch.randn(1, 20, 40), decoder_input_ids=torch.tensor([[1, 5]]))


def test_a_spectrogram_named_input_values_gets_its_frames_not_its_mel_bins() -> None:
    """The Audio Spectrogram Transformer takes batch x frames x mel bins as ``input_values``: of its
    three dimensions the frames are the one that is not the config's mel bins (not the last one, as
    for a waveform with channels)."""
    model = transformers.ASTForAudioClassification(transformers.ASTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, max_length=64,
        num_mel_bins=16, patch_size=16, frequency_stride=10, time_stride=10))
    proposal = autodims.propose(model, ExampleInputs((), {"input_values": torch.randn(1, 64, 16)}))
    assert proposal is not None and proposal.dynamic == {"input_values": {0: "batch", 1: "seq"}}
    waveform = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**_W2V))
    proposal = autodims.propose(waveform, ExampleInputs((), {"input_values": torch.randn(1, 2, 400)}))
    assert proposal is not None and proposal.dynamic == {"input_values": {0: "batch", 2: "seq"}}


def test_a_length_declared_maybe_dynamic_is_limited_to_where_the_models_branches_hold() -> None:
    """SEW-D pools its frames and pads them back where their count is odd: a branch on the length
    that export's printed guards did not cover. Declared maybe-dynamic over every length its guards
    allowed (1360 samples on), the graph computed wrong values or failed inside torch at lengths
    where the branch went the other way (1800: "The size of tensor a (4) must match ..."). Every call
    is now either exactly eager's or refused with the range the graph holds for."""
    from fxprep.cli.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCTC.from_config(tiny_config("sew-d")).eval()
    g = torch.Generator().manual_seed(0)
    gm = fxprep.prepare_model(model, example_inputs={"input_values": torch.randn(1, 1600, generator=g)})
    assert gm.fxprep_report.verification.status == "passed"
    said = [n for n in gm.fxprep_report.notes if n.startswith("Shape-general: 'seq' is dynamic")]
    assert said and " and <= " in said[0], said  # the report gives the narrowed range, not only its start
    accepted = 0
    for length in (1400, 1603, 1679, 1800, 2000, 2600, 4000):
        x = torch.randn(2, length, generator=g)
        try:
            with torch.no_grad():
                got = gm(input_values=x)["logits"]
        except InputMismatch as err:
            assert "the graph holds for" in str(err)
            continue
        with torch.no_grad():
            torch.testing.assert_close(got, model(input_values=x).logits, rtol=1e-5, atol=1e-5)
        accepted += 1
    assert accepted >= 2  # still free within the range: 1400, 1603, 1679


@pytest.mark.parametrize(("dtype", "padded"), [(torch.float32, True), (torch.bfloat16, False)])
def test_moonshine_runs_at_other_lengths(dtype: torch.dtype, padded: bool) -> None:
    """Moonshine writes ``is_causal = self.is_causal and mask is None and q_len > 1``: with the
    lengths declared, the last operand (a symbolic bool) reached SDPA, which refuses it, and the
    capture kept static lengths. fxprep's capture makes it a bool, decided as eager decides it.
    With a padding mask, the mask's length through the three convolutions is guarded with
    ``math.trunc`` of a float, which the guard evaluation reads too."""
    from fxprep.cli.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForSpeechSeq2Seq.from_config(tiny_config("moonshine"))
    g = torch.Generator().manual_seed(0)

    def clip(batch: int, samples: int, tokens: int) -> dict[str, torch.Tensor]:
        inputs = {"input_values": torch.randn(batch, samples, generator=g),
                  "decoder_input_ids": torch.randint(3, 90, (batch, tokens), generator=g)}
        if padded:
            inputs["attention_mask"] = _padded(batch, samples)
        return inputs

    free = {"input_values": {0: "batch", 1: "seq"}, "decoder_input_ids": {0: "batch", 1: "decoder_seq"}}
    if padded:  # the note lists them in the example's order
        free["attention_mask"] = {0: "batch", 1: "seq"}
    gm = _check(model, clip(1, 1600, 4), clip(3, 2600, 6), dtype, free)
    later = _cast(clip(2, 5000, 3), dtype)
    with torch.no_grad():
        assert torch.equal(gm(**later)["logits"], model(**later).logits)
