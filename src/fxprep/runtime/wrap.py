"""Functions recorded as ONE call in a traced graph.

``torch.fx`` traces *into* every Python function it meets. Two kinds of call must stay whole: a
function the user marked :func:`fxprep.opaque` (it has Python control flow the user accepts as a
black box), and a custom ``torch.autograd.Function`` (tracing its ``forward`` would drop its
``backward``; its caller is :func:`fxprep.ops.autograd_function_caller`). Tensor constructors sized
from traced shapes are recorded whole as well. This module holds the small tools for that, with no
dependency on the rest of fxprep, so that the decorator (:mod:`fxprep.opaque`) and the tracer
(:mod:`fxprep.capture.fx`) can use them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.fx as fx

# Tensor constructors: their sizes (or other arguments) may come from traced shapes, so the fx
# tracer records each call as one node evaluated at run time (see ``capture/fx.py``).
TENSOR_CONSTRUCTORS: tuple[str, ...] = (
    "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "linspace", "eye",
    "tensor", "as_tensor", "empty_strided", "normal", "randperm", "tril_indices", "triu_indices",
)


def find_proxy(value: Any) -> fx.Proxy | None:
    """The first ``fx.Proxy`` inside ``value`` (nested tuples, lists, dicts), or None."""
    found: list[fx.Proxy] = []

    def visit(v: Any) -> Any:
        if isinstance(v, fx.Proxy) and not found:
            found.append(v)
        return v

    fx.node.map_aggregate(value, visit)
    return found[0] if found else None


def record_as_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that, called with traced values, it is recorded as one ``call_function``
    node targeting ``fn`` itself; called with real values it simply runs."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = find_proxy((args, kwargs))
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", fn, args, kwargs)

    return wrapper


