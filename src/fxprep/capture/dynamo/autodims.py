"""Dynamic dimensions found automatically: a transformers model's batch and sequence dimensions.

Dynamo captures with static shapes unless told otherwise, so a language model prepared on one
example (batch 1, 8 tokens) would refuse batch 4 or 64 tokens, although calibration data for a
quantizer comes in every batch size and length, and AIMET's and torch.fx's graphs never had this
limit. What the dimensions of a transformers model's inputs mean is not a guess: the library names
its inputs (``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids``,
``inputs_embeds``, ``pixel_values`` ...) and fixes their layout (batch first, then sequence). So
for such a model, when the user says nothing about ``dynamic``, :func:`propose` declares
dimension 0 of every input ``batch`` and dimension 1 of the token-level inputs ``seq`` (the
decoder's ``decoder_seq``) and gives the example to capture on, grown where a size is below 2
(Dynamo specialises sizes 0 and 1; the extra rows repeat the first ones, so ids and masks stay
valid), and with batch and sequence sizes kept apart (equal sizes would share one symbol).
``prepare_model`` captures with them, verifies the result on the user's example and on a second
size, and falls back to static shapes (saying why) when any of that fails.

Where a declared dimension turns out to be specialised by the model's code, Dynamo says so in a
constraint violation; :func:`specialised` reads which dimensions and why, so the capture is retried
without them and the report and :class:`~fxprep.errors.InputMismatch` name them.

Not proposed (the model keeps static shapes and the batch probe, as before): models outside
transformers, and any example with an input this table does not know (an image grid, a VLM's
``pixel_values`` whose size follows the image tokens in ``input_ids``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...inputs import ExampleInputs
from .shapes import positional_names

# input name -> {dimension: symbol}; every other dimension of that input stays static
_TOKENS = {0: "batch", 1: "seq"}
TABLE: dict[str, dict[int, str]] = {
    "input_ids": _TOKENS, "attention_mask": _TOKENS, "token_type_ids": _TOKENS, "position_ids": _TOKENS,
    "inputs_embeds": _TOKENS, "labels": _TOKENS, "special_tokens_mask": _TOKENS,
    "decoder_input_ids": {0: "batch", 1: "decoder_seq"}, "decoder_attention_mask": {0: "batch", 1: "decoder_seq"},
    "decoder_inputs_embeds": {0: "batch", 1: "decoder_seq"},
}
_VISION_ONLY = {"pixel_values": {0: "batch"}, "pixel_mask": {0: "batch"}}  # only where no token input is given


@dataclass
class Proposal:
    """The dimensions to declare (``dynamic`` in the form the option takes) and the example to
    capture on; ``dropped``: dimensions found specialised, with why (filled by the caller)."""

    dynamic: dict[str, dict[int, str]]
    capture_example: ExampleInputs
    dropped: dict[tuple[str, int], str] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{name} dim {d} ({sym})" for name, dims in self.dynamic.items() for d, sym in sorted(dims.items())]
        return ", ".join(parts)


def is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _named_inputs(model: nn.Module, call: ExampleInputs) -> dict[str, Any]:
    return {**dict(zip(positional_names(model, len(call.args)), call.args)), **call.kwargs}


def propose(model: nn.Module, call: ExampleInputs) -> Proposal | None:
    """The batch and sequence dimensions of ``call`` (the example as Dynamo is called with it, its
    concrete arguments taken out) for a transformers ``model``, or None when the model or an input
    is not one this module knows (see the module docstring)."""
    if not is_transformers_model(model):
        return None
    inputs = _named_inputs(model, call)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return None
    table = dict(TABLE)
    if not any(name in TABLE for name in tensors):
        table.update(_VISION_ONLY)
    dynamic: dict[str, dict[int, str]] = {}
    sizes: dict[str, int] = {}
    for name, value in tensors.items():
        dims = table.get(name)
        if dims is None:
            return None  # an input whose layout is not known: static shapes, as before
        chosen = {}
        for d, sym in dims.items():
            if d >= value.dim() or (d == 1 and name.endswith("attention_mask") and value.dim() != 2):
                continue
            if sizes.setdefault(sym, int(value.shape[d])) != int(value.shape[d]):
                return None  # two inputs disagree on what should be one size
            chosen[d] = sym
        if chosen:
            dynamic[name] = chosen
    if "batch" not in sizes:
        return None
    return Proposal(dynamic, _grown(model, call, dynamic, sizes))


def _grown(model: nn.Module, call: ExampleInputs, dynamic: dict[str, dict[int, str]],
           sizes: dict[str, int]) -> ExampleInputs:
    """``call`` with each dynamic size below 2 grown to a size of at least 2 that no other dynamic
    size has (rows repeat the first ones)."""
    target: dict[str, int] = {}
    taken = set(sizes.values())
    for sym, size in sizes.items():
        if size >= 2:
            target[sym] = size
            continue
        new = 2
        while new in taken:
            new += 1
        taken.add(new)
        target[sym] = new
    if target == sizes:
        return call

    def grow(name: str, value: Any) -> Any:
        for d, sym in dynamic.get(name, {}).items():
            size, want = int(value.shape[d]), target[sym]
            if want != size:
                reps = -(-want // size)
                value = torch.cat([value] * reps, dim=d).narrow(d, 0, want)
        return value

    names = positional_names(model, len(call.args))
    args = tuple(grow(n, a) if isinstance(a, torch.Tensor) else a for n, a in zip(names, call.args))
    kwargs = {k: grow(k, v) if isinstance(v, torch.Tensor) else v for k, v in call.kwargs.items()}
    return ExampleInputs(args, kwargs)


_SOURCE = re.compile(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]")


def specialised(err: BaseException, proposal: Proposal) -> dict[tuple[str, int], str]:
    """The declared dimensions Dynamo's constraint violation (``err``) says the model's code
    specialises, with its reason for each: ``{(input name, dim): why}``. Empty when ``err`` is
    something else."""
    text = str(err)
    if "onstraint" not in text and "specializ" not in text and "specialis" not in text:
        return {}
    declared = {(n, d) for n, dims in proposal.dynamic.items() for d in dims}
    found: dict[tuple[str, int], str] = {}
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        for m in _SOURCE.finditer(line):
            key = (m.group(1), int(m.group(2)))
            if key in declared and key not in found:
                found[key] = line[:300]
    if not found:  # torch names the Dim, not the source: match the symbol names
        for name, dims in proposal.dynamic.items():
            for d, sym in dims.items():
                hit = next((line for line in lines if re.search(rf"\b{re.escape(sym)}\b", line)), None)
                if hit is not None:
                    found[(name, d)] = hit[:300]
    return found


def without(proposal: Proposal, dims: dict[tuple[str, int], str], model: nn.Module, call: ExampleInputs) -> Proposal | None:
    """``proposal`` less the dimensions ``dims`` (found specialised), every input sharing their symbol
    included (one size); None when no batch or sequence dimension is left."""
    symbols = {proposal.dynamic[n][d] for n, d in dims if d in proposal.dynamic.get(n, {})}
    dynamic = {n: {d: s for d, s in ds.items() if s not in symbols} for n, ds in proposal.dynamic.items()}
    dynamic = {n: ds for n, ds in dynamic.items() if ds}
    if not dynamic:
        return None
    sizes: dict[str, int] = {}
    inputs = _named_inputs(model, call)
    for name, ds in dynamic.items():
        for d, sym in ds.items():
            sizes[sym] = int(inputs[name].shape[d])
    dropped = dict(proposal.dropped)
    for (n, d), why in dims.items():
        for other, ds in proposal.dynamic.items():
            for od, sym in ds.items():
                if sym == proposal.dynamic.get(n, {}).get(d):
                    dropped.setdefault((other, od), why)
    return Proposal(dynamic, _grown(model, call, dynamic, sizes), dropped)
