"""A transformers checkpoint written in another layout than the model keeps in memory.

transformers 5 keeps some weights in memory in another layout than the hub's files (stacked experts,
moved VLM prefixes, renamed heads) and converts them in ``from_pretrained``. Rather than reimplement
those rules, :func:`converted` has transformers load the checkpoint into a model of the prepared
model's class (safetensors only, no checkpoint code) and hands its state_dict, uncopied, to
:func:`fxprep.load_weights`; keys transformers did not find stay missing.

See docs/checkpoints.md ("Checkpoints in the hub's layout").
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...big.checkpoint import Checkpoint, open_checkpoint

_MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is a few kB; a VLM's with every sub-config a few hundred


def converted(source: Any, original: nn.Module | None, device: torch.device,
              dtype: torch.dtype | None) -> tuple[Checkpoint | None, str]:
    """``source`` (a checkpoint directory with a ``config.json``) in the layout of ``original``'s
    class, or of the class its ``config.json`` names when the prepared module has no original (one
    ``fxprep.load`` gave back), loaded onto ``device`` in ``dtype`` (the checkpoint's own when None).
    ``(None, why)`` where it does not apply (``why`` empty) or transformers could not load it."""
    if not isinstance(source, (str, Path)) or not (Path(source) / "config.json").is_file():
        return None, ""
    cls = _model_class(original, Path(source))
    if cls is None:
        return None, ""
    kwargs: dict[str, Any] = {"use_safetensors": True, "output_loading_info": True, "dtype": dtype or "auto"}
    config = getattr(original, "config", None)
    if config is not None:
        kwargs["config"] = copy.deepcopy(config)  # the configuration the graph was prepared from
    if device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}
    try:
        with warnings.catch_warnings(), _quiet_transformers():
            warnings.simplefilter("ignore")
            model, info = cls.from_pretrained(str(source), **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure: the key mismatch stands, with transformers' reason
        text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        return None, f"transformers could not load it in {cls.__name__}'s layout either ({type(err).__name__}: {text})."
    unexpected = sorted(info.get("unexpected_keys", ()))
    if unexpected:  # what it would drop without a word: an error here as for any other checkpoint
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        return None, f"transformers, converting it to {cls.__name__}'s layout, has no place for {len(unexpected)} key(s) either: {shown}."
    missing = set(info.get("missing_keys", ()))
    state = {k: v for k, v in model.state_dict().items() if k not in missing}
    checkpoint = open_checkpoint(state)
    checkpoint.where = f"{source} (in {cls.__name__}'s layout: converted by transformers' from_pretrained)"
    return checkpoint, ""


def _model_class(original: nn.Module | None, path: Path) -> Any:
    """The transformers class to load with: the prepared model's own, else the first of
    ``architectures`` in ``config.json`` that transformers defines (a name, looked up in the
    ``transformers`` namespace: nothing the file names is imported); None for neither."""
    try:
        import transformers
    except ImportError:
        return None
    base = transformers.PreTrainedModel
    if original is not None:
        return type(original) if isinstance(original, base) else None
    try:
        if path.joinpath("config.json").stat().st_size > _MAX_CONFIG_BYTES:
            return None
        names = json.loads(path.joinpath("config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    for name in names if isinstance(names, list) else []:
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, base):
            return cls
    return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loading report (the keys it renamed, merged, found missing) would print as
    warnings, and its progress bar as a line per shard: ``load_weights`` says what matters in its
    own note and errors."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers")
    level, bar = logger.level, hf_logging.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bar:
            hf_logging.enable_progress_bar()
