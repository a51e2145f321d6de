"""A drop-in for AIMET's ``prepare_model``, and fxprep's modules registered with AIMET's QuantSim.

:func:`prepare_model` takes AIMET's arguments and returns fxprep's graph with AIMET's module names
and classes (``style="aimet"``: :mod:`fxprep.passes.aimet_names`,
:mod:`fxprep.passes.aimet_modules`), keeping fxprep's behaviour where AIMET's preparer differs.
:func:`register_quantsim` gives every :mod:`fxprep.ops` class a quantized definition in QuantSim; it
runs on import with ``aimet_torch`` installed, and after ``prepare_model`` and ``load`` when
``aimet_torch`` is already imported.

See docs/handoff/aimet.md.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from ..api import prepare_model as _fxprep_prepare_model
from ..families import family_for
from ..passes.aimet_modules import aimet_available
from .contract import Adapter

__all__ = ["ADAPTER", "prepare_model", "register_quantsim"]

ADAPTER = Adapter(toolkit="AIMET", module="aimet_torch", requires="aimet-torch>=2.20",
                  entry_points=("prepare_model", "register_quantsim"), page="handoff/aimet.md")


def register_quantsim() -> dict[type, type]:
    """Register fxprep's module classes with AIMET QuantSim (idempotent).

    Returns:
        ``{fxprep class: its quantized class}``.

    Raises:
        ImportError: ``aimet_torch`` is not installed.
    """
    from .aimet_quantsim import register

    return register()


def prepare_model(
    model: nn.Module,
    modules_to_exclude: list[nn.Module] | None = None,
    module_classes_to_exclude: list[type] | None = None,
    concrete_args: dict[str, Any] | None = None,
    **fxprep_options: Any,
) -> fx.GraphModule:
    """AIMET's ``prepare_model``, done by fxprep: AIMET's module names and, with ``aimet_torch``, its classes.

    A transformers model is captured with ``return_dict=False`` (QuantSim's ``torch.jit`` refuses dict
    outputs) unless the caller chose ``return_dict`` (docs/handoff/aimet.md).

    Args:
        model: The ``nn.Module`` to prepare.
        modules_to_exclude: Module instances kept as single calls.
        module_classes_to_exclude: Module classes whose instances are kept as single calls.
        concrete_args: ``{argument name: value}`` fixed at capture.
        **fxprep_options: Any option of :func:`fxprep.prepare_model` (``example_inputs=...`` to capture with Dynamo and verify).

    Returns:
        The prepared ``GraphModule``, with ``style="aimet"`` unless another was given.

    Raises:
        InvalidInput: An argument or option of the wrong kind.
        ModelError: The model itself fails on ``example_inputs``.
        TraceFailure: No tracer could capture the model.
        EquivalenceError: The prepared module computes something else than the model.
    """
    fxprep_options.setdefault("style", "aimet")
    if aimet_available():
        register_quantsim()
    tuple_output = _tuple_output(model, concrete_args, fxprep_options.get("example_inputs"))
    if tuple_output is not None:
        concrete_args = {**(concrete_args or {}), **tuple_output[0]}
    gm = _fxprep_prepare_model(model, modules_to_exclude, module_classes_to_exclude, concrete_args, **fxprep_options)
    if tuple_output is not None:
        gm.fxprep_report.note(tuple_output[1])
    return gm


def _tuple_output(model: nn.Module, concrete_args: dict[str, Any] | None,
                  example_inputs: Any) -> tuple[dict[str, Any], str] | None:
    """The arguments that make the model return a tuple (transformers: ``return_dict=False``) and the
    report's note, where its family has them and the caller chose none of them itself."""
    found = family_for(model).tuple_output(model)
    if found is None:
        return None
    chosen = set(concrete_args or {}) | (set(example_inputs) if isinstance(example_inputs, dict) else set())
    return None if chosen & set(found[0]) else found
