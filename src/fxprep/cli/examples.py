"""Example inputs for a transformers model the command line built (``transformers:TYPE``, a
checkpoint).

Each model wants what its forward needs (token ids, audio features, both of CLIP's towers, ids for
both halves of an encoder-decoder). The candidates come from the config
(its family's :meth:`~fxprep.families.Family.example_inputs`), fewest inputs first, and the first
the model runs on (a checkpoint's model tried as a twin on ``meta``) is given. When preparing then
fails, :func:`inputs_explained` says what the model said to each set and which inputs its forward
takes, so the user can name them with ``--input``.

See docs/cli.md ("Under the hood").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..core.inputs import ExampleInputs
from ..core.runs import run_model
from ..errors import FxprepError, InvalidInput
from ..families import family_for
from ..reporting.diagnose import first_line

Inputs = dict[str, torch.Tensor]


def candidates(model: nn.Module, *, seq_len: int) -> list[Inputs]:
    """Input sets for ``model`` (batch 1, ``seq_len`` tokens), on the CPU, fewest inputs first;
    empty for a model whose config says nothing of its inputs."""
    every = family_for(model).example_inputs(model, batch=1, seq_len=seq_len, device="cpu") or {}
    every.pop("attention_mask", None)
    main = getattr(model, "main_input_name", "input_ids")
    first = {k: v for k, v in every.items() if k in (main, "decoder_input_ids")}
    out = [first] if first else []
    if "input_features" in first:  # frames then bins (Parakeet, Cohere ASR), not Whisper's bins then frames
        out.append({**first, "input_features": first["input_features"].transpose(1, 2).contiguous()})
    if "input_values" in first:  # a waveform with its channel axis (DAC, EnCodec)
        out.append({**first, "input_values": first["input_values"].unsqueeze(1)})
        spectrogram = _spectrogram(model)
        if spectrogram is not None:  # frames x mel bins (the Audio Spectrogram Transformer's input_values)
            out.append({**first, "input_values": spectrogram})
    if every and every != first:
        out.append(every)
    return out


def _spectrogram(model: nn.Module) -> torch.Tensor | None:
    """A filter bank (1 x frames x bins) for a model whose ``input_values`` are one, as its config
    says (``num_mel_bins`` and the ``max_length`` in frames its position table was made for); None
    for a model whose config does not."""
    config = getattr(model, "config", None)
    bins, frames = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    if not (isinstance(bins, int) and isinstance(frames, int) and 0 < bins <= 1024 and 0 < frames <= 65536):
        return None
    return torch.randn(1, frames, bins, generator=torch.Generator().manual_seed(0))


class InputsNotRun(InvalidInput):
    """The model ran on none of the input sets the command built from its config (a usage error:
    the user names the inputs with ``--input``)."""


def refusal(model: nn.Module, inputs: Inputs) -> Exception | None:
    """What ``model`` raised when run on ``inputs`` (moved to its device); None when it ran."""
    device = device_of(model)
    try:
        run_model(model, ExampleInputs(kwargs={k: v.to(device) for k, v in inputs.items()}))
    except Exception as err:  # noqa: BLE001 - any failure means "not these inputs"; the next is tried
        return err
    return None


def first_that_runs(options: list[Inputs], probe: nn.Module) -> tuple[Inputs | None, list[str]]:
    """The first of ``options`` that ``probe`` runs on (None when none does), and for each one
    before it a line: the inputs as ``--input`` flags and what the model said."""
    refused: list[str] = []
    for inputs in options:
        err = refusal(probe, inputs)
        if err is None:
            return inputs, refused
        refused.append(f"{as_flags(inputs)}: {_first_line(err)}")
    return None, refused


def choose(options: list[Inputs], probe: nn.Module) -> Inputs | None:
    """The first of ``options`` that ``probe`` runs on (on the CPU, as made); the first option when
    none runs or when there is nothing to choose; None when there are none."""
    if len(options) < 2:
        return options[0] if options else None
    return first_that_runs(options, probe)[0] or options[0]


def as_flags(inputs: Inputs) -> str:
    """``inputs`` written as the command's ``--input NAME=DIMS:DTYPE`` flags."""
    return " ".join(f"--input {name}={'x'.join(str(d) for d in t.shape) or '1'}:{str(t.dtype).removeprefix('torch.')}"
                    for name, t in inputs.items())


@contextmanager
def inputs_explained(name: str, model: nn.Module, options: list[Inputs]) -> Iterator[None]:
    """Around ``prepare_model`` on inputs the command guessed (``options``, the first given): when
    preparing fails and ``model`` runs on none of ``options``, :class:`InputsNotRun` says what it
    said to each and what its forward takes; any other failure passes unchanged."""
    try:
        yield
    except FxprepError as err:
        if not options or isinstance(err, InvalidInput):
            raise
        ran, refused = first_that_runs(options, model)
        if ran is not None:
            raise
        where = device_of(model)
        raise InputsNotRun(
            f"{name}: the model runs on none of the inputs fxprep built from its config (tried on {where.type}):\n"
            + "".join(f"  {line}\n" for line in refused)
            + f"Name its inputs with --input NAME=DIMS[:DTYPE], one flag each; {_forward_takes(model)}.\n"
            f"(Preparing on the first set failed as well: {_first_line(err)})"
        ) from err


def _forward_takes(model: nn.Module) -> str:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward's signature is unreadable"
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [p.name for p in named if p.default is p.empty]
    text = f"{type(model).__name__}.forward takes {', '.join(p.name for p in named[:12])}"
    text += ", ..." if len(named) > 12 else ""
    return text + (f" (required: {', '.join(required)})" if required else "")


def _first_line(err: BaseException) -> str:
    """``Type: first line``; a heading (a line ending in a colon) with its first entry."""
    said = first_line(err, 300)
    if said.endswith(":"):
        said += " " + next((line.strip() for line in str(err).strip().splitlines()[1:] if line.strip()), "")
    return f"{type(err).__name__}: {said.strip()}"


def device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (``meta`` for a model built there); the CPU without any."""
    tensor: Any = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")
