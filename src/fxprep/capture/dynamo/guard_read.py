"""Whether one capture with the declared dimensions maybe-dynamic holds at every size: read from its
guards.

The shape-general capture's first try declares every dimension maybe-dynamic (``Dim.AUTO``), so
Dynamo keeps its guards instead of raising. :func:`limiting` evaluates each recorded guard
(:mod:`.guard_log`) at many sizes of each declared dimension; where all hold, the graph is kept
after one capture. Otherwise :func:`bounds` reads the ranges the failing guards allow and
:func:`branches` the decisions of the model's code among them, so that the capture made again
declares them at once. A guard naming no declared dimension (a value read from data, a reused
block's size that follows none) is not read: the strict capture keeps it too.

See docs/shapes.md ("Reading a maybe-dynamic capture's guards").
"""

from __future__ import annotations

import itertools
from typing import Any

import sympy

from ...core.inputs import ExampleInputs
from ..shapes.autodims import SizeRange
from ..shapes.dims import SIZE_SOURCE, model_sources
from .guard_log import AddedGuard, GuardLog

_SMALL = range(2, 67)
_LARGE = sorted({n for k in range(7, 25) for n in (2**k - 1, 2**k, 2**k + 1)})
_TOGETHER = (2, 3, 7, 8, 9, 13, 64, 65, 100, 1000, 4097)  # sizes of two dimensions at once


def limiting(log: GuardLog, proposal: Any, model: Any, call: ExampleInputs) -> str | None:
    """None when every guard in ``log`` (a capture of ``proposal``, an :class:`~..shapes.autodims.Proposal`,
    on ``call``, its dimensions maybe-dynamic) holds at every size tried of the declared dimensions
    (see the module docstring); else the first reason it may not, for the progress line."""
    guards, why = _read(log, proposal, model, call)
    if why is not None:
        return why
    example = proposal.sizes(model, proposal.capture_example)
    for text, (expr, syms) in guards.items():
        failed = _fails(expr, syms, example)
        if failed is not None:
            return f"{text} {failed}"
    return None


def bounds(log: GuardLog, proposal: Any, model: Any, call: ExampleInputs) -> dict[str, SizeRange]:
    """Where the guards of ``log`` (as for :func:`limiting`) fail only as bounds on one declared
    dimension each (Mistral's sliding window: ``seq < 4096``; GPT-Neo's ``seq <= 64`` and ``seq != 64``):
    ``{symbol: the range around the example's size where they hold}``, for a capture with those ranges
    declared, which the capture refused for them would otherwise be made to suggest. Empty where any
    guard fails otherwise (two dimensions, ``%``, ``max``): that capture's violation decides then."""
    guards, why = _read(log, proposal, model, call)
    if why is not None:
        return {}
    example = proposal.sizes(model, proposal.capture_example)
    held: dict[str, tuple[Any, list[Any]]] = {}  # symbol -> (sizes where its failing guards hold, the guards)
    unsolved: dict[str, list[tuple[Any, dict[str, Any], Any]]] = {}  # symbol -> its failing guards sympy does not solve
    for expr, syms in guards.values():
        if _fails(expr, syms, example) is None:
            continue
        if len(syms) != 1:
            return {}
        (sym,) = syms
        said = expr.xreplace({syms[sym]: sympy.Symbol(_said(proposal, sym))})
        where = _solved(expr, syms[sym])
        if where is None:
            unsolved.setdefault(sym, []).append((expr, syms, said))
            where = sympy.Reals
        sizes, exprs = held.get(sym, (sympy.Reals, []))
        held[sym] = (sympy.Intersection(sizes, where), [*exprs, said])
    found: dict[str, SizeRange] = {}
    for sym, (sizes, exprs) in held.items():
        bound = _around(sizes, example[sym], "the model's code requires " + " and ".join(_spelled(e) for e in exprs))
        if sym in unsolved:  # (MiniMax's block count, `(seq + 255) // 256 == 1`): where they hold, from 2 up
            bound = _below(sym, unsolved[sym], example[sym], bound)
        if bound is None:
            return {}
        found[sym] = bound
    return found


def _below(sym: str, unsolved: list[tuple[Any, dict[str, Any], Any]], size: int, solved: SizeRange | None
           ) -> SizeRange | None:
    """The range of ``solved`` (None: every size) narrowed to where the guards sympy does not solve
    (``(guard, its symbols, as the report words it)`` each) hold, searched outwards from ``size``
    (:func:`..shapes.guard_range.interval_where`): an upper bound only, from 2 up (a guard on ``%``
    that fails between sizes is not one), else None. As a range export printed no ``Dim`` for is
    read from its guards (:mod:`..shapes.violation`), it is where the graph holds: a limit of the
    prepared module whatever set it, shown with the guard that ends it."""
    from ..shapes.guard_range import interval_where

    if solved is not None and solved.low is not None:
        return None
    found = interval_where(lambda n: all(_holds(e, syms, {sym: n}) is True for e, syms, _ in unsolved), size, lowest=2)
    if found is None or found[0] > 2 or found[1] is None:
        return None
    high = found[1] if solved is None or solved.high is None else min(found[1], solved.high)
    ending = next((said for e, syms, said in unsolved if _holds(e, syms, {sym: found[1] + 1}) is not True), unsolved[0][2])
    return SizeRange(None, high, f"the guards Dynamo put on it hold for 2..{high} ({_spelled(ending)})", from_guards=True)


