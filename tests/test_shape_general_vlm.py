"""Shape-general VLMs (issue 27, item 3): a vision-language model prepared on one image and prompt
runs on prompts of other lengths, and where each sample has its own row of every input, on other
batch sizes, by default.

The prompt's length is the dimension calibration data varies most (images are resized to the
processor's size). Where every input other than the tokens has one row per sample (one image per
prompt: Gemma3, PaliGemma, Mllama, Llama 4), the batch is declared with them; transformers' check
that the image tokens match the features builds its message before the check, and formatting the
symbolic size would specialise the batch, so the capture builds that message lazily
(:mod:`fxprep.families.transformers.compilable_checks`). Each model is compared with its eager self at a longer and a
shorter prompt (text added or removed at the end, the image tokens untouched) and, where the batch
is free, on a batch of other samples (other text, other images). Llava with a Pixtral tower and
Mistral3 decide each image's size from data (``.tolist()``), one set of values per image: their batch
stays, and says why; so does Llava 1.5 (a CLIP tower), whose image features become a Python list of
one entry per sample (``list(image_features)``). VLMs with parts opaque in the static capture (the
Qwen family's rope index, Llava-NeXT's tiling helpers) are captured again that way with the length
declared, and keep it free where nothing more becomes opaque.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo import fallback
from fxprep.capture.dynamo.fallback import capture_dynamo_leaves
from fxprep.capture.request import CaptureRequest
from fxprep.capture.shapes import autodims, violation
from fxprep.core.inputs import ExampleInputs
from fxprep.families.transformers import methods as hf_source

from . import vlm_models, vlm_models_more

TOKEN_LEVEL = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "cross_attention_mask")


def _prompt(inputs: dict[str, Any], change: int, seed: int) -> dict[str, Any]:
    """``inputs`` with ``change`` text tokens added at the end of the prompt (removed when negative):
    new ids are plain text ids, the other token-level inputs repeat their last entry."""
    out = dict(inputs)
    for name in TOKEN_LEVEL:
        if name not in inputs:
            continue
        value = inputs[name]
        if change < 0:
            out[name] = value[:, :change]
        elif name == "input_ids":
            text = torch.randint(3, 90, (value.shape[0], change), generator=torch.Generator().manual_seed(seed))
            out[name] = torch.cat([value, text], dim=1)
        else:
            out[name] = torch.cat([value] + [value[:, -1:]] * change, dim=1)
    return out


def _samples(inputs: dict[str, Any], n: int, seed: int) -> dict[str, Any]:
    """A batch of ``n`` samples laid out like the example's one: each row's text ids and image drawn
    anew (the image and special tokens where they were), every other input repeated."""
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.cat([value] * n) for name, value in inputs.items()}
    ids = out["input_ids"]
    text = ids < 90  # the builders' text ids; image and special tokens are 100 and above
    out["input_ids"] = torch.where(text, torch.randint(3, 90, ids.shape, generator=g), ids)
    pixels = out["pixel_values"]
    out["pixel_values"] = torch.randn(pixels.shape, generator=g).to(pixels.dtype)
    return out


def _builder(name: str) -> Any:
    return vlm_models.BUILDERS.get(name) or vlm_models_more.BUILDERS[name]


BATCH_FREE = ("gemma3", "paligemma", "mllama")  # one image per prompt, nothing decided from an image's data


@pytest.mark.parametrize(("name", "dtype"), [("gemma3", torch.float32), ("gemma3", torch.bfloat16),
                                             ("llava_pixtral", torch.float32), ("mistral3", torch.float32),
                                             ("paligemma", torch.float32), ("mllama", torch.float32),
                                             ("llava_clip", torch.float32)])
def test_a_vlm_prepared_on_one_prompt_runs_on_prompts_of_other_lengths(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model, inputs = _builder(name)()
    model = model.to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed", report.verification
    text = report.to_text()
    batch_free = name in BATCH_FREE
    found = "input_ids dim 0 (batch), input_ids dim 1 (seq)" if batch_free else "input_ids dim 1 (seq)"
    assert f"Shape-general: the dimensions {found}" in text, text
    assert ("pixel_values dim 0 (batch)" in text) is batch_free
    assert ("input_ids dim 0 stays at the example's size" in text) is not batch_free
    assert "block reuse did not apply" not in text
    if name in ("llava_pixtral", "mistral3"):  # captured deciding values; Pixtral's layers carry hooks
        assert "the values decided from the example are one set per image" in text
        stamped = {k: v for k, v in report.reuse["captured"].items() if v}
        assert stamped == {"model.vision_tower.transformer.layers.0.feed_forward":
                           ["model.vision_tower.transformer.layers.1.feed_forward"],
                           "model.language_model.layers.0": ["model.language_model.layers.1"]}
    calls = [_prompt(inputs, 7, 1), _prompt(inputs, -1, 2)]
    if batch_free:
        calls += [_samples(inputs, 3, 3), _prompt(_samples(inputs, 2, 4), 5, 5)]
    for call in calls:
        with torch.no_grad():
            eager = model(**call, use_cache=False).logits
            prepared = gm(**call)[0]
        assert prepared.shape == eager.shape == (*call["input_ids"].shape, eager.shape[-1])
        if dtype == torch.float32:
            torch.testing.assert_close(prepared, eager, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(prepared.float(), eager.float(), rtol=2e-2, atol=2e-2)
    if not batch_free:  # the batch was tried with the images and did not hold: why, and where
        two = {k: torch.cat([v, v]) for k, v in inputs.items()}
        why = ("the model's code specialises 'batch' to 2 at .*modeling_llava.py:\\d+ in get_image_features"
               if name == "llava_clip" else "declared dynamic with the other inputs .* one set per image")
        with pytest.raises(fxprep.InputMismatch, match=f"pixel_values: shape .* \\(dim 0: {why}"):
            gm(**two)


def test_the_check_message_is_built_lazily_during_capture_and_still_said_when_it_fails() -> None:
    # Gemma3's get_placeholder_mask formats the feature count into its message before checking:
    # under capture a copy builds it only on failure; the model's own method is back afterwards
    model, inputs = _builder("gemma3")()
    inner = model.model
    ids = inputs["input_ids"]
    embeds = inner.get_input_embeddings()(ids)
    wrong = torch.zeros(1, 8, embeds.shape[-1])  # 8 features for 4 image tokens
    with hf_source.rewritten_methods(model):
        copy = inner.__dict__["get_placeholder_mask"]
        assert copy.__func__ is not type(inner).get_placeholder_mask
        assert copy(ids, inputs_embeds=embeds, image_features=torch.zeros(1, 4, embeds.shape[-1])).sum() == 4
        with pytest.raises(ValueError, match="tokens: 4, features: 8"):
            copy(ids, inputs_embeds=embeds, image_features=wrong)
    assert "get_placeholder_mask" not in inner.__dict__


def test_what_is_proposed_for_multimodal_examples() -> None:
    model, inputs = _builder("qwen2_vl")()  # pixel_values: patches of two images; image_grid_thw: one row each
    proposal = autodims.propose(model, ExampleInputs((), inputs))
    assert proposal is not None
    assert proposal.dynamic == {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}, "mm_token_type_ids": {1: "seq"}}
    assert set(proposal.dropped) == {("input_ids", 0), ("attention_mask", 0), ("mm_token_type_ids", 0)}
    assert "image_grid_thw, pixel_values" in proposal.dropped[("input_ids", 0)]
    # Mllama's cross_attention_mask (batch x tokens x images x tiles) grows with the prompt
    model, inputs = _builder("mllama")()
    proposal = autodims.propose(model, ExampleInputs((), inputs))
    assert proposal is not None and proposal.narrower is not None and proposal.narrower.dynamic == {
        "input_ids": {1: "seq"}, "attention_mask": {1: "seq"}, "cross_attention_mask": {1: "seq"}}
    assert proposal.dynamic["cross_attention_mask"] == {0: "batch", 1: "seq"}
    # one image per prompt: the batch is declared with the image, the length alone kept to fall back on
    model, inputs = _builder("gemma3")()
    proposal = autodims.propose(model, ExampleInputs((), inputs))
    assert proposal is not None and not proposal.dropped
    assert proposal.dynamic["pixel_values"] == {0: "batch"} and proposal.dynamic["input_ids"] == {0: "batch", 1: "seq"}
    assert proposal.capture_example.kwargs["pixel_values"].shape[0] == 2  # grown past Dynamo's 0/1 specialisation
    assert proposal.narrower is not None and proposal.narrower.dynamic == {
        "input_ids": {1: "seq"}, "attention_mask": {1: "seq"}, "token_type_ids": {1: "seq"}}
    assert set(proposal.narrower.dropped) == {(n, 0) for n in ("input_ids", "attention_mask", "token_type_ids",
                                                                "pixel_values")}
    # two tiles of one prompt's image (Aya Vision): not one row per sample, the batch stays
    model, inputs = _builder("aya_vision")()
    proposal = autodims.propose(model, ExampleInputs((), inputs))
    assert proposal is not None and proposal.narrower is None and "pixel_values" not in proposal.dynamic
    assert ("input_ids", 0) in proposal.dropped
    # an input of unknown layout with a dimension of the sequence's size would have to grow with it
    model, inputs = _builder("gemma3")()
    extra = {**inputs, "token_image_map": torch.zeros(1, inputs["input_ids"].shape[1], 2)}
    assert autodims.propose(model, ExampleInputs((), extra)) is None
    # images alone (no token input): their batch, as before
    model, inputs = _builder("gemma3")()
    proposal = autodims.propose(model.model.vision_tower, ExampleInputs((), {"pixel_values": inputs["pixel_values"]}))
    assert proposal is not None and proposal.dynamic == {"pixel_values": {0: "batch"}} and not proposal.dropped


OPAQUE_VLMS = [
    # Qwen2-VL: the static capture decides the image grid's values and calls the rope index
    # (itertools.groupby) without tracing into it. Two things kept its length static before: torch's
    # real-value cross-check guarded on a view's symbolic offset (the rotary table's `m[i % 3]`),
    # specialising the length, and the vision blocks (sized from the image grid only) failed their
    # dynamic capture, which under declared dimensions gave up block reuse.
    ("qwen2_vl", "dynamo+values", {"model.get_rope_index"},
     {"model.visual.blocks.0", "model.language_model.layers.0"}),
    # Qwen3-VL-MoE: its experts sort tokens by expert and gather them with `perm // num_top_k`; on
    # integers that decomposes through prims.signbit, whose fake kernel has the wrong dtype, and
    # torch's repair under real values gave each size a fresh unbacked symbol: the experts became
    # opaque with the length declared, and the length stayed static
    ("qwen3_vl_moe", "dynamo+values", {"model.visual.get_vision_interpolation_indices_and_weights",
                                       "model.get_rope_index"},
     {"model.visual.blocks.0", "model.language_model.layers.0"}),
    # Llava-NeXT: the anyres tiling helpers compute from image_sizes in Python (nothing decided from
    # data); their outputs, sized by the image, not the prompt, stay as recorded
    ("llava_next", "dynamo+leaves", {"model.image_size_to_num_patches", "model.get_anyres_image_grid_shape",
                                     "model.pack_image_features"},
     {"model.vision_tower.encoder.layers.0.mlp", "model.language_model.layers.0"}),
]


@pytest.mark.parametrize(("name", "tracer", "opaque", "stamped"), OPAQUE_VLMS)
def test_a_vlm_with_opaque_parts_keeps_the_prompt_length_free(name: str, tracer: str, opaque: set[str],
                                                               stamped: set[str]) -> None:
    # captured again the static capture's way (the same parts opaque) with the length declared: no
    # other part becomes opaque, so it is kept, and the graph holds for prompts of any length
    torch.manual_seed(0)
    model, inputs = _builder(name)()
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed" and report.tracer == tracer
    assert set(report.leaves) == opaque  # no more opaque than the static capture
    text = report.to_text()
    assert "was tried and not kept" not in text
    assert "Shape-general: the dimensions input_ids dim 1 (seq)" in text
    assert f"(tracer {tracer}), a second time with the found dimensions declared dynamic" in text
    assert {k for k, v in report.reuse["captured"].items() if v} == stamped
    padded = _prompt(inputs, 6, 2)
    padded["attention_mask"] = padded["attention_mask"].clone()
    padded["attention_mask"][0, -4:] = 0
    for call in (_prompt(inputs, 3, 1), _prompt(inputs, -2, 1), _prompt(inputs, 41, 3), padded):
        with torch.no_grad():
            eager = model(**call, use_cache=False).logits
            prepared = gm(**call)[0]
        assert prepared.shape == eager.shape
        torch.testing.assert_close(prepared, eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(fxprep.InputMismatch):  # the batch stays: all images' patches or tiles are one tensor
        gm(**{k: torch.cat([v, v]) for k, v in inputs.items()})


@pytest.mark.parametrize("name", ["llava_next", "qwen2_vl"])
def test_the_capture_with_the_length_declared_starts_from_the_static_captures_opaque_parts(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the static capture found its opaque parts one whole-model trace at a time; the capture again
    # with the length declared makes them opaque from its first trace (Qwen2-VL-2B's shape: 23 -> 16 s
    # on this CPU), and the report names each with the issue that made it opaque, as before
    calls: list[tuple[bool, int]] = []  # (length declared, parts opaque) of each whole-model capture
    real = fallback.capture_dynamo

    def counting(request: CaptureRequest, **kw: Any) -> Any:
        calls.append((bool(request.dynamic), len(kw.get("opaque") or [])))
        return real(request, **kw)

    monkeypatch.setattr(fallback, "capture_dynamo", counting)
    torch.manual_seed(0)
    model, inputs = _builder(name)()
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    report = fxprep.get_report(gm)
    assert "Shape-general: the dimensions input_ids dim 1 (seq)" in report.to_text()
    static = [n for declared, n in calls if not declared]
    assert len(static) > 1 and min(static) < len(report.leaves)  # the static capture found them trace by trace
    declared = [n for declared, n in calls if declared]
    # each trace with the length declared has all of them opaque from its start, and there is one: the
    # maybe-dynamic first try is kept (issue 60; its guards on the image sizes and on values read from
    # data name no declared dimension: before, they sent it back for a strict capture, a second trace)
    assert declared == [len(report.leaves)], declared
    for leaf, why in report.leaves.items():
        assert why.startswith("opaque: ") and " at " in why and ".py:" in why, (leaf, why)


def test_a_vlm_whose_linear_attention_scans_in_chunks_keeps_the_length_free_past_one_chunk() -> None:
    # Qwen3.5: its vision sizes are decided from data (the values capture), and its linear-attention
    # layer's chunked scan ties the length to one chunk of 64 tokens when traced. The scan is kept
    # opaque in the values capture too; it was left traced there (its fake output's real value, made
    # contiguous under the fake mode, was itself a fake tensor, and the rotary multiply after it failed),
    # and the prompt stayed <= 64 tokens
    torch.manual_seed(0)
    model, inputs = _builder("qwen3_5")()
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed" and report.tracer == "dynamo+values"
    scan = "model.language_model.layers.0.linear_attn.torch_chunk_gated_delta_rule"
    assert set(report.leaves) == {"model.visual.get_vision_interpolation_indices_and_weights", "model.get_rope_index",
                                  scan}
    assert report.leaves[scan].startswith("opaque: a loop over 'seq'")
    text = report.to_text()
    assert "Shape-general: the dimensions input_ids dim 1 (seq)" in text and "'seq' is dynamic" not in text
    for call in (_prompt(inputs, 3, 1), _prompt(inputs, -2, 2), _prompt(inputs, 90, 3)):  # 110 tokens: two chunks
        with torch.no_grad():
            eager = model(**call, use_cache=False).logits
            prepared = gm(**call)[0]
        torch.testing.assert_close(prepared, eager, rtol=1e-5, atol=1e-5)


class _FixedHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 8 * x.shape[-1])  # fixes the sequence at 8


class _WithFixedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = _FixedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def test_a_specialised_dimension_ends_the_fallback_that_must_keep_it() -> None:
    # the shape-general values capture (dims_must_hold): a declared dimension the code fixes is read
    # as such (violation.specialises on Dynamo's real constraint violation) and nothing is made opaque
    model = _WithFixedHead().eval()
    request = CaptureRequest(model, example=ExampleInputs((torch.randn(2, 8, 4),), {}), dynamic={"x": {1: "seq"}},
                             dims_must_hold=True)
    result, attempt, sites = capture_dynamo_leaves(request, None)
    assert result is None and sites == []
    assert attempt.exception is not None and violation.specialises(attempt.exception)
    assert "specialized it to be a constant (8)" in str(attempt.exception)
    assert not violation.specialises(RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)"))
