"""Keyword-only options of :func:`fxprep.prepare_model`, validated in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput, UnknownOption

TRACERS = ("auto", "dynamo", "fx")


@dataclass(frozen=True)
class PrepareOptions:
    """Options of ``prepare_model`` (all keyword-only).

    tracer: "auto" (Dynamo first when example inputs are given, then fx), "dynamo" or "fx".
    verify: True (outputs), "grad" (outputs and gradients) or False. Needs example inputs.
    rtol / atol: verification tolerances (default by dtype: 1e-4/1e-5 for fp32, 1e-2 for half).
    share_parameters: unrolled copies of a reused module share its parameters (default) or get
        independent deep copies (False).
    convert_functionals / unroll: switch those passes off.
    autowrap_functions: extra functions the fx tracer records as single calls (like torch.fx.wrap).
    name: the model name used in the report (default: the class name).
    fallback: "leaf" (default): when the whole model cannot be captured, make the smallest
        untraceable submodules opaque leaves and capture the rest; "error": raise TraceFailure.
    """

    tracer: str = "auto"
    verify: bool | str = True
    rtol: float | None = None
    atol: float | None = None
    share_parameters: bool = True
    convert_functionals: bool = True
    unroll: bool = True
    autowrap_functions: tuple[Callable[..., Any], ...] = ()
    name: str | None = None
    fallback: str = "leaf"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PrepareOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UnknownOption(
                f"unknown option(s) {', '.join(map(repr, unknown))} for prepare_model; "
                f"known options: {', '.join(sorted(known))}."
            )
        opts = cls(**kwargs)
        if opts.tracer not in TRACERS:
            raise InvalidInput(f"tracer must be one of {TRACERS}, not {opts.tracer!r}.")
        if opts.fallback not in ("leaf", "error"):
            raise InvalidInput(f"fallback must be 'leaf' or 'error', not {opts.fallback!r}.")
        if opts.verify not in (True, False, "grad"):
            raise InvalidInput(f"verify must be True, False or 'grad', not {opts.verify!r}.")
        for tol in ("rtol", "atol"):
            value = getattr(opts, tol)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise InvalidInput(f"{tol} must be a non-negative number, not {value!r}.")
        if not isinstance(opts.autowrap_functions, (tuple, list)) or not all(callable(f) for f in opts.autowrap_functions):
            raise InvalidInput("autowrap_functions must be a tuple of functions.")
        return dataclasses.replace(opts, autowrap_functions=tuple(opts.autowrap_functions))