def bound(guard: AddedGuard, said: str) -> SizeRange | None:
    """Where ``guard`` is over one symbol alone and holds in one range of sizes around the example's
    (``seq < 512``, ``seq <= 64``: a bound, not a specialisation), that range, its reason naming the
    size as ``said``; else None (:func:`bound_of`)."""
    free: set[Any] = getattr(guard.expr, "free_symbols", set())
    if len(free) != 1:
        return None
    (symbol,) = free
    size = guard.hints.get(symbol)
    return None if size is None else bound_of(guard.expr, symbol, size, said)


def bound_of(expr: Any, symbol: Any, size: int, said: str) -> SizeRange | None:
    """The sizes where ``expr`` (a relation over ``symbol`` alone) holds, as one range around the
    example's ``size``, its reason naming the size as ``said`` (``input_ids.shape[1] <= 64``); None
    where that is no bound sympy solves, it leaves ``size`` out or it bounds nothing."""
    where = _solved(expr, symbol)
    said_expr = expr.xreplace({symbol: sympy.Symbol(said)})
    return None if where is None else _around(where, size, f"the model's code requires {said_expr}")


def _solved(expr: Any, symbol: Any) -> Any:
    """The real numbers where ``expr`` (over ``symbol`` alone) holds, a sympy set; None where sympy
    does not solve it (``Max``, ``%``)."""
    if not isinstance(expr, sympy.core.relational.Relational):
        return None
    x = sympy.Symbol("x", real=True)
    try:
        return sympy.solve_univariate_inequality(expr.xreplace({symbol: x}), x, relational=False)
    except Exception:  # noqa: BLE001 - not an inequality sympy solves in one variable
        return None


def _around(sizes: Any, size: int, why: str) -> SizeRange | None:
    """The interval of ``sizes`` (a sympy set) that holds ``size``, in whole sizes, as a range."""
    parts = sizes.args if isinstance(sizes, sympy.Union) else (sizes,)
    part = next((p for p in parts if isinstance(p, sympy.Interval) and p.contains(size) is sympy.true), None)
    if part is None:
        return None
    low = None if part.inf.is_infinite else int(sympy.ceiling(part.inf)) + int(bool(part.left_open and part.inf.is_integer))
    high = None if part.sup.is_infinite else int(sympy.floor(part.sup)) - int(bool(part.right_open and part.sup.is_integer))
    low = low if low is not None and low > 2 else None
    return None if low is None and high is None else SizeRange(low, high, why)


def _spelled(expr: Any) -> str:
    """A guard as the report words it (``input_ids.shape[1] != 64``, not sympy's ``Ne(...)``)."""
    from .size_branches import readable

    return readable(str(expr))


def _said(proposal: Any, sym: str) -> str:
    """The declared symbol ``sym`` as the first input size it names (``input_ids.shape[1]``)."""
    return next((f"{n}.shape[{d}]" for n, ds in proposal.dynamic.items() for d, s in ds.items() if s == sym), sym)


def branches(log: GuardLog, proposal: Any, model: Any, call: ExampleInputs) -> list[Any] | None:
    """The decisions of the model's Python code on the declared dimensions among the guards of
    ``log`` (a capture run to its end with them maybe-dynamic, as for :func:`limiting`), as
    :func:`~.size_branches.size_branches` finds them in a trace of its own: the guards Dynamo's own
    code made (not a kernel's shape logic) over declared dimensions alone. A capture whose guards
    bound a dimension has made that trace already, blocks included (each block's own capture
    records its guards in the model's names), so the prepared module's limits are read off it
    instead of a whole-model trace more. None where a guard's location was not recorded."""
    from .size_branches import decisions

    by_source = _declared_sources(model, call, proposal.dynamic)
    read: list[tuple[Any, str, str]] = []
    for guard in log.guards:
        if guard.aside:
            continue
        if guard.framework is None:
            return None
        named: dict[Any, Any] = {}
        for symbol in getattr(guard.expr, "free_symbols", ()):
            declared = {by_source.get(source) for source in guard.sources.get(symbol, ())}
            if len(declared) != 1 or None in declared:
                break
            named[symbol] = sympy.Symbol(declared.pop())
        else:
            if named:
                read.append((guard.expr.xreplace(named), guard.framework, guard.user_loc))
    return decisions(read)


def _read(log: GuardLog, proposal: Any, model: Any, call: ExampleInputs
          ) -> tuple[dict[str, tuple[Any, dict[str, Any]]], str | None]:
    """The guards of ``log`` over the declared dimensions, each written in their names (``seq``), by
    text; or why one cannot be read so (it mixes a declared dimension with another size)."""
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
            return {}, f"a guard on a size that is not one declared dimension: {guard.expr}"
        expr = guard.expr.xreplace(named) if named else guard.expr
        syms = {str(s): s for s in expr.free_symbols}
        if any(name not in example for name in syms):
            return {}, f"a guard on a dimension the example does not show: {expr}"
        guards.setdefault(str(expr), (expr, syms))
    return guards, None


def _fails(expr: Any, syms: dict[str, Any], example: dict[str, int]) -> str | None:
    """Where ``expr`` does not hold (or does not evaluate) at the sizes tried; None where it holds."""
    for at in _sizes(expr, syms, example):
        held = _holds(expr, syms, at)
        if held is not True:
            shown = ", ".join(f"{k}={v}" for k, v in sorted(at.items()))
            return f"does not hold at {shown}" if held is False else f"does not evaluate at {shown}"
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


__all__ = ["bound_of", "bounds", "branches", "limiting"]
