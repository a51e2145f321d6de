"""Which branches of the model depend on the batch size (or another size), read from Dynamo's own
guards.

A static capture bakes in how the example takes a branch on ``x.shape[0]``. Traced with dimension 0
symbolic, each Python decision on it becomes a Dynamo guard with its source line; this module runs
that trace and returns those guards as :class:`Branch` es, leaving out the guards kernels' shape
checks add. :func:`size_branches` does the same for a shape-general capture's declared dimensions,
telling a branch of the model from a kernel's bound.

See docs/shapes.md ("Under the hood").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...core.runs import preserved_state
from ..shapes.dims import SIZE_SOURCE, positional_names
from .export import default_route, dynamo_export, symbolic_sizes

# Dynamo evaluating a Python-level comparison (``if``, ``range``, ``len``) on a symbolic size.
DYNAMO_FRAMES = ("/torch/_dynamo/", "\\torch\\_dynamo\\")
# Batch sizes a branch is checked at: every small one, then powers of two (and one less).
SIZES = sorted(set(range(2, 65)) | {2**k for k in range(7, 17)} | {2**k - 1 for k in range(7, 17)})


@dataclass(frozen=True)
class Branch:
    """One decision the model's code made on the batch size: ``condition`` over ``batch`` (as
    Dynamo's guard states it, e.g. ``batch <= 7``) and ``where`` (``source line  # file:line``)."""

    condition: str
    where: str
    expr: Any  # the guard, a sympy boolean over the batch symbols

    def holds_at(self, size: int) -> bool:
        """Whether the branch goes the same way at batch ``size`` as at the traced one."""
        value = self.expr.subs({s: size for s in self.expr.free_symbols})
        return bool(value)

    def names(self, symbol: str) -> bool:
        """Whether the branch is on ``symbol`` (one of the names its condition is over)."""
        return symbol in {str(s) for s in self.expr.free_symbols}

    def holds_with(self, sizes: dict[str, int]) -> bool:
        """Whether the branch goes the same way at ``sizes`` ({symbol: size}, every symbol it names)."""
        return bool(self.expr.subs({s: sizes[str(s)] for s in self.expr.free_symbols}))

    def restricts(self) -> bool:
        """Whether some batch size from 2 to 65536 would take the branch the other way (a guard such
        as ``batch < 2**63`` restricts nothing a user will meet)."""
        return not all(self.holds_at(n) for n in SIZES)

    def describe(self) -> str:
        return f"`{self.where}` (the way it goes for {self.condition} only)"


def _maybe_dynamic(t: torch.Tensor, dims: Iterable[int]) -> torch.Tensor:
    """A ``detach()`` view of ``t`` with ``dims`` marked maybe-dynamic: the mark is an attribute on
    the tensor object, so the user's tensors stay unmarked."""
    view = t.detach()
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(view, d)
    return view


