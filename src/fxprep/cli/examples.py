"""Example inputs for a transformers model the command line built (``transformers:TYPE``, a checkpoint).

The command gives one input set where each model wants what its forward needs: a language model
its token ids, a speech encoder float features with its own bin count, CLIP both towers' inputs
(its forward fails on ids alone), an encoder-decoder ids for both halves. Guessing from
``main_input_name`` alone gave CLIP ids only and Whisper integer "features": the model's own
error, on a model fxprep could prepare.

The candidates come from the config (:func:`~fxprep.capture.huggingface.example_inputs_for`),
fewest inputs first: the main input alone (with decoder ids for an encoder-decoder), audio in
the other layouts models use, then every input the config describes. The first the model runs
on is the one given; a checkpoint's model is tried as a twin on ``meta``, so that no weights move
and no real forward is paid for. When none runs, the first is given and ``prepare_model`` says
what the model itself said. No attention mask: the command's inputs are unpadded, and a mask of
ones is a value the graph would depend on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..capture.huggingface import example_inputs_for
from ..inputs import ExampleInputs
from ..runs import run_model

Inputs = dict[str, torch.Tensor]


def candidates(model: nn.Module, *, seq_len: int) -> list[Inputs]:
    """Input sets for ``model`` (batch 1, ``seq_len`` tokens), on the CPU, fewest inputs first;
    empty for a model whose config says nothing of its inputs."""
    every = example_inputs_for(model, batch=1, seq_len=seq_len, device="cpu") or {}
    every.pop("attention_mask", None)
    main = getattr(model, "main_input_name", "input_ids")
    first = {k: v for k, v in every.items() if k in (main, "decoder_input_ids")}
    out = [first] if first else []
    if "input_features" in first:  # frames then bins (Parakeet, Cohere ASR), not Whisper's bins then frames
        out.append({**first, "input_features": first["input_features"].transpose(1, 2).contiguous()})
    if "input_values" in first:  # a waveform with its channel axis (DAC, EnCodec)
        out.append({**first, "input_values": first["input_values"].unsqueeze(1)})
    if every and every != first:
        out.append(every)
    return out


def runs_on(model: nn.Module, inputs: Inputs) -> bool:
    """Whether ``model`` runs on ``inputs`` (moved to its device) without raising."""
    device = device_of(model)
    try:
        run_model(model, ExampleInputs(kwargs={k: v.to(device) for k, v in inputs.items()}))
    except Exception:  # noqa: BLE001 - any failure means "not these inputs"; the next is tried
        return False
    return True


def choose(options: list[Inputs], probe: nn.Module) -> Inputs | None:
    """The first of ``options`` that ``probe`` runs on (on the CPU, as made); the first option when
    none runs or when there is nothing to choose; None when there are none."""
    if len(options) < 2:
        return options[0] if options else None
    return next((o for o in options if runs_on(probe, o)), options[0])


def device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (``meta`` for a model built there); the CPU without any."""
    tensor: Any = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")
