"""``fxprep.opaque``: keep a function or module as one call, whichever tracer runs.

``torch.fx`` needs ``torch.fx.wrap`` (functions) or a leaf module; Dynamo needs
``torch.compiler.allow_in_graph`` or a leaf. Users should not have to know which tracer fxprep ended
up using, so one decorator records the intent and each tracer honours it.

See docs/concepts/opaque-parts.md.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import InvalidInput
from .wrap import record_as_call

_MARK = "__fxprep_opaque__"
T = TypeVar("T")


def opaque(obj: T) -> T:
    """Mark a function, an ``nn.Module`` subclass or an ``nn.Module`` instance as opaque.

    Opaque modules are called as leaves (never traced into); an opaque function is one ``call_function``
    node running the original Python code, whichever tracer runs (docs/concepts/opaque-parts.md).

    Args:
        obj: The function, module class or module to keep as one call.

    Returns:
        ``obj`` marked (a module or class), or a wrapper recorded as one call (a function).

    Raises:
        InvalidInput: ``obj`` is neither callable nor a module.
    """
    if isinstance(obj, nn.Module) or isinstance(obj, type):
        setattr(obj, _MARK, True)
        return obj
    if callable(obj):
        setattr(obj, _MARK, True)  # the recorded node targets obj itself: the report reads the mark
        wrapped: Any = record_as_call(obj)
        functools.update_wrapper(wrapped, obj)
        setattr(wrapped, _MARK, True)
        # Dynamo: one call in the graph (it runs the function on fake tensors for shapes; a function
        # that cannot run that way makes Dynamo fail, and the cascade goes on to fx).
        return torch.compiler.allow_in_graph(wrapped)
    raise InvalidInput(f"fxprep.opaque expects a function, a module or a module class, not {type(obj).__name__}")


def is_opaque_module(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def is_opaque_function(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))
