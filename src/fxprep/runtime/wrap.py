"""Functions recorded as ONE call in a traced graph.

``torch.fx`` traces *into* every Python function it meets. Two kinds of call must stay whole: a
function the user marked :func:`fxprep.opaque` (it has Python control flow the user accepts as a
black box), and a custom ``torch.autograd.Function`` (tracing its ``forward`` would drop its
``backward``). Tensor constructors sized from traced shapes are recorded whole as well. This
module holds the small tools for that, with no dependency on the rest of
fxprep, so that the decorator (:mod:`fxprep.opaque`), the op modules (:mod:`fxprep.ops`) and the
tracer (:mod:`fxprep.capture.fx`) can all use them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
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


_CALLERS: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def autograd_function_caller(fn_cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """A plain function that calls ``fn_cls.apply``; fx cannot use a bound classmethod (or a class
    argument) as a node target, but it can use this. ``caller.autograd_function`` is ``fn_cls``."""
    caller = _CALLERS.get(fn_cls)
    if caller is None:

        def caller(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)

        caller.__name__ = f"{fn_cls.__name__}_apply"
        caller.__qualname__ = caller.__name__
        caller.__module__ = fn_cls.__module__
        caller.autograd_function = fn_cls  # type: ignore[attr-defined]
        _CALLERS[fn_cls] = caller
    return caller
