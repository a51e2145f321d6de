"""Python values a loaded graph builds, bounded in size (and so in the time to build them) before they
are built.

A graph's Python callables (``operator.mul``, ``operator.pow``, ``len``...) have no natural bound on
values a save chooses. The self-check's interpreter (:mod:`.peak`) asks :func:`check` before each
such call and refuses calls whose result would pass the limits in :data:`.format.LIMITS`;
:func:`count` adds what each call made to the run's total; :func:`literal_problems` refuses literal
arguments no input makes small, before anything runs.

See docs/security.md ("Under the hood") for the cases and the limits.
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch

from .format import LIMITS


class PythonValueTooLarge(Exception):
    """A Python call of the graph would build ``what`` (past ``limit``): not run."""

    def __init__(self, what: str, limit: str):
        super().__init__(what)
        self.what, self.limit = what, limit


_MUL = frozenset({operator.mul, operator.imul})
_POW = frozenset({operator.pow, operator.ipow, builtins.pow})
_SHIFT = frozenset({operator.lshift, operator.ilshift})
_ADD = frozenset({operator.add, operator.iadd, operator.concat, operator.iconcat})
_FORMAT = frozenset({operator.mod, operator.imod})
# every Python-level callable a graph may call: builtins, operator, math (torch.Size, sym_* helpers)
_MODULES = frozenset({"builtins", "_operator", "operator", "math"})
_SEQUENCES = (list, tuple, str, bytes, bytearray, dict, set, frozenset, range, torch.Size)


def is_python(fn: Any) -> bool:
    """Whether ``fn`` is one of Python's own callables (``operator``, ``math``, ``builtins``)."""
    return getattr(fn, "__module__", None) in _MODULES or fn is torch.Size


def _length(value: Any) -> int:
    if isinstance(value, range):  # len() of a huge range raises OverflowError: its length computed
        step = value.step
        span = (value.stop - value.start) if step > 0 else (value.start - value.stop)
        return max(0, -(-span // abs(step)))
    return len(value)


def _bits(value: int) -> int:
    return abs(value).bit_length()


def _bounded(value: Any, where: str) -> None:
    """One argument: an integer within ``python_int_bits``, a sequence within ``python_items``."""
    if type(value) is int:
        if _bits(value) > LIMITS["python_int_bits"]:
            raise PythonValueTooLarge(f"{where} is an integer of {_bits(value):,} bits", "python_int_bits")
    elif isinstance(value, _SEQUENCES):
        n = _length(value)
        if n > LIMITS["python_items"]:
            raise PythonValueTooLarge(f"{where} holds {n:,} items", "python_items")


def _int(value: Any) -> bool:
    return type(value) is int or type(value) is bool


def _grows(fn: Any, args: tuple[Any, ...]) -> tuple[str, int, str] | None:
    """(what, size, limit) of the result of a call that grows past its arguments, else None."""
    if len(args) >= 2:
        a, b = args[0], args[1]
        if fn in _MUL:
            if _int(a) and _int(b):
                return "an integer product", _bits(a) + _bits(b), "python_int_bits"
            for seq, n in ((a, b), (b, a)):
                if isinstance(seq, (list, tuple, str, bytes, bytearray)) and _int(n):
                    return "a repeated sequence", _length(seq) * max(int(n), 0), "python_items"
        if fn in _POW and _int(a) and _int(b) and len(args) == 2 and abs(a) > 1 and b > 0:
            return "an integer power", _bits(a) * int(b), "python_int_bits"
        if fn in _SHIFT and _int(a) and _int(b) and a != 0:
            return "a shifted integer", _bits(a) + max(int(b), 0), "python_int_bits"
        if fn in _ADD and isinstance(a, (list, tuple, str, bytes)) and isinstance(b, (list, tuple, str, bytes)):
            return "a concatenation", _length(a) + _length(b), "python_items"
    if fn is math.prod and args and isinstance(args[0], (list, tuple, range)):
        items = args[0]
        bits = _bits(max(abs(items.start), abs(items.stop))) * _length(items) if isinstance(items, range) \
            else sum(_bits(v) for v in items if _int(v))
        return "an integer product", bits, "python_int_bits"
    if fn in (math.factorial, math.comb, math.perm) and args and _int(args[0]):
        n = int(args[0])
        return "a factorial", n * max(_bits(n), 1), "python_int_bits"
    if fn is math.lcm:
        return "a least common multiple", sum(_bits(v) for v in args if _int(v)), "python_int_bits"
    return None


def check(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`PythonValueTooLarge` before a Python-level call whose arguments, or whose
    result (for the calls that grow), pass the limits of the module docstring."""
    for i, value in enumerate(args):
        _bounded(value, f"argument {i}")
    for key, value in kwargs.items():
        _bounded(value, f"argument {key!r}")
    grown = _grows(fn, args)
    if grown is not None:
        what, size, limit = grown
        if size > LIMITS[limit]:
            unit = "bits" if limit == "python_int_bits" else "items"
            raise PythonValueTooLarge(f"{what} of {size:,} {unit}", limit)
    if fn in _FORMAT and args and isinstance(args[0], (str, bytes)):
        # "%0999999999d" % 1: a width, written in the format, of a gigabyte; a graph formats no strings
        raise PythonValueTooLarge("a string formatted with %", "python_items")


def items(value: Any) -> int:
    """What a call made, in items: a sequence's length, an integer's 64-bit words, else one."""
    if type(value) is int:
        return 1 + _bits(value) // 64
    if isinstance(value, (list, tuple, str, bytes, bytearray, dict, set, frozenset)):
        return 1 + len(value)
    return 1


def _literal_problem(fn: Any, args: tuple[Any, ...]) -> str | None:
    for i, value in enumerate(args):
        if type(value) is int and _bits(value) > LIMITS["python_int_bits"]:
            return f"a literal integer of {_bits(value):,} bits (argument {i})"
    if len(args) >= 2 and type(args[1]) is int:
        if fn in _POW and len(args) == 2 and args[1] > LIMITS["python_int_bits"]:
            return f"a power with the literal exponent {args[1]:,} (past {LIMITS['python_int_bits']:,} bits for any base > 1)"
        if fn in _SHIFT and args[1] > LIMITS["python_int_bits"]:
            return f"a shift by the literal {args[1]:,} (past {LIMITS['python_int_bits']:,} bits)"
    return None


def literal_problems(root: Any) -> list[tuple[str, str]]:
    """``(node, what)`` for every Python call of ``root``'s graphs (nested ones and op modules' argument
    templates included) whose literal arguments would build a value past the bounds, whatever the
    input: read from the graph alone, before anything runs."""
    import torch.fx as fx

    from .. import ops

    found: list[tuple[str, str]] = []
    for path, module in root.named_modules(remove_duplicate=True):
        graph = module.__dict__.get("_graph") if isinstance(module, fx.GraphModule) else None
        if isinstance(graph, fx.Graph):
            for node in graph.nodes:
                if node.op == "call_function" and is_python(node.target):
                    what = _literal_problem(node.target, tuple(node.args))
                    if what:
                        found.append((f"{path}.{node.name}" if path else node.name, what))
        elif isinstance(module, ops.BoundOp) and is_python(module.fn):
            what = _literal_problem(module.fn, tuple(module.args))
            if what:
                found.append((path, what))
    return found
