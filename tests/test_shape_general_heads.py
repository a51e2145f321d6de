"""Shape-general heads whose inputs are not one prompt per row (issue 27, item 3).

Multiple choice: any batch, any number of choices, any length.

transformers' ``...ForMultipleChoice`` heads take ``batch x choices x tokens`` ids. Read as a
prompt's ``batch x tokens``, the choices were declared the sequence and the tokens kept at the
example's length, so every call at another length was refused; with a padding mask the grown
example disagreed with itself and capture fell back to static shapes. Each model is prepared at
1 sample x 2 choices x 8 tokens with no ``dynamic=`` option and called at 3 x 3 x 13 against eager.

Contrastive text-image models (CLIP, SigLIP): any number of texts against any number of images.
Their texts and images were read as prompts with one image each, so with one text and one image
both counts were tied, and with two texts and one image (not one row per sample) both stayed at the
example's counts: only the texts' length was free.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import fxprep
from fxprep.capture.shapes import autodims
from fxprep.cli.tiny import tiny_config
from fxprep.core.inputs import ExampleInputs
from tests.attention_calls import differences, record

_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64)


def _choices(batch: int, choices: int, length: int, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 100 + length)
    inputs = {"input_ids": torch.randint(3, 99, (batch, choices, length), generator=g)}
    if padded:
        mask = torch.ones(batch, choices, length, dtype=torch.long)
        mask[-1, -1, length // 2:] = 0
        inputs["attention_mask"] = mask
    return inputs


@pytest.mark.smoke
def test_the_choices_are_their_own_dimension() -> None:
    model = transformers.BertForMultipleChoice(transformers.BertConfig(**_BERT))
    ids = torch.zeros(1, 2, 8, dtype=torch.long)
    proposal = autodims.propose(model, ExampleInputs((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    assert proposal is not None
    want = {0: "batch", 1: "choices", 2: "seq"}
    assert proposal.dynamic == {"input_ids": want, "attention_mask": want}
    grown = proposal.capture_example.kwargs
    assert grown["input_ids"].shape == grown["attention_mask"].shape  # one layout: the mask grows with the ids
    assert len(set(grown["input_ids"].shape)) == 3  # three sizes kept apart, so three symbols
    embeds = torch.zeros(1, 2, 8, 32)
    proposal = autodims.propose(model, ExampleInputs((), {"inputs_embeds": embeds}))
    assert proposal is not None and proposal.dynamic == {"inputs_embeds": want}  # the hidden size stays
    plain = autodims.propose(transformers.BertModel(transformers.BertConfig(**_BERT)),
                             ExampleInputs((), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}))
    assert plain is not None and plain.dynamic == {"input_ids": {0: "batch", 1: "seq"}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True], ids=["nomask", "padded"])
def test_bert_multiple_choice_runs_at_other_sizes(padded: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = transformers.BertForMultipleChoice(transformers.BertConfig(**_BERT)).to(dtype).eval()
    gm = fxprep.prepare_model(model, example_inputs=_choices(1, 2, 8, padded))
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    free = {0: "batch", 1: "choices", 2: "seq"}
    want = {"input_ids": free, **({"attention_mask": free} if padded else {})}
    assert any(f"dynamic dimensions: {want}" in note for note in report.notes), report.notes
    for size in ((3, 3, 13), (2, 5, 4)):
        later = _choices(*size, padded)
        with torch.no_grad():
            got, expected = gm(**later)["logits"], model(**later).logits
        assert got.shape == (size[0], size[1])
        assert torch.equal(got, expected)  # the same kernels at the same sizes
        assert differences(record(model, later), record(gm, later)) == []


class _MadeInForward(nn.Module):
    """A head that makes a module inside its forward, as MRA's multiple-choice head does
    (``nn.ReLU()(pooled_output)``): it is no submodule, so fx cannot name it in a call_module node."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.GELU()(self.lin(x)) + nn.Softmax(dim=-1)(x)


@pytest.mark.smoke
def test_a_module_made_inside_forward_is_traced_through_by_fx() -> None:
    model = _MadeInForward().eval()
    x = torch.randn(2, 6)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="fx")  # before: NameError, not installed
    assert gm.fxprep_report.verification.status == "passed"
    kinds = {type(m).__name__ for m in gm.modules()}
    assert "GELU" in kinds  # its call became a module, as a functional call does
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_mra_multiple_choice_prepares() -> None:
    """MRA's multiple-choice head: Dynamo refuses its attention stub (``requires_grad_()`` on a
    graph output) and fx met the ReLU made in its forward; it now prepares with fx and runs at
    other sizes (fx's graph is not tied to the example's shapes there)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForMultipleChoice.from_config(tiny_config("mra")).eval()
    gm = fxprep.prepare_model(model, example_inputs=_choices(1, 2, 8, padded=True))
    assert gm.fxprep_report.verification.status == "passed"
    later = _choices(3, 3, 13, padded=True)
    with torch.no_grad():
        torch.testing.assert_close(gm(**later)["logits"], model(**later).logits, rtol=0, atol=0)


_CLIP = dict(text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64),
             vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8), projection_dim=16)


def _texts_and_images(texts: int, length: int, images: int, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(texts * 100 + images)
    inputs = {"input_ids": torch.randint(3, 99, (texts, length), generator=g),
              "pixel_values": torch.randn(images, 3, 32, 32, generator=g)}
    if padded:
        mask = torch.ones(texts, length, dtype=torch.long)
        mask[-1, length // 2:] = 0
        inputs["attention_mask"] = mask
    return inputs


@pytest.mark.parametrize(("name", "dtype", "counts"), [
    ("clip", torch.float32, (1, 1)), ("clip", torch.bfloat16, (2, 1)),
    ("siglip", torch.float32, (2, 1)), ("siglip", torch.bfloat16, (1, 1))])
def test_texts_and_images_are_counted_apart(name: str, dtype: torch.dtype, counts: tuple[int, int]) -> None:
    torch.manual_seed(0)
    if name == "clip":
        model = transformers.CLIPModel(transformers.CLIPConfig(**_CLIP))
    else:
        model = transformers.SiglipModel(transformers.SiglipConfig(**_CLIP))
    model = model.to(dtype).eval()
    padded = name == "clip"

    def cast(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

    gm = fxprep.prepare_model(model, example_inputs=cast(_texts_and_images(counts[0], 8, counts[1], padded)))
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert any("pixel_values': {0: 'images'}" in note for note in report.notes), report.notes
    for texts, length, images in ((3, 13, 2), (1, 5, 4)):
        later = cast(_texts_and_images(texts, length, images, padded))
        with torch.no_grad():
            got, want = gm(**later), model(**later)
        assert got["logits_per_image"].shape == (images, texts)
        assert torch.equal(got["logits_per_image"], want.logits_per_image)
        assert torch.equal(got["text_embeds"], want.text_embeds)
        assert differences(record(model, later), record(gm, later)) == []