def _marked(call: ExampleInputs, batch: int) -> ExampleInputs:
    """``call`` with dimension 0 of every tensor of size ``batch`` marked maybe-dynamic."""

    def mark(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 0 or t.shape[0] != batch else _maybe_dynamic(t, (0,))

    args, kwargs = pytree.tree_map_only(torch.Tensor, mark, (call.args, call.kwargs))
    return ExampleInputs(tuple(args), dict(kwargs))


def readable(condition: str) -> str:
    """``Eq(batch, 2)`` / ``Ne(batch, 2)`` as ``batch == 2`` / ``batch != 2`` (sympy's spelling)."""
    match = re.fullmatch(r"(Eq|Ne)\((.*), (.*)\)", condition)
    if match is None:
        return condition
    return f"{match[2]} {'==' if match[1] == 'Eq' else '!='} {match[3]}"


def _shape_env(gm: torch.fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and getattr(value, "fake_mode", None) is not None:
            return value.fake_mode.shape_env
    return None


def _decisions(env: Any, owner: dict[str, str]) -> list[Branch]:
    """The guards of ``env`` that Dynamo made evaluating Python code (:data:`DYNAMO_FRAMES`) over
    the symbols ``owner`` maps ({Dynamo's symbol: the name to say}) and no other: each a
    :class:`Branch`, its condition and expression in the names said."""
    import sympy

    return decisions(
        (guard.expr.subs({s: sympy.Symbol(owner[str(s)]) for s in guard.expr.free_symbols}),
         str(getattr(guard.sloc, "framework_loc", "")), str(guard.sloc.maybe_user_loc or "").strip())
        for guard in env.guards
        if guard.expr.free_symbols and {str(s) for s in guard.expr.free_symbols} <= owner.keys())


def decisions(guards: Iterable[tuple[Any, str, str]]) -> list[Branch]:
    """Of ``guards``, each ``(expression in the names to say, the torch file that made it, the user's
    line)``, those Dynamo's own code made evaluating the model's Python (:data:`DYNAMO_FRAMES`; not
    a kernel's shape logic), each condition and line once, as :class:`Branch` es."""
    found: list[Branch] = []
    seen: set[tuple[str, str]] = set()
    for expr, framework, where in guards:
        if not any(f in framework for f in DYNAMO_FRAMES):
            continue
        condition, where = str(expr), where or "(unknown line)"
        if (condition, where) not in seen:
            seen.add((condition, where))
            found.append(Branch(readable(condition), where, expr))
    return found


def batch_branches(model: nn.Module, call: ExampleInputs, batch: int, *, fresh_kwargs: bool = False) -> list[Branch]:
    """The branches of ``model`` on dimension 0 of the inputs of size ``batch`` (``batch >= 2``), from
    a Dynamo trace of ``call`` with that dimension symbolic. Raises whatever Dynamo raises when it
    cannot trace the model that way (the caller words it). ``fresh_kwargs``: as the capture learned
    (:class:`~fxprep.capture.request.Learned`)."""
    with preserved_state(model):
        with symbolic_sizes():
            gm, _ = dynamo_export(model, _marked(call, batch), default_route(), None, fresh_kwargs=fresh_kwargs)
    env = _shape_env(gm)
    if env is None:
        return []
    batch_symbols = {str(s): "batch" for s, sources in getattr(env, "var_to_sources", {}).items()
                     if any(getattr(src, "idx", None) == 0 and "SIZE" in str(getattr(src, "prop", "")) for src in sources)}
    return _decisions(env, batch_symbols)


def size_branches(model: nn.Module, call: ExampleInputs, dynamic: dict[str, dict[int, str]], *,
                  fresh_kwargs: bool = False) -> list[Branch]:
    """The branches of ``model``'s code on the dimensions ``dynamic`` names (``{input: {dim: symbol}}``,
    the form :class:`~..shapes.autodims.Proposal` keeps), over those symbols, from a Dynamo trace of ``call``
    with them marked maybe-dynamic: Dynamo then records each decision as a guard instead of stopping
    at a constraint it was told to keep (``call``'s sizes below 2 must have been grown already).
    Raises whatever Dynamo raises when it cannot trace the model that way. ``fresh_kwargs``: as the
    capture learned (:class:`~fxprep.capture.request.Learned`)."""
    names = positional_names(model, len(call.args))

    def mark(name: str, value: Any) -> Any:
        dims = dynamic.get(name)
        return _maybe_dynamic(value, dims) if dims and isinstance(value, torch.Tensor) else value

    marked = ExampleInputs(tuple(mark(n, a) for n, a in zip(names, call.args)),
                           {k: mark(k, v) for k, v in call.kwargs.items()})
    with preserved_state(model):
        with symbolic_sizes():
            gm, _ = dynamo_export(model, marked, default_route(), None, fresh_kwargs=fresh_kwargs)
    env = _shape_env(gm)
    if env is None:
        return []
    owner: dict[str, str] = {}
    for symbol, sources in getattr(env, "var_to_sources", {}).items():
        for src in sources:
            found = SIZE_SOURCE.search(src.name() if callable(src.name) else str(src.name))
            if found is not None and int(found[2]) in dynamic.get(found[1], {}):
                owner[str(symbol)] = dynamic[found[1]][int(found[2])]
    return _decisions(env, owner)
