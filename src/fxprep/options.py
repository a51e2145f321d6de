"""Keyword-only options of :func:`fxprep.prepare_model`, validated in one place.

See docs/reference/api.md (``PrepareOptions``: each option with the page that explains it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .errors import InvalidInput, UnknownOption

# Each option's accepted values, once: the field's type and what _check accepts come from these.
Tracer = Literal["auto", "dynamo", "fx"]
Style = Literal["fxprep", "aimet"]
Fallback = Literal["leaf", "error"]
VerifyMode = Literal[True, False, "grad"]
ControlFlow = Literal[None, "rewrite"]
Progress = Literal[None, True, False]

TRACERS: tuple[Tracer, ...] = get_args(Tracer)
STYLES: tuple[Style, ...] = get_args(Style)


@dataclass(frozen=True)
class PrepareOptions:
    """The keyword-only options of :func:`fxprep.prepare_model`; the pages named have the details.

    Args:
        tracer: ``"auto"`` (Dynamo first when example inputs are given, then fx), ``"dynamo"`` or ``"fx"``.
        verify: ``True`` (outputs), ``"grad"`` (outputs and gradients) or ``False``; needs example inputs.
        rtol: Verification's relative tolerance (default by dtype: docs/concepts/verification.md).
        atol: Verification's absolute tolerance (default by dtype; for half types from output magnitude and depth).
        share_parameters: Unrolled copies of a reused module share its parameters (default) or are deep copies (``False``).
        convert_functionals: Functional ops become modules (default); ``False`` switches the pass off.
        unroll: A module called at several sites becomes one module per site (default); ``False`` switches it off.
        autowrap_functions: Functions the fx tracer records as single calls (like ``torch.fx.wrap``).
        name: The model name in the report (default: the class name).
        fallback: ``"leaf"`` (default): the smallest untraceable parts made opaque; ``"error"``: raise ``TraceFailure``.
        verify_inputs: More example inputs, also verified on (ones taking the other branch of something specialised).
        dynamic: Dynamo's dynamic dims: ``"batch"`` or ``{argument: {dim: symbol}}``, verified on a second size (docs/shapes.md).
        style: ``"fxprep"`` (default) or ``"aimet"``: AIMET's names and, with ``aimet_torch``, its classes (docs/handoff/aimet.md).
        control_flow: ``None`` (default) or ``"rewrite"``: a Python ``if`` on a tensor becomes ``torch.where`` / ``torch.cond`` (docs/concepts/control-flow.md).
        progress: ``None`` (default: a display on a terminal), ``True`` (always) or ``False`` (nothing; docs/guides/progress.md).
        copy: Prepare a deep copy (``True``); default ``False``: the result shares the model's modules (docs/concepts/sharing.md).
        reuse_blocks: Capture each repeated block once and stamp it out where provably the same (default; docs/concepts/block-reuse.md).
    """

    tracer: Tracer = "auto"
    verify: VerifyMode = True
    rtol: float | None = None
    atol: float | None = None
    share_parameters: bool = True
    convert_functionals: bool = True
    unroll: bool = True
    autowrap_functions: tuple[Callable[..., Any], ...] = ()
    name: str | None = None
    fallback: Fallback = "leaf"
    verify_inputs: tuple[Any, ...] = ()
    dynamic: Any = None
    style: Style = "fxprep"
    control_flow: ControlFlow = None
    progress: Progress = None
    copy: bool = False
    reuse_blocks: bool = True

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
        _check(opts)
        return dataclasses.replace(opts, autowrap_functions=tuple(opts.autowrap_functions),
                                   verify_inputs=tuple(opts.verify_inputs))


def _one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    # by type as well as value: 1 == True and 0 == False, but verify=1 is a mistake to point out
    if not any(type(value) is type(a) and value == a for a in allowed):
        shown = ", ".join(repr(a) for a in allowed)
        raise InvalidInput(f"{name} must be one of {shown}, not {value!r:.80}.")


def _check(opts: PrepareOptions) -> None:
    """Every option's type and value, each mistake said with what is accepted."""
    _one_of("tracer", opts.tracer, TRACERS)
    _one_of("style", opts.style, STYLES)
    _one_of("fallback", opts.fallback, get_args(Fallback))
    _one_of("verify", opts.verify, get_args(VerifyMode))
    _one_of("control_flow", opts.control_flow, get_args(ControlFlow))
    _one_of("progress", opts.progress, get_args(Progress))
    for flag in ("share_parameters", "convert_functionals", "unroll", "copy", "reuse_blocks"):
        _one_of(flag, getattr(opts, flag), (True, False))
    for tol in ("rtol", "atol"):
        value = getattr(opts, tol)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InvalidInput(f"{tol} must be a finite, non-negative number (or None for the default by dtype), "
                               f"not {value!r:.80}.")
    if opts.name is not None and (not isinstance(opts.name, str) or not opts.name.strip()):
        raise InvalidInput(f"name must be a non-empty str (the model name in the report), not {opts.name!r:.80}.")
    if not isinstance(opts.autowrap_functions, (tuple, list)) or not all(callable(f) for f in opts.autowrap_functions):
        raise InvalidInput("autowrap_functions must be a tuple of functions.")
    _check_dynamic(opts.dynamic)
    if not isinstance(opts.verify_inputs, (tuple, list)):
        raise InvalidInput("verify_inputs must be a list of example inputs (each a tensor, tuple or dict).")


def _check_dynamic(dynamic: Any) -> None:
    if dynamic is None or dynamic is False or dynamic == "batch":
        return
    shape = 'dynamic must be "batch" or {argument name: {dim (int): name (str)}}'
    if not isinstance(dynamic, dict):
        raise InvalidInput(f"{shape}, not {dynamic!r}.")
    for arg, dims in dynamic.items():
        if not isinstance(arg, str) or not isinstance(dims, dict):
            raise InvalidInput(f"{shape}; got {arg!r}: {dims!r}.")
        for dim, symbol in dims.items():
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise InvalidInput(f"{shape}; dimension {dim!r} of {arg!r} is not an int.")
            if not isinstance(symbol, str) and type(symbol).__module__.split(".")[0] != "torch":
                raise InvalidInput(f"{shape}; the name of dimension {dim} of {arg!r} is {symbol!r}, not a str.")
