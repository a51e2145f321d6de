"""The sizes for which Dynamo's guards on one dimension hold, read from the guards' text.

When export refuses a declared dimension and suggests no range (a guard written through ``sym_max``,
``%`` or ``//``), the guards on that one size are evaluated at integer sizes, from the parsed
expression and never with ``eval``, to find the interval around the example's size where all hold. A
guard naming another size, or sizes that do not form one interval, give no interval.

See docs/shapes.md ("Under the hood") for the arithmetic understood and the search.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction

_SIZE = "__size__"
_LIMIT = 1 << 31  # past this a size is no size a model is called with
_Number = int | Fraction  # a size's arithmetic, exact: a float Dynamo prints is a fraction here
_BINARY: dict[type, Callable[[_Number, _Number], _Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: lambda a, b: Fraction(a) / Fraction(b),
}
_COMPARE: dict[type, Callable[[_Number, _Number], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
# function name -> (the module it may be called through, None for a bare name; what it computes)
_CALLS: dict[str, tuple[set[str | None], Callable[..., _Number]]] = {
    "sym_max": ({"torch", None}, max), "sym_min": ({"torch", None}, min), "Max": ({None}, max), "Min": ({None}, min),
    "sym_float": ({"torch"}, Fraction), "ceil": ({"math"}, math.ceil), "floor": ({"math"}, math.floor),
    "trunc": ({"math"}, math.trunc),
}
_INFINITY = {"IntInfinity"}  # sympy's integer infinity, as export prints a range with no end


class _Unknown(Exception):
    """The guard holds something this module does not evaluate."""


def _value(node: ast.AST, size: int) -> _Number | bool:
    if isinstance(node, ast.Expression):
        return _value(node.body, size)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, float) and math.isfinite(node.value):
        return Fraction(node.value)
    if isinstance(node, ast.Name) and node.id == _SIZE:
        return size
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _number(_value(node.left, size)), _number(_value(node.right, size))
        if isinstance(node.op, (ast.FloorDiv, ast.Mod, ast.Div)) and right == 0:
            raise _Unknown("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(_value(node.operand, size))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _value(node.operand, size)
    if isinstance(node, ast.BoolOp):
        values = [bool(_value(v, size)) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _number(_value(node.left, size))
        for op, comparator in zip(node.ops, node.comparators):
            right = _number(_value(comparator, size))
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and not node.args and not node.keywords and getattr(node.func, "id", None) in _INFINITY:
        return _LIMIT  # "size <= IntInfinity()": export's upper end of an unbounded range
    if isinstance(node, ast.Call) and not node.keywords and node.args:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        owner = node.func.value if isinstance(node.func, ast.Attribute) else None
        through = owner.id if isinstance(owner, ast.Name) else None
        if name in _CALLS and (owner is None or through is not None) and through in _CALLS[name][0]:
            return _CALLS[name][1](*(_number(_value(a, size)) for a in node.args))
    raise _Unknown(ast.dump(node)[:80])


def _number(value: _Number | bool) -> _Number:
    """A comparison's result used as a number (``True`` is 1), as Python does."""
    return int(value) if isinstance(value, bool) else value


def parse(guard: str, source: str) -> ast.Expression | None:
    """``guard`` (Dynamo's text) as an expression in the one size ``source`` names; None when it
    does not parse or names anything else."""
    text = guard.strip().rstrip(".").replace(source, _SIZE)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    try:
        _value(tree, 2)
    except (_Unknown, TypeError, ValueError):
        return None
    return tree


def _holds(guards: list[ast.Expression], size: int) -> bool:
    try:
        return all(bool(_value(g, size)) for g in guards)
    except (_Unknown, TypeError, ValueError):
        return False


def _edge(holds: Callable[[int], bool], start: int, step: int, stop: int) -> int:
    """The last size from ``start`` (which holds) towards ``stop`` that holds before the first that
    does not: doubling the distance, then bisecting."""
    good, distance = start, 1
    while True:
        probe = start + step * distance
        if (step > 0 and probe > stop) or (step < 0 and probe < stop):
            probe = stop
        if not holds(probe):
            bad = probe
            break
        good = probe
        if probe == stop:
            return stop
        distance *= 2
    while abs(bad - good) > 1:
        middle = (good + bad) // 2
        if holds(middle):
            good = middle
        else:
            bad = middle
    return good


def interval(guards: list[str], source: str, size: int, lowest: int = 2) -> tuple[int, int | None] | None:
    """``(low, high)``: the sizes around ``size`` (the example's) for which every guard holds
    (``high`` None: no end below 2**31); None when a guard cannot be read, the example's size
    itself fails, it alone holds (a specialisation, not a range), or the sizes that hold are not
    one interval at the points checked."""
    parsed = [parse(g, source) for g in guards]
    if not parsed or any(p is None for p in parsed):
        return None
    trees = [p for p in parsed if p is not None]
    return interval_where(lambda n: _holds(trees, n), size, lowest)


def failing(guards: list[str], source: str, size: int) -> str | None:
    """The first of ``guards`` (Dynamo's text, in the one size ``source`` names) that does not hold
    at ``size``; None when each holds there or one cannot be read."""
    for guard in guards:
        tree = parse(guard, source)
        if tree is None:
            return None
        if not _holds([tree], size):
            return guard
    return None


def interval_where(holds: Callable[[int], bool], size: int, lowest: int = 2) -> tuple[int, int | None] | None:
    """:func:`interval` for any test of a size (``holds``): the same search outwards from ``size``,
    the same check at spread sizes inside what it found."""
    if not holds(size):
        return None
    low = _edge(holds, size, -1, lowest) if size > lowest else size
    high = _edge(holds, size, 1, _LIMIT)
    if low == high:
        return None
    spread = {low, high, size, *(low + (high - low) * k // 64 for k in range(65))}
    if not all(holds(s) for s in spread):
        return None
    return low, (None if high >= _LIMIT else high)
