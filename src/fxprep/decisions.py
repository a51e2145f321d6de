"""Decisions a capture took from the example's values, and the checks that keep them honest.

Where a capture decides a data-dependent value from the example (``dynamo+values``:
:mod:`fxprep.capture.dynamo.values`), PyTorch keeps each decision as a runtime check in the graph.
This module names those checks for people: where in the model's code each decision was taken (the
report lists them), and, when a call fails one, an :class:`~fxprep.errors.InputMismatch` naming the
line of code and what to do, instead of torch's assertion message.

See docs/concepts/control-flow.md ("Under the hood").
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from .errors import InputMismatch

_ASSERT_SCALAR = getattr(getattr(torch.ops.aten, "_assert_scalar", None), "default", None)


def check_decision(condition: Any, message: str) -> None:
    """The graph's check of a value decided from the example: ``aten._assert_scalar(condition,
    message)``, except under ``torch.jit.trace``.

    Why not the aten op itself: AIMET's QuantSim (and anything else that ``torch.jit.trace``s the
    prepared module) runs it with ``.item()`` results turned into tensors, which the op refuses
    ("Expected a value of type 'number'"), so the graph could not be handed over at all. A trace
    records tensor operations for one input and keeps no Python check anyway. Under Dynamo and
    ``torch.export`` this function is traced through, leaving the aten op; a ``torch.fx`` re-trace
    (torch.ao) records the aten op on its proxies."""
    if torch.jit.is_tracing():
        return
    assert _ASSERT_SCALAR is not None, "only a torch that has aten._assert_scalar makes the checks this replaces"
    _ASSERT_SCALAR(condition, message)


_ASSERTS = tuple(t for t in (_ASSERT_SCALAR, check_decision) if t is not None)
_SYMBOL = re.compile(r"\bu\d+\b")
SHOWN = 8  # conditions listed per place in the report


def is_check(node: fx.Node) -> bool:
    """Whether ``node`` is one of the runtime checks PyTorch keeps for a decided value."""
    return node.op == "call_function" and node.target in _ASSERTS


def _message(node: fx.Node) -> str | None:
    msg = node.args[1] if len(node.args) > 1 else node.kwargs.get("assert_msg")
    return msg if isinstance(msg, str) else None


_TAG = " [decided at "  # how a check's own message carries where it was decided (kept_locations)


def location(node: fx.Node) -> str:
    """``file:line: code`` of the model's code where the checked value was decided (the innermost
    frame of the node's stack trace, else what :func:`keep_locations` wrote into the check's
    message), or "" when the capture left neither."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not found:
        kept = re.search(re.escape(_TAG) + r"(.*)\]$", _message(node) or "", re.S)
        return kept.group(1) if kept else ""
    path, line, code = found[-1]
    return f"{path}:{line}: {code.strip()}"


def keep_locations(gm: fx.GraphModule) -> fx.GraphModule:
    """Each check as :func:`check_decision`, with its location written into its own message (an
    argument of the node, so in the generated code and in a saved graph). The stack trace it comes
    from is node metadata, which ``fxprep.save`` does not keep: a loaded graph could otherwise only
    say "the model's code" when an input breaks a decision. Call before ``gm.recompile()``."""
    for node in gm.graph.nodes:
        msg = _message(node) if is_check(node) else None
        if not msg:
            continue
        where = location(node)
        if where and _TAG not in msg and len(node.args) > 1:
            node.args = (node.args[0], f"{msg}{_TAG}{where}]", *node.args[2:])
        node.target = check_decision
    return gm


def expression(node: fx.Node) -> str:
    """The checked condition as PyTorch wrote it (``u4 <= 24``: ``u<n>`` is a value read from data)."""
    msg = _message(node) or ""
    found = re.search(r"for expression (.*?) on node '", msg)
    return found.group(1) if found else msg


def summary(gm: fx.GraphModule) -> list[str]:
    """One line per place in the model's code whose decisions the graph checks, with the
    conditions, for the report."""
    places: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if is_check(node) and _message(node):
            places.setdefault(location(node) or "unknown location", []).append(expression(node))
    lines = []
    for where, conds in places.items():
        shown = list(dict.fromkeys(conds))
        more = f" and {len(shown) - SHOWN} more" if len(shown) > SHOWN else ""
        lines.append(f"{where}: {', '.join(shown[:SHOWN])}{more}")
    return lines


def failed_node(gm: fx.GraphModule, err: BaseException) -> fx.Node | None:
    """The check of ``gm`` that ``err`` is the failure of (matched by the check's own message,
    which the error repeats), else None."""
    text = str(err)
    if "Runtime assertion failed" not in text:
        return None
    for node in gm.graph.nodes:
        msg = _message(node) if is_check(node) else None
        if msg and msg in text:
            return node
    return None


def failed_check(gm: fx.GraphModule, err: BaseException) -> InputMismatch | None:
    """The :class:`InputMismatch` to raise for ``err`` when it is one of ``gm``'s decision checks
    failing, else None."""
    node = failed_node(gm, err)
    if node is None:
        return None
    where = location(node) or "the model's code"
    symbols = ", ".join(dict.fromkeys(_SYMBOL.findall(expression(node))))
    return InputMismatch(
        f"this input decides a value differently from the example the graph was captured with: at {where}, "
        f"the capture took {symbols or 'a value'} from the example's data and the graph checks "
        f"'{expression(node)}', which this input breaks. Prepare again with an example that decides it this "
        f"way, or keep the module containing that code opaque (modules_to_exclude=[...]) so it runs eagerly "
        f"for any input."
    )

