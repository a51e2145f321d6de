"""Checking the arguments of ``prepare_model`` and ``check_traceability`` before any work starts.

The positional arguments are AIMET's (``model``, ``modules_to_exclude``, ``module_classes_to_exclude``,
``concrete_args``); a mistake in them must be an :class:`~fxprep.errors.InvalidInput` that says how
to write the call, not a ``TypeError`` from deep inside a tracer. One more rule lives here because
both entry points need it: arguments the example inputs leave out are fixed to their defaults
(:func:`defaults_as_concrete`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..capture.common import LeafPolicy
from ..capture.request import CaptureRequest
from ..core.inputs import ExampleInputs
from ..errors import InvalidInput
from ..reporting.report import Report


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidInput(
            f"model must be a torch.nn.Module, not {type(model).__name__}. "
            f"Wrap a plain function in an nn.Module whose forward() calls it."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise InvalidInput("model is a TorchScript module; pass the original nn.Module it was scripted from.")
    return model


def _as_list(value: Any, what: str, example: str) -> list[Any]:
    """A list/tuple/set argument as a list; anything else (one module, one class, a number) is a
    mistake said plainly, not a ``TypeError: 'int' object is not iterable`` from inside."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    raise InvalidInput(f"{what} must be a list, not {type(value).__name__} ({value!r:.80}); e.g. {example}.")


def leaf_policy(model: nn.Module, modules_to_exclude: Any, module_classes_to_exclude: Any) -> LeafPolicy:
    modules = _as_list(modules_to_exclude, "modules_to_exclude", "modules_to_exclude=[model.head]")
    classes = _as_list(module_classes_to_exclude, "module_classes_to_exclude", "module_classes_to_exclude=[nn.Linear]")
    inside = {id(m) for m in model.modules()}
    for m in modules:
        if not isinstance(m, nn.Module):
            raise InvalidInput(f"modules_to_exclude must hold nn.Module instances; got {type(m).__name__}.")
        if id(m) not in inside:
            raise InvalidInput(
                f"modules_to_exclude holds a {type(m).__name__} that is not a submodule of the model "
                f"(pass the instance itself, e.g. modules_to_exclude=[model.custom])."
            )
        if m is model:
            raise InvalidInput("modules_to_exclude cannot hold the model itself: nothing would be left to trace.")
    for c in classes:
        if not isinstance(c, type):
            raise InvalidInput(
                f"module_classes_to_exclude must hold classes (e.g. [MyBlock]); got {c!r}. "
                f"To exclude one instance use modules_to_exclude."
            )
    return LeafPolicy(tuple(modules), tuple(classes))


def check_concrete_args(model: nn.Module, concrete_args: Any) -> dict[str, Any] | None:
    if concrete_args is None:
        return None
    if not isinstance(concrete_args, dict):
        raise InvalidInput(f"concrete_args must be a dict {{argument name: value}}, not {type(concrete_args).__name__}.")
    params = inspect.signature(model.forward).parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in concrete_args if k not in params and not has_var_kw]
    if unknown:
        raise InvalidInput(
            f"concrete_args names {unknown} are not arguments of {type(model).__name__}.forward "
            f"(its arguments: {list(params)})."
        )
    return dict(concrete_args)


def defaults_as_concrete(model: nn.Module, example: ExampleInputs | None, concrete: dict[str, Any] | None,
                          report: Report) -> dict[str, Any] | None:
    """Arguments the example does not give and that have a default are fixed to that default.

    Symbolic tracing otherwise turns ``y=None`` into a tensor placeholder and traces the branch for a
    tensor (``x + y``), which is wrong for the call the user actually makes. Each one is reported.
    """
    if example is None:
        return concrete
    try:
        params = inspect.signature(model.forward).parameters
        bound = inspect.signature(model.forward).bind_partial(*example.args, **example.kwargs)
    except (TypeError, ValueError):
        return concrete
    extra = {}
    for name, p in params.items():
        if name in bound.arguments or (concrete and name in concrete):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        extra[name] = p.default
    if not extra:
        return concrete
    listed = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    report.note(f"arguments not in example_inputs were captured with their defaults: {listed}.")
    return {**(concrete or {}), **extra}


def check_dynamic_inputs(request: CaptureRequest, dynamic: Any) -> None:
    """``dynamic`` must name inputs and dimensions the example has, before minutes of capturing (a
    wrong one would otherwise only make the Dynamo capture fail, and fx be used instead)."""
    from ..capture.dynamo import dynamic_shapes_spec

    assert request.example is not None
    try:
        dynamic_shapes_spec(request.model, request.calls()[0], dynamic)
    except ValueError as err:
        raise InvalidInput(f"dynamic={dynamic!r} does not fit the example inputs ({request.example.describe()}): "
                           f"{err}.") from err
