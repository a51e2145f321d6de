"""Dynamic dimensions found automatically: a transformers model's batch and sequence dimensions.

transformers names its inputs and fixes their layout, so when the user says nothing about
``dynamic``, :func:`propose` declares dimension 0 ``batch`` and the token dimension ``seq`` (and
``choices``, ``images``, a speech model's samples or frames where those layouts apply), and grows
the example where a size is below 2. ``prepare_model`` captures with the proposal, verifies on a
second size, and narrows it (:attr:`Proposal.narrower`) or falls back to static shapes, saying why.
:func:`~.violation.findings` reads which dimensions the model's code specialised.

See docs/shapes.md for what is declared for which model, and "Under the hood" for the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...core.inputs import ExampleInputs
from .dims import MaybeDynamic, dynamic_dims, named_inputs, positional_names, repeated_to

# input name -> {dimension: symbol}; every other dimension of that input stays static
_TOKENS = {0: "batch", 1: "seq"}
TABLE: dict[str, dict[int, str]] = {
    "input_ids": _TOKENS, "attention_mask": _TOKENS, "token_type_ids": _TOKENS, "position_ids": _TOKENS,
    "inputs_embeds": _TOKENS, "labels": _TOKENS, "special_tokens_mask": _TOKENS, "mm_token_type_ids": _TOKENS,
    "decoder_input_ids": {0: "batch", 1: "decoder_seq"}, "decoder_attention_mask": {0: "batch", 1: "decoder_seq"},
    "decoder_inputs_embeds": {0: "batch", 1: "decoder_seq"},
    "cross_attention_mask": {0: "batch", 1: "seq"},  # Mllama: batch x tokens x images x tiles
}
# a multiple-choice head's token inputs are batch x choices x tokens (x hidden, for embeddings): every
# choice is one more sequence of the same length, and a calibration set has its own number of choices
_CHOICES = {0: "batch", 1: "choices", 2: "seq"}
_PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds", "special_tokens_mask")
_VISION_ONLY = {"pixel_values": {0: "batch"}, "pixel_mask": {0: "batch"}}  # only where no token input is given
# inputs that put a prompt's tokens on "seq": an audio input's length is declared only without one
# (beside a prompt, as in an audio language model, the audio is a multimodal input: its frames are not the prompt's)
_PROMPT = {name for name, dims in TABLE.items() if "seq" in dims.values()} - {"attention_mask"}
# where a config says how many features an audio frame has (a filter bank's mel bins, a projection's input)
_FEATURE_SIZES = {"num_mel_bins", "feature_size", "feature_projection_input_dim", "input_feat_per_channel", "n_mels"}
MULTIMODAL_BATCH = ("a multimodal example: the batch stays at the example's size, because how the other inputs "
                    "({names}) are laid out per sample is the model's own; the sequence (the prompt's length) is free")


@dataclass(frozen=True)
class SizeRange:
    """The sizes a declared symbol may take (``None``: no bound that side), and why. Where it came
    from decides what is done with it, so that is said in fields rather than in the text:
    ``from_guards``, the range is where the guards Dynamo put on the symbol hold, evaluated from
    their text (:mod:`.guard_range`), always a limit the prepared module checks
    (:func:`fxprep.capture.shape_general.limits`); ``unproven``, export's solver could not prove those guards
    over any range, so the symbol is declared maybe-dynamic (``Dim.AUTO``, :meth:`Proposal.for_export`)."""

    low: int | None
    high: int | None
    why: str
    from_guards: bool = False
    unproven: bool = False

    def joined(self, why: str) -> SizeRange:
        """The same range with ``why`` added to its reason."""
        return replace(self, why=f"{self.why}; {why}" if self.why else why)


_NO_RANGE = SizeRange(None, None, "")


@dataclass(frozen=True)
class BranchesRead:
    """The branches of the model's code on the declared dimensions (``found``:
    :class:`..dynamo.size_branches.Branch` each), read off a maybe-dynamic capture's guards
    (:func:`..dynamo.guard_read.branches`), with what that capture was: its dimensions, the example's
    sizes, the scans it kept opaque. A branch inside an opaque scan runs eagerly at each call, the
    graph holds either way: not one the prepared module must stay on."""

    dynamic: dict[str, dict[int, str]]
    sizes: dict[str, int]
    scans: tuple[Any, ...]
    found: list[Any]


@dataclass
class Proposal:
    """The dimensions to declare (``dynamic`` in the form the option takes) and the example to
    capture on; ``dropped``: dimensions found specialised, with why (filled by the caller)."""

    dynamic: dict[str, dict[int, str]]
    capture_example: ExampleInputs
    dropped: dict[tuple[str, int], str] = field(default_factory=dict)
    ranges: dict[str, SizeRange] = field(default_factory=dict)  # symbol -> the sizes Dynamo bounded it to
    source: str = "the model's input names (transformers layout)"  # how the dimensions were found, for the report
    # the ranges a branch of the model's code sets (symbol -> min, max, where): the prepared module checks
    # them; any other range is a bound Dynamo's trace took from a kernel's shape logic (shape_general.limits)
    limits: dict[str, SizeRange] = field(default_factory=dict)
    explicit: bool = False  # the user's own dynamic= (:func:`declared`): never dropped, never static instead
    # a multimodal example's batch declared with its images: the length alone, tried where that does not hold
    narrower: Proposal | None = None
    # per-step loops kept opaque so that the symbol they loop over stays dynamic (:class:`..dynamo.scans.Scan` each)
    scans: tuple[Any, ...] = ()
    # every dimension declared maybe-dynamic (Dim.AUTO) for this capture, its guards read after it
    # (:mod:`..dynamo.guard_read`): kept where they hold at every size, else captured again declared as ``Dim``\ s
    auto: bool = False
    # the branches of the model's code on these dimensions read off a maybe-dynamic capture's guards
    # (:class:`BranchesRead`); None: not read, a trace finds them (:func:`..shape_general.limits`)
    branches: BranchesRead | None = None

    def sizes(self, model: nn.Module, example: ExampleInputs) -> dict[str, int]:
        """Each declared symbol's size in ``example`` (the capture example, or one grown from it)."""
        inputs = named_inputs(model, example)
        return {sym: int(inputs[name].shape[d]) for name, dims in self.dynamic.items() for d, sym in dims.items()
                if isinstance(inputs.get(name), torch.Tensor)}

    def read_here(self, model: nn.Module) -> list[Any] | None:
        """The branches read (:attr:`branches`) where they were read for this proposal's capture: its
        dimensions, the example's sizes, the same scans opaque; else None (a trace finds them)."""
        read = self.branches
        if read is None or (read.dynamic, read.sizes, read.scans) != (
                self.dynamic, self.sizes(model, self.capture_example), self.scans):
            return None
        return read.found

    def describe(self) -> str:
        parts = [f"{name} dim {d} ({sym})" for name, dims in self.dynamic.items() for d, sym in sorted(dims.items())]
        return ", ".join(parts)

    def for_export(self) -> dict[str, dict[int, Any]]:
        """``dynamic`` with each symbol one ``torch.export.Dim`` (its range where the model's code
        bounds it, e.g. a sequence no longer than a learned position table), or a
        :class:`~.dims.MaybeDynamic` where export cannot prove the guards that bound it
        (:attr:`SizeRange.unproven`: the prepared module checks that range itself), or where the
        capture is to be read from its guards (:attr:`auto`)."""
        from torch.export import Dim

        made: dict[str, Any] = {}
        for sym in {s for dims in self.dynamic.values() for s in dims.values()}:
            size = self.ranges.get(sym, _NO_RANGE)
            bounds = {k: v for k, v in (("min", size.low), ("max", size.high)) if v is not None}
            made[sym] = MaybeDynamic(sym) if size.unproven or (self.auto and not bounds) else Dim(sym, **bounds)
        return {name: {d: made[sym] for d, sym in dims.items()} for name, dims in self.dynamic.items()}


