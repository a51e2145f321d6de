"""Whether one capture with the declared dimensions maybe-dynamic holds at every size: read from its
guards.

The shape-general capture's first try declares every dimension maybe-dynamic (``Dim.AUTO``), so
Dynamo keeps its guards instead of raising. :func:`limiting` evaluates each recorded guard
(:mod:`.guard_log`) at many sizes of each declared dimension; where all hold, the graph is kept
after one capture, otherwise what failed is said and the capture is made again with the dimensions
declared strictly.

A guard that names no declared dimension is not read: one on a value read from data (Dynamo's unbacked
``u1 >= 0`` on the values route, asserted in the graph), or on a repeated block's input size that
follows no declared dimension (Qwen2-VL's vision blocks specialised to the example's patch count).
The strict capture checks only the declared dimensions too and keeps such guards as well; what they
fix is the example's, as it is with static shapes, and the verification on a second size runs the
graph there. A guard mixing a declared dimension with another size is not known to hold: refused.

See docs/shapes.md ("Under the hood") for the sizes tried and the cost this saves.
"""

from __future__ import annotations

import itertools
from typing import Any

import sympy

from ...core.inputs import ExampleInputs
from ..shapes.dims import SIZE_SOURCE
from .early_limit import model_sources
from .guard_log import GuardLog

_SMALL = range(2, 67)
_LARGE = sorted({n for k in range(7, 25) for n in (2**k - 1, 2**k, 2**k + 1)})
_TOGETHER = (2, 3, 7, 8, 9, 13, 64, 65, 100, 1000, 4097)  # sizes of two dimensions at once


def limiting(log: GuardLog, proposal: Any, model: Any, call: ExampleInputs) -> str | None:
    """None when every guard in ``log`` (a capture of ``proposal``, an :class:`~..shapes.autodims.Proposal`,
    on ``call``, its dimensions maybe-dynamic) holds at every size tried of the declared dimensions
    (see the module docstring); else the first reason it may not, for the progress line."""
    by_source = _declared_sources(model, call, proposal.dynamic)
    example = proposal.sizes(model, proposal.capture_example)
    guards: dict[str, tuple[Any, dict[str, Any]]] = {}
    for guard in log.guards:
        if guard.aside:
            continue
        named: dict[Any, Any] = {}
        undeclared = []
        for symbol in getattr(guard.expr, "free_symbols", ()):
            declared = {by_source.get(source) for source in guard.sources.get(symbol, ())}
            if len(declared) != 1 or None in declared:
                undeclared.append(symbol)
                continue
            named[symbol] = sympy.Symbol(declared.pop(), integer=True, positive=True)
        if undeclared and not named:
            continue  # no declared dimension in it (see the module docstring)
        if undeclared:
            return f"a guard on a size that is not one declared dimension: {guard.expr}"
        expr = guard.expr.xreplace(named) if named else guard.expr
        syms = {str(s): s for s in expr.free_symbols}
        if any(name not in example for name in syms):
            return f"a guard on a dimension the example does not show: {expr}"
        guards.setdefault(str(expr), (expr, syms))
    for text, (expr, syms) in guards.items():
        for at in _sizes(expr, syms, example):
            held = _holds(expr, syms, at)
            if held is not True:
                shown = ", ".join(f"{k}={v}" for k, v in sorted(at.items()))
                return f"{text} does not hold at {shown}" if held is False else f"{text} does not evaluate at {shown}"
    return None


def _declared_sources(model: Any, call: ExampleInputs, dynamic: dict[str, dict[int, str]]) -> dict[str, str]:
    """Each way a capture may name a declared dimension's size (``L['kwargs']['input_ids'].size()[1]``,
    the model's or a renamed block's), mapped to its declared symbol (``seq``)."""
    out: dict[str, str] = {}
    for spelled, canonical in model_sources(model, call, dynamic).items():
        m = SIZE_SOURCE.fullmatch(canonical)
        if m is not None:
            out[spelled] = dynamic[m.group(1)][int(m.group(2))]
    return out


def _sizes(expr: Any, syms: dict[str, Any], example: dict[str, int]) -> list[dict[str, int]]:
    """The sizes a guard over ``syms`` is evaluated at: each symbol alone over the sizes of the module
    docstring (the others at the example's), and every two together over :data:`_TOGETHER`."""
    near = _near_constants(expr)
    alone = sorted({*_SMALL, *_LARGE, *near})
    out = [{**{k: example[k] for k in syms}, name: n} for name in syms for n in alone]
    for a, b in itertools.combinations(sorted(syms), 2):
        out += [{**{k: example[k] for k in syms}, a: m, b: n} for m in _TOGETHER for n in _TOGETHER]
    return out


def _near_constants(expr: Any) -> set[int]:
    """Sizes around each integer constant of ``expr`` and its small fractions (``Ne(2*seq, 2000)``
    fails at 1000 alone): where a guard that holds elsewhere may not."""
    out: set[int] = set()
    for atom in expr.atoms(sympy.Integer):
        value = abs(int(atom))
        for k in range(1, 9):
            base = value // k
            out.update(n for n in (base - 2, base - 1, base, base + 1, base + 2) if 2 <= n <= 1 << 31)
    return out


def _holds(expr: Any, syms: dict[str, Any], at: dict[str, int]) -> bool | None:
    """``expr`` at the sizes ``at``: True or False, None where it does not evaluate to one."""
    try:
        value = expr.xreplace({s: sympy.Integer(at[name]) for name, s in syms.items()})
    except Exception:  # noqa: BLE001 - an expression sympy cannot evaluate there: not read
        return None
    if value is sympy.true or value is True:
        return True
    if value is sympy.false or value is False:
        return False
    return None


__all__ = ["limiting"]
