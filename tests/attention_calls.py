"""The attention calls a model makes, recorded with a TorchFunctionMode (issue 27, item 1).

Each call of ``F.scaled_dot_product_attention`` (or of another attention function below) is kept
as what decides the kernel it runs: the mask (``None``, or its shape and dtype and a digest of its
values), ``is_causal``, ``dropout_p``, ``scale``, ``enable_gqa`` and the query/key/value shapes.
An eager run and a prepared run of the same inputs must make the same calls, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ATTENTION_FUNCTIONS = {F.scaled_dot_product_attention: "sdpa", F.multi_head_attention_forward: "mha"}
try:  # not in every build
    from torch.nn.attention.flex_attention import flex_attention

    ATTENTION_FUNCTIONS[flex_attention] = "flex"
except ImportError:  # pragma: no cover
    pass

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _mask(mask: Any) -> Any:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return type(mask).__name__
    if mask.device.type == "meta":
        return (tuple(mask.shape), str(mask.dtype))
    values = mask.detach().to(torch.float64)
    finite = torch.nan_to_num(values, neginf=-1.0, posinf=1.0)
    return (tuple(mask.shape), str(mask.dtype), round(float(finite.sum()), 3))


def describe_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What decides the kernel of one attention call, as plain comparable data."""
    if name == "sdpa":
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        return {
            "fn": name,
            "q": tuple(bound["query"].shape), "k": tuple(bound["key"].shape), "v": tuple(bound["value"].shape),
            "mask": _mask(bound.get("attn_mask")), "is_causal": bool(bound.get("is_causal", False)),
            "dropout_p": float(bound.get("dropout_p", 0.0)), "scale": bound.get("scale"),
            "enable_gqa": bool(bound.get("enable_gqa", False)),
        }
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    rest = {k: (_mask(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
            if not callable(v) or v is None}
    return {"fn": name, "shapes": shapes, **rest}


class AttentionCalls(TorchFunctionMode):
    """Records every attention call made while it is active (``with AttentionCalls() as rec: ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = ATTENTION_FUNCTIONS.get(func)
        if name is not None:
            self.calls.append(describe_call(name, args, kwargs))
        return func(*args, **kwargs)


def record(module: torch.nn.Module, inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """The attention calls of one ``module(**inputs)`` run, without gradients."""
    with torch.no_grad(), AttentionCalls() as rec:
        module(**inputs)
    return rec.calls


def differences(eager: list[dict[str, Any]], prepared: list[dict[str, Any]]) -> list[str]:
    """Call by call, what the prepared run did otherwise (empty: the same calls)."""
    out = []
    if len(eager) != len(prepared):
        out.append(f"{len(eager)} attention calls in eager, {len(prepared)} prepared")
    for i, (a, b) in enumerate(zip(eager, prepared)):
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        if diff:
            out.append(f"call {i}: " + ", ".join(f"{k}: eager {x!r}, prepared {y!r}" for k, (x, y) in sorted(diff.items())))
    return out


__all__ = ["ATTENTION_FUNCTIONS", "AttentionCalls", "describe_call", "differences", "record"]
