"""The attention calls of a run, recorded, so that the graph's can be compared with eager's.

Which SDPA kernel runs is decided by its arguments, not its result, so a graph passing a mask where
eager passes none verifies yet runs another kernel. Where the capture cannot take eager's path
(:mod:`fxprep.families.transformers.attention`), only comparing the runs shows it: each verification
run records its calls with a ``TorchFunctionMode`` (whether a mask is passed, ``is_causal``,
``dropout_p``, ``scale``, ``enable_gqa``; never the mask's values), and a difference is named in the
report.

See docs/concepts/verification.md ("Under the hood").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class Call(NamedTuple):
    """One attention call, as what decides its kernel."""

    fn: str  # "sdpa" or "mha"
    mask: str | None  # None, or the mask's shape and dtype
    is_causal: bool
    dropout_p: float
    scale: float | None
    enable_gqa: bool

    def describe(self) -> str:
        mask = "attn_mask=None" if self.mask is None else f"attn_mask={self.mask}"
        return f"{mask}, is_causal={self.is_causal}" + (f", dropout_p={self.dropout_p}" if self.dropout_p else "")


def _mask(mask: Any) -> str | None:
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return f"Tensor[{'x'.join(str(s) for s in mask.shape)}, {str(mask.dtype).removeprefix('torch.')}]"
    return type(mask).__name__


def _call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
    if fn is F.scaled_dot_product_attention:
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        scale = bound.get("scale")
        return Call("sdpa", _mask(bound.get("attn_mask")), bool(bound.get("is_causal", False)),
                    float(bound.get("dropout_p", 0.0)), None if scale is None else float(scale),
                    bool(bound.get("enable_gqa", False)))
    if fn is F.multi_head_attention_forward:
        bound = _mha_signature().bind(*args, **kwargs).arguments
        return Call("mha", _mask(bound.get("attn_mask")), bool(bound.get("is_causal", False)),
                    float(bound.get("dropout_p", 0.0)) if bound.get("training", True) else 0.0, None, False)
    return None


@functools.cache
def _mha_signature() -> inspect.Signature:
    return inspect.signature(F.multi_head_attention_forward)


class _Recorder(TorchFunctionMode):
    def __init__(self, calls: list[Call]):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is F.multi_head_attention_forward:
            try:
                call = _call(func, args, kwargs)
            except Exception:  # noqa: BLE001 - arguments the function itself will reject: it says so
                call = None
            if call is not None:
                self.calls.append(call)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(calls: list[Call]) -> Iterator[None]:
    """Within, every attention call is appended to ``calls``."""
    with _Recorder(calls):
        yield


def differences(eager: list[Call], graph: list[Call]) -> str | None:
    """What the report says when the graph calls attention otherwise than eager did; None when
    every call is the same."""
    if eager == graph:
        return None
    if len(eager) != len(graph):
        return (f"attention calls: eager made {len(eager)}, the prepared module {len(graph)}: the graph does not "
                f"call attention as eager does (same result where verification passed; on CUDA, other kernels).")
    differ = [i for i, (a, b) in enumerate(zip(eager, graph)) if a != b]
    first = differ[0]
    return (f"attention calls: {len(differ)} of {len(eager)} differ from eager's (first, call {first + 1}: eager "
            f"{eager[first].describe()}; the prepared module {graph[first].describe()}). The result is the same "
            f"where verification passed, but on CUDA SDPA picks its kernel by these arguments (no flash kernel with "
            f"an explicit mask). Eager chose its arguments from tensor values (a padding mask's, say), which a graph "
            f"does not read.")
