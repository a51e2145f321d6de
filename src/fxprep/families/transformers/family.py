"""The transformers family: fxprep's answers to the registry's questions (:class:`fxprep.families.Family`)
for a ``transformers.PreTrainedModel``, or a user's module wrapping one, each delegated to the module
that knows it. Registered in :data:`fxprep.families.FAMILIES`; told by ``isinstance``, without
importing transformers.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .. import Family
from . import hub_layout, recorders
from . import model as hf
from .methods import source_tree

TUPLE_OUTPUT_NOTE = (
    "transformers model captured with return_dict=False: QuantSim traces the model with torch.jit, which "
    "refuses dict outputs (ModelOutput); the prepared module returns the output tuple. Pass "
    "concrete_args={'return_dict': True} to keep the ModelOutput."
)


class TransformersFamily(Family):
    """transformers models: cache off, attention, config inputs, output recorders, methods rewritten
    for capture, hub checkpoints (see :mod:`.model`, :mod:`.methods`, :mod:`.recorders`, :mod:`.hub_layout`)."""

    name = "transformers"
    absent_note = hf.CACHE_OFF_NOTE

    def matches(self, model: Any) -> bool:
        return isinstance(model, nn.Module) and bool(hf.hf_submodels(model))

    def working_on(self, model: Any) -> AbstractContextManager[None]:
        return hf.output_capturing_hooks(model)

    def concrete_args(self, model: nn.Module, concrete: dict[str, Any] | None, example: Any) -> dict[str, Any] | None:
        return hf.capture_concrete_args(model, concrete, example)

    def absent_outputs(self, user_concrete: dict[str, Any] | None, concrete: dict[str, Any] | None) -> dict[str, str]:
        return hf.absent_outputs(user_concrete, concrete)

    def without_added(self, concrete: dict[str, Any] | None, absent: dict[str, str]) -> dict[str, Any] | None:
        return hf.without_added(concrete, absent)

    def example_inputs(self, model: nn.Module, batch: int = 2, seq_len: int = 8, *,
                       device: torch.device | str | None = None) -> dict[str, torch.Tensor] | None:
        return hf.example_inputs_for(model, batch, seq_len, device=device)

    def tuple_output(self, model: nn.Module) -> tuple[dict[str, Any], str] | None:
        return ({"return_dict": False}, TUPLE_OUTPUT_NOTE) if hf.is_hf_model(model) else None

    def capture_context(self, model: nn.Module, notes: list[str] | None = None, example: Any = None,
                        dynamic_length: int | None = None) -> AbstractContextManager[None]:
        return hf.capture_context(model, notes, example, dynamic_length)

    def recover(self, err: BaseException, model: nn.Module, call: Any) -> bool:
        """transformers' hook installer met under Dynamo (a model never called before): installed by
        one run, as the user's first call would (:func:`.model.install_hooks_by_running`)."""
        if not hf.stopped_at_hook_installation(err):
            return False
        hf.install_hooks_by_running(model, call)
        return True

    def fx_capture(self, model: nn.Module, example: Any) -> tuple[Any, Any]:
        return hf.capture_hf_fx(model, example)

    def called_whole(self, model: nn.Module) -> tuple[Any, ...]:
        """transformers' mask builders (``masking_utils.create_*mask``: causal, sliding-window,
        chunked, bidirectional), which branch on the mask's values and the attention kind."""
        from transformers import masking_utils

        return tuple(fn for name, fn in sorted(vars(masking_utils).items())
                     if name.startswith("create_") and name.endswith("mask") and inspect.isfunction(fn)
                     and fn.__module__ == masking_utils.__name__)

    def method_source(self, method: Any) -> tuple[ast.FunctionDef, dict[str, Any]] | None:
        return source_tree(method)

    def output_recorders(self, hooks: Iterable[Any]) -> bool:
        return recorders.only_output_recorders(hooks)

    def converted_checkpoint(self, source: Any, original: nn.Module | None, device: torch.device,
                             dtype: torch.dtype | None) -> tuple[Any, str]:
        return hub_layout.converted(source, original, device, dtype)


FAMILY = TransformersFamily()
