"""Dynamo's dimension marks on the example's tensors, put back as they were after each capture.

Why: ``torch._dynamo.export`` with a ``dynamic_shapes`` spec first clears every input tensor's marks
(``_dynamo_weak_dynamic_indices``, ``_dynamo_dynamic_indices``, ...) and then sets its own
(``Dim.AUTO`` is ``maybe_mark_dynamic``) as attributes on the tensor objects, and leaves them there.
The next capture of the same example then traced the marked dimensions symbolically although it
declared nothing: after a shape-general first try that did not hold, the static captures that
follow it (the opaque-part fallback chain) were in fact maybe-dynamic traces. On the Qwen3.5 VLM
of the tests the whole-model traces of that chain took 21 s and 15 s instead of 3 s and 3 s, and
graphs meant to be static were traced over a symbolic length. It also cleared a user's own
``mark_dynamic`` marks. Each capture now leaves every tensor's marks as it found them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs

# Attributes torch keeps its per-tensor directives in (torch/_dynamo/decorators.py, torch/export/
# dynamic_shapes.py); every name starting with ``_dynamo`` is kept, these as well
_OTHER_MARKS = ("_specialize_on",)


def _is_mark(name: str) -> bool:
    return name.startswith("_dynamo") or name in _OTHER_MARKS


def _marks(t: torch.Tensor) -> dict[str, Any]:
    """A copy of ``t``'s marks (torch adds to the sets in place, so each value is copied)."""
    return {k: copy.copy(v) for k, v in vars(t).items() if _is_mark(k)}


@contextlib.contextmanager
def marks_restored(call: ExampleInputs) -> Iterator[None]:
    """For the length of one capture of ``call``: afterwards each of its tensors carries exactly
    the Dynamo marks it carried before (those torch added are removed, those it cleared come back)."""
    tensors = {id(t): t for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor)}
    before = {i: _marks(t) for i, t in tensors.items()}
    try:
        yield
    finally:
        for i, t in tensors.items():
            for name in [k for k in vars(t) if _is_mark(k) and k not in before[i]]:
                delattr(t, name)
            for name, value in before[i].items():
                setattr(t, name, value)
