"""Model-family knowledge behind one registry: what the pipeline asks a model's family.

:class:`Family` is the contract (every answer neutral by default); :func:`family_for` gives a
model's family, told by identity (``isinstance``), or the neutral :data:`NEUTRAL`. A family lives in
its own sub-package, which exports ``FAMILY`` and is named once, in :data:`FAMILIES`. The registry
loads families by name on first use: it imports no family and nothing of fxprep, so a family may
use capture/, big/ and core/ helpers while they import only this contract. A family imports its
library only for a model of that library (fxprep runs without it). See docs/architecture.md ("A new
model-family quirk").
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

# The registered families: sub-packages of this one, each exporting FAMILY; asked in this order.
FAMILIES = ("transformers",)


class Family:
    """What the pipeline asks a model family; this base answers for a model of no family (nothing
    added, nothing changed). A family overrides what it knows."""

    name = "none"
    # the report's note when :meth:`absent_outputs` names outputs the prepared module will not return
    absent_note = ""

    def matches(self, model: Any) -> bool:
        """Whether ``model`` is (or wraps) a model of this family; by identity, never by name."""
        return False

    # --- around all of fxprep's work on a model (prepare_model, check_traceability, verify_prepared)
    def working_on(self, model: Any) -> AbstractContextManager[None]:
        """Entered for as long as fxprep works on ``model`` (each of its runs and captures)."""
        return contextlib.nullcontext()

    # --- the arguments
    def concrete_args(self, model: nn.Module, concrete: dict[str, Any] | None,
                      example: Any) -> dict[str, Any] | None:
        """``concrete`` plus what the family fixes for capture (``example``: the normalized inputs)."""
        return concrete

    def absent_outputs(self, user_concrete: dict[str, Any] | None,
                       concrete: dict[str, Any] | None) -> dict[str, str]:
        """``{output key: why}`` the prepared module will not return because of what
        :meth:`concrete_args` added to ``user_concrete``."""
        return {}

    def without_added(self, concrete: dict[str, Any] | None, absent: dict[str, str]) -> dict[str, Any] | None:
        """``concrete`` without what :meth:`concrete_args` added (how the user calls the original)."""
        return concrete

    def example_inputs(self, model: nn.Module, batch: int = 2, seq_len: int = 8, *,
                       device: torch.device | str | None = None) -> dict[str, torch.Tensor] | None:
        """Keyword example inputs built from what the model says of itself (a config), or None."""
        return None

    def tuple_output(self, model: nn.Module) -> tuple[dict[str, Any], str] | None:
        """The concrete arguments that make ``model`` return a plain tuple (for a toolkit that
        refuses dict outputs), and the report's note; None when it has none to set."""
        return None

    # --- each capture
    def capture_context(self, model: nn.Module, notes: list[str] | None = None, example: Any = None,
                        dynamic_length: int | None = None) -> AbstractContextManager[None]:
        """Entered around each capture of ``model`` on ``example`` (``notes``: the report's, to add
        to; ``dynamic_length``: the example's length where one is declared dynamic)."""
        return contextlib.nullcontext()

    def recover(self, err: BaseException, model: nn.Module, call: Any) -> bool:
        """Whether the family put right what made a Dynamo capture fail with ``err`` (True: capture
        again; asked once per capture)."""
        return False

    def fx_capture(self, model: nn.Module, example: Any) -> tuple[Any, Any]:
        """The family's own fx tracer, after fxprep's failed: ``(CaptureResult or None,
        CaptureAttempt)``, or ``(None, None)`` where it has none."""
        return None, None

    def called_whole(self, model: nn.Module) -> tuple[Any, ...]:
        """Functions of the family's library a torch.fx trace of the model's own code calls whole
        (``autowrap_functions``): they build values (attention masks) from checks fx cannot trace,
        and run eagerly on the graph's values they compute exactly what eager does."""
        return ()

    def method_source(self, method: Any) -> tuple[ast.FunctionDef, dict[str, Any]] | None:
        """A method's def as the family changes it for capture and the helpers the changes call (for
        the control-flow rewrite to start from); None: the file's source as it is."""
        return None

    def output_recorders(self, hooks: Iterable[Any]) -> bool:
        """Whether every forward hook in ``hooks`` is one of the family's output recorders, which a
        trace reproduces (the module is traced into instead of kept as one call)."""
        return False

    # --- weights
    def converted_checkpoint(self, source: Any, original: nn.Module | None, device: torch.device,
                             dtype: torch.dtype | None) -> tuple[Any, str]:
        """``source`` in the layout of ``original`` (or of what ``source`` names) as a checkpoint, where
        its keys do not fit; ``(None, why)`` where it does not apply (``why`` empty) or failed."""
        return None, ""


NEUTRAL = Family()


@functools.cache
def known() -> tuple[Family, ...]:
    """Every registered family (:data:`FAMILIES`), loaded on first use."""
    return tuple(importlib.import_module(f"{__name__}.{name}").FAMILY for name in FAMILIES)


def family_for(model: Any) -> Family:
    """The family of ``model``: the first registered one that matches it, else :data:`NEUTRAL`."""
    for family in known():
        if family.matches(model):
            return family
    return NEUTRAL


def recorders_only(hooks: Iterable[Any]) -> bool:
    """Whether ``hooks`` (a module's forward hooks) are all some family's output recorders; asked of
    every family, since the module may belong to a part of a family's model prepared alone."""
    hooks = list(hooks)
    return any(family.output_recorders(hooks) for family in known())


def converted_checkpoint(source: Any, original: nn.Module | None, device: torch.device,
                         dtype: torch.dtype | None) -> tuple[Any, str]:
    """:meth:`Family.converted_checkpoint` of the first family it applies to (a checkpoint names its
    family itself when the prepared module has no original)."""
    for family in known():
        found, why = family.converted_checkpoint(source, original, device, dtype)
        if found is not None or why:
            return found, why
    return None, ""


__all__ = ["FAMILIES", "NEUTRAL", "Family", "converted_checkpoint", "family_for", "known", "recorders_only"]
