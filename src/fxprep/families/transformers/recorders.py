"""transformers' output recorders, recognised by the identity of their code.

A module with forward hooks stays one call so that its hooks keep running
(:class:`~fxprep.capture.common.LeafPolicy`). transformers 5 puts such hooks on every layer whose
hidden states or attentions a model can return (Pixtral's vision layers, say), and all they do is
append the layer's output to the list the model's ``capture_outputs`` returns, which a traced graph
reproduces. This module tells those hooks from a user's, without importing transformers (the leaf
policy asks through the registry, :func:`fxprep.families.recorders_only`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any


def _recorder_codes() -> tuple[Any, ...]:
    """The code objects of transformers' output-capturing hooks (the functions that
    ``install_output_capuring_hook`` defines and registers), or () without transformers."""
    output_capturing = sys.modules.get("transformers.utils.output_capturing")
    installer = getattr(output_capturing, "install_output_capuring_hook", None)
    code = getattr(installer, "__code__", None)
    if code is None:
        return ()
    return tuple(c for c in code.co_consts if inspect.iscode(c))


def only_output_recorders(hooks: Any) -> bool:
    """Whether every hook in ``hooks`` (a module's ``_forward_hooks`` values) is one of
    transformers' output recorders.

    Why: a module with forward hooks stays one call so that its hooks keep running. transformers 5
    puts recorders on every layer whose hidden states or attentions a model can return (Pixtral's
    vision layers, say); all they do is append the layer's output to the list that the model's own
    ``capture_outputs`` returns, which a traced graph reproduces (the list becomes outputs of the
    graph). Kept as one call, each such layer hid its Linears from the quantizer and, where its
    inputs carry sizes the capture derives from data, could not be kept as one call at all.
    Checked by code object identity, not by name."""
    codes = _recorder_codes()
    if not codes:
        return False
    return all(getattr(h, "__code__", None) in codes for h in hooks)


__all__ = ["only_output_recorders"]
