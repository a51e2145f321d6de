"""The report says each thing once: repeated notes are grouped (text and markdown), JSON keeps them all."""

from __future__ import annotations

import torch

import fxprep
from fxprep.reporting.report import Report, group_notes

MEANING = "that branch was captured for eval mode and stays fixed; prepare the model in the mode you will use it in."


def _tiny_whisper():
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.WhisperModel(config).eval()


def test_whisper_training_notes_said_once():
    model = _tiny_whisper()
    inputs = {"input_features": torch.randn(1, 8, 32), "decoder_input_ids": torch.tensor([[1, 2]])}
    report = fxprep.prepare_model(model, example_inputs=inputs).fxprep_report
    reads = [n for n in report.notes if "reads self.training" in n]
    modules = {n.split(" reads ")[0] for n in reads}
    assert len(reads) > len(modules) >= 4  # several modules, some with several reads
    text = report.to_text()
    assert text.count(MEANING) == 1
    assert f"reads self.training in {len(modules)} modules ({len(reads)} places): {MEANING}" in text
    for module in modules:  # one line each, e.g. "WhisperEncoder (encoder) at .../generic.py:622, 627"
        assert sum(line.strip().startswith(module + " at ") for line in text.splitlines()) == 1
    assert report.to_markdown().count(MEANING) == 1
    assert report.to_dict()["notes"] == report.notes  # the JSON keeps every note


def test_group_notes_forms():
    notes = [
        "A (a) reads self.training at f.py:1: fixed.",
        "kept: x",
        "B (a.b) reads self.training at f.py:2: fixed.",
        "A (a) reads self.training at f.py:3: fixed.",
        "A (a) reads self.training at g.py:9: fixed.",
        "cache emptied: weights recomputed",
        "buffer emptied: weights recomputed",
        "kept: x",
    ]
    assert group_notes(notes) == [
        ("reads self.training in 2 modules (4 places): fixed.", ["A (a) at f.py:1, 3; g.py:9", "B (a.b) at f.py:2"]),
        ("in 2 places: x", ["kept", "kept"]),
        ("in 2 places: weights recomputed", ["cache emptied", "buffer emptied"]),
    ]
    assert group_notes(["one note", "a: b"]) == [("one note", []), ("a: b", [])]


def test_grouped_text_of_a_report():
    report = Report("m")
    for i, q in enumerate(["enc", "dec"]):
        report.note(f"Layer ({q}) reads self.training at /src/x.py:{10 + i}: {MEANING}")
    lines = report.to_text().splitlines()
    start = lines.index("  notes:")
    assert lines[start + 1:start + 4] == [
        f"    ! reads self.training in 2 modules: {MEANING}",
        "        Layer (enc) at /src/x.py:10",
        "        Layer (dec) at /src/x.py:11",
    ]