def is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def propose(model: nn.Module, call: ExampleInputs) -> Proposal | None:
    """The batch and sequence dimensions of ``call`` (the example as Dynamo is called with it, its
    concrete arguments taken out) for a transformers ``model``, or None when the model or an input
    is not one this module knows (see the module docstring)."""
    if not is_transformers_model(model):
        return None
    inputs = named_inputs(model, call)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return None
    table = dict(TABLE)
    if _multiple_choice(tensors):
        table.update({name: _CHOICES for name in _PER_TOKEN})
    if not any(name in TABLE for name in tensors):
        table.update(_VISION_ONLY)
    elif _two_towers(model):  # texts and images are two sets: each has its own count
        table.update({name: {0: "images"} for name in tensors if name not in table})
    if not any(name in _PROMPT for name in tensors):
        table.update(_audio(model, tensors))
    others = sorted(name for name in tensors if name not in table)
    if others and len(others) == len(tensors):
        return None  # no input whose layout is known: static shapes, as before
    dynamic: dict[str, dict[int, str]] = {}
    sizes: dict[str, int] = {}
    per_sample = others and _per_sample(tensors, others)
    for name, value in tensors.items():
        chosen = {}
        dims = table.get(name, {})
        if per_sample and name in others:
            dims = {0: "batch"}
        for d, sym in dims.items():
            if d >= value.dim() or (dims is _TOKENS and d == 1 and name.endswith("attention_mask") and value.dim() != 2):
                continue
            if others and not per_sample and sym == "batch":
                continue  # multimodal, not one row per sample: the batch stays (module docstring)
            if sizes.setdefault(sym, int(value.shape[d])) != int(value.shape[d]):
                return None  # two inputs disagree on what should be one size
            chosen[d] = sym
        if chosen:
            dynamic[name] = chosen
    if not dynamic or (not others and "batch" not in sizes):
        return None
    dropped: dict[tuple[str, int], str] = {}
    if others:
        seq_sizes = {size for sym, size in sizes.items() if sym != "batch"}
        if any(int(n) in seq_sizes for name in others for n in tensors[name].shape):
            return None  # another input may be sized by the sequence (module docstring)
        why = MULTIMODAL_BATCH.format(names=", ".join(others))
        if not per_sample:
            dropped = {(name, 0): why for name in dynamic}
        else:  # the batch too, and the length alone where it does not hold (:func:`narrower`)
            length = {n: {d: s for d, s in ds.items() if s != "batch"} for n, ds in dynamic.items() if n not in others}
            length = {n: ds for n, ds in length.items() if ds}
            dropped_batch = {(name, 0): why for name in dynamic}  # the images' rows too: one reason for all
            fallback = Proposal(length, _grown(model, call, length, {k: v for k, v in sizes.items() if k != "batch"}),
                                dropped_batch) if length else None
            return Proposal(dynamic, _grown(model, call, dynamic, sizes), narrower=fallback)
    return Proposal(dynamic, _grown(model, call, dynamic, sizes), dropped)


