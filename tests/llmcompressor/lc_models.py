"""Tiny checkpoints and calibration data for llm-compressor's ``oneshot``, built offline.

``oneshot`` reads the model's config back from ``config.name_or_path`` and wants a processor, so a
model here is saved with a word-level tokenizer (no hub) and loaded from that folder, as a user's
checkpoint is. Calibration data is a ``datasets.Dataset`` of token ids of a few lengths (one sample a
batch, as oneshot batches by default), or a ``DataLoader`` of ready batches for vision-language models.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 128
# W4A16's groups are 128 wide: a width of 128 and MLPs of 256 quantize with its groups
WIDTH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=1, bos_token_id=3,
             eos_token_id=2)


def tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1", eos_token="t2",
                                   bos_token="t3")


def saved(model: nn.Module, folder: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model`` saved with a tokenizer and loaded back from its folder (what ``oneshot`` expects)."""
    folder = folder or tempfile.mkdtemp(prefix="fxprep-lc-")
    model.save_pretrained(folder)
    tokenizer(model.config.get_text_config().vocab_size).save_pretrained(folder)
    return type(model).from_pretrained(folder, dtype=dtype).eval()


def causal_lm_checkpoint(model_type: str, **config: Any) -> str:
    """A folder holding a tiny ``model_type`` causal LM of width 128 (random weights, seed 0) and a tokenizer."""
    settings = {**WIDTH, **config}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    folder = tempfile.mkdtemp(prefix="fxprep-lc-")
    model.save_pretrained(folder)
    tokenizer(settings["vocab_size"]).save_pretrained(folder)
    return folder


def causal_lm(model_type: str, dtype: torch.dtype = torch.float32, **config: Any) -> nn.Module:
    """A tiny ``model_type`` causal LM of width 128 (random weights, seed 0), loaded from its checkpoint."""
    return AutoModelForCausalLM.from_pretrained(causal_lm_checkpoint(model_type, **config), dtype=dtype).eval()


def built(make: Callable[[], nn.Module], dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return saved(make(), dtype=dtype)


def token_data(samples: int = 6, length: int = 16, vocab: int = VOCAB, seed: int = 1) -> Dataset:
    """Token ids of three lengths (``length``, -1, -2), each with its all-ones attention mask."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(samples):
        n = length - (i % 3)
        rows.append({"input_ids": torch.randint(3, vocab, (n,), generator=gen).tolist(), "attention_mask": [1] * n})
    return Dataset.from_list(rows)


def batches_loader(batches: list[dict[str, torch.Tensor]]) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the given batches as they are (a VLM's pixel values and image grid)."""
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (or exist on one side only): empty when bit-identical."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def oneshot_state(model: nn.Module, recipe: Any, data: Any, pipeline: str, **options: Any) -> dict[str, torch.Tensor]:
    """``oneshot`` on ``model`` with ``recipe``; the quantized model's state (its tensors cloned)."""
    from llmcompressor import oneshot

    import fxprep.compat.llmcompressor  # noqa: F401 - registers pipeline="fxprep"

    samples = len(data) if hasattr(data, "__len__") else 8
    kwargs = dict(num_calibration_samples=samples, pipeline=pipeline, max_seq_length=64)
    if isinstance(data, torch.utils.data.DataLoader):
        kwargs["processor"] = tokenizer(model.config.get_text_config().vocab_size)
    oneshot(model=model, dataset=data, recipe=recipe, **{**kwargs, **options})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def calibration(model: nn.Module) -> Iterator[None]:
    """What the calibration passes run in (no hooks, no quantization, eager attention)."""
    from fxprep.compat.llmcompressor.subgraphs import calibration_context

    with calibration_context(model):
        yield