def _multiple_choice(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the token inputs are laid out per choice (``batch x choices x tokens``, as
    transformers' ``...ForMultipleChoice`` heads take them): ids of three dimensions, or embeddings of
    four. Read as a prompt's ``batch x tokens``, the choices were declared the sequence and the tokens
    kept at the example's length."""
    ids, embeds = tensors.get("input_ids"), tensors.get("inputs_embeds")
    return (ids is not None and ids.dim() == 3) or (embeds is not None and embeds.dim() == 4)


def _two_towers(model: nn.Module) -> bool:
    """Whether ``model`` is a contrastive text-image model (CLIP, SigLIP, ALIGN, BLIP's retrieval
    model ...: the classes transformers registers for zero-shot image classification). Its texts
    and images are two sets scored against each other (``logits_per_image`` is images x texts), not
    one image per prompt: the texts' batch and the images' count are declared apart (``batch``,
    ``images``), as calibration data pairs any number of each."""
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        )
    except ImportError:  # transformers without the table: the multimodal layout, as before
        return False
    names = set(MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES.values())
    return any(c.__name__ in names and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _audio(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, dict[int, str]]:
    """The layout of a speech model's audio input, batch first and then its length. ``input_values``
    is mostly a waveform (``batch x samples``, or ``batch x channels x samples``), ``input_features``
    a filter bank, ``batch x frames x features`` for some models (Speech2Text, Wav2Vec2-BERT,
    Parakeet) and ``batch x features x frames`` for others (Whisper); the Audio Spectrogram
    Transformer names its filter bank ``input_values``. Of three dimensions, the frames are the one
    of the padding mask's length where a mask is given, else the one that is not the number of
    features the config names; where neither tells them apart, a waveform's samples are its last
    dimension and of a filter bank only the batch is declared. Calibration audio comes in every
    length, as text does."""
    found: dict[str, dict[int, str]] = {}
    mask = tensors.get("attention_mask")
    for name in ("input_values", "input_features"):
        value = tensors.get(name)
        if value is None or value.dim() not in (2, 3):
            continue
        if value.dim() == 2:
            found[name] = {0: "batch", 1: "seq"}
            continue
        sizes = {int(mask.shape[1])} if mask is not None and mask.dim() == 2 else set()
        frames = [d for d in (1, 2) if int(value.shape[d]) in sizes]
        if len(frames) != 1:
            known = _config_ints(getattr(model, "config", None), _FEATURE_SIZES)
            frames = [d for d in (1, 2) if int(value.shape[3 - d]) in known and int(value.shape[d]) not in known]
        if len(frames) != 1 and name == "input_values":
            frames = [2]  # a waveform with channels (batch x channels x samples)
        found[name] = {0: "batch", frames[0]: "seq"} if len(frames) == 1 else {0: "batch"}
    return found


def _config_ints(config: Any, keys: set[str]) -> set[int]:
    """Every integer a transformers ``config`` (its sub-configs too: an encoder's, an audio tower's)
    gives under one of ``keys``."""
    found: set[int] = set()
    todo = [config.to_dict()] if hasattr(config, "to_dict") else []
    while todo:
        items = todo.pop()
        for key, value in items.items():
            if isinstance(value, dict):
                todo.append(value)
            elif key in keys and isinstance(value, int) and not isinstance(value, bool):
                found.add(value)
    return found


def batch_not_held(narrower: Proposal, why: str) -> Proposal:
    """``narrower`` (a multimodal example's length alone) saying why the batch stays: declared with
    the images, it did not hold (``why``: the capture's or the second size's failure)."""
    text = f"declared dynamic with the other inputs (one row per sample), the batch did not hold: {why}"
    return replace(narrower, dropped={key: text for key in narrower.dropped})


def _per_sample(tensors: dict[str, torch.Tensor], others: list[str]) -> bool:
    """Whether every input of a layout this module does not know (``pixel_values``, image sizes,
    aspect ratios) has one row per sample: its dimension 0 is the batch of the token inputs (a
    Gemma3 or Llava example: one image per prompt). Then the batch is declared for them too, the
    example grown by repeating whole samples. Patches of every image in one tensor (Qwen2-VL), or
    several tiles of one prompt's image (Aya Vision) have another size there: the batch stays."""
    batch = {int(v.shape[0]) for name, v in tensors.items() if name in TABLE and v.dim() >= 1}
    return len(batch) == 1 and all(tensors[name].dim() >= 1 and int(tensors[name].shape[0]) in batch for name in others)


DECLARED = "your dynamic= option"


def declared(model: nn.Module, call: ExampleInputs, dynamic: Any) -> Proposal | None:
    """The user's ``dynamic=`` as a proposal, so that a bound Dynamo puts on a declared dimension is
    read, kept as a limit where a branch of the model sets it, and captured with, as for the found
    ones (before, a convolution's bound on the batch failed Dynamo for every CNN given
    ``dynamic="batch"``, and fx took over). Sizes below 2 are grown as :func:`propose` does. Only
    for dimensions named by strings (``"batch"``, ``{input: {dim: "name"}}``); None for
    ``torch.export.Dim`` objects, whose own ranges stand, or when ``dynamic`` names no tensor."""
    if not (dynamic == "batch" or isinstance(dynamic, dict) and all(
            isinstance(dims, dict) and all(isinstance(n, str) for n in dims.values()) for dims in dynamic.values())):
        return None
    dims, inputs = dynamic_dims(model, call, dynamic), named_inputs(model, call)
    if not dims or any(not isinstance(inputs.get(n), torch.Tensor) or not all(0 <= d < inputs[n].dim() for d in ds)
                       for n, ds in dims.items()):
        return None  # nothing declared, or a dimension the example lacks: the input check says so
    sizes = {sym: int(inputs[name].shape[d]) for name, ds in dims.items() for d, sym in ds.items()}
    return Proposal(dims, _grown(model, call, dims, sizes), source=DECLARED, explicit=True)


BAKED_BATCH = ("dimension 0 of the inputs, after the static capture baked the example's batch into the graph "
               "(the batch probe)")


def batch_proposal(model: nn.Module, call: ExampleInputs) -> Proposal | None:
    """Dimension 0 of every input tensor of the example's batch size, as ``batch``: for a model
    outside transformers whose static-shape graph the batch probe found specialised to the
    example's batch with no branch on it (a ViT's ``cls_token.expand(B, -1, -1)``), captured again
    with it declared (on an example grown to batch 2 where it is 1). None without such an input."""
    inputs = {k: v for k, v in named_inputs(model, call).items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
    if not inputs:
        return None
    batch = int(next(iter(inputs.values())).shape[0])
    dynamic = {name: {0: "batch"} for name, value in inputs.items() if int(value.shape[0]) == batch}
    return Proposal(dynamic, _grown(model, call, dynamic, {"batch": batch}), source=BAKED_BATCH)


def _grown(model: nn.Module, call: ExampleInputs, dynamic: dict[str, dict[int, str]],
           sizes: dict[str, int]) -> ExampleInputs:
    """``call`` with each dynamic size below 2 grown to a size of at least 2 that no other dynamic
    size has (:func:`~.dims.repeated_to`)."""
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
            if target[sym] != int(value.shape[d]):
                value = repeated_to(value, d, target[sym])
        return value

    names = positional_names(model, len(call.args))
    args = tuple(grow(n, a) if isinstance(a, torch.Tensor) else a for n, a in zip(names, call.args))
    kwargs = {k: grow(k, v) if isinstance(v, torch.Tensor) else v for k, v in call.kwargs.items()}
    return ExampleInputs(args, kwargs)


def revised(proposal: Proposal, dims: dict[tuple[str, int], str], ranges: dict[str, SizeRange],
            model: nn.Module, call: ExampleInputs) -> Proposal | None:
    """``proposal`` less the dimensions ``dims`` (found specialised; every input sharing their symbol
    too: one size) and with the symbols in ``ranges`` bounded; None when no dimension is left."""
    symbols = {proposal.dynamic[n][d] for n, d in dims if d in proposal.dynamic.get(n, {})}
    dynamic = {n: {d: s for d, s in ds.items() if s not in symbols} for n, ds in proposal.dynamic.items()}
    dynamic = {n: ds for n, ds in dynamic.items() if ds}
    if not dynamic:
        return None
    sizes: dict[str, int] = {}
    inputs = named_inputs(model, call)
    for name, ds in dynamic.items():
        for d, sym in ds.items():
            sizes[sym] = int(inputs[name].shape[d])
    dropped = dict(proposal.dropped)
    for (n, d), why in dims.items():
        for other, ds in proposal.dynamic.items():
            for od, sym in ds.items():
                if sym == proposal.dynamic.get(n, {}).get(d):
                    dropped.setdefault((other, od), why)
    bounded = {**proposal.ranges, **{k: v for k, v in ranges.items() if k not in symbols}}
    narrower = proposal.narrower if "batch" in sizes else None  # the batch gone: nothing narrower to try
    scans = tuple(scan for scan in proposal.scans if scan.symbol in sizes)  # a loop over a dropped symbol: traced again
    return replace(proposal, dynamic=dynamic, capture_example=_grown(model, call, dynamic, sizes), dropped=dropped,
                   ranges=bounded, limits={}, narrower=narrower, scans=scans, auto=False)
