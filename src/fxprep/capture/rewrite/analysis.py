"""What a data-dependent ``if`` (or conditional expression) is, and which rewrite may replace it.

Read from the method's AST with its live globals and instances at hand. :func:`site_shape` says how
the branches leave the site (``form`` is ``"return"``, ``"assign"`` or ``"expr"``; anything else is
refused); :func:`effects` lists, per arm, what rules out ``torch.where`` (which computes both sides)
and what rules out ``torch.cond`` too.

See docs/concepts/control-flow.md ("Under the hood").
"""

from __future__ import annotations

import ast
import builtins
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Ops that raise or give NaN/inf outside their domain: computed on the untaken side of a
# torch.where they poison the gradient (0 * inf = NaN) even though their value is discarded.
RISKY = frozenset({
    "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "acos", "asin", "acosh", "atanh",
    "arccos", "arcsin", "arccosh", "arctanh", "logit", "lgamma", "digamma", "polygamma", "mvlgamma",
    "erfinv", "div", "divide", "true_divide", "floor_divide", "fmod", "remainder", "pow", "float_power",
    "tan", "xlogy", "cholesky", "inverse", "pinverse", "det", "logdet", "slogdet", "solve", "index_select",
    "gather", "take", "take_along_dim", "embedding", "one_hot", "nll_loss", "cross_entropy",
})
RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
    "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "rrelu", "uniform_", "normal_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "bernoulli_", "gumbel_softmax",
})
MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard",
    "popitem", "sort", "reverse", "__setitem__", "__delitem__",
})
PURE_BUILTINS = frozenset({
    "len", "min", "max", "abs", "int", "float", "bool", "tuple", "list", "dict", "range", "isinstance",
    "getattr", "hasattr", "sum", "zip", "enumerate", "round", "divmod", "reversed", "sorted", "any", "all",
    "map", "filter", "slice", "str", "type", "iter", "next", "set", "frozenset", "id", "callable",
})
SIDE_EFFECT_BUILTINS = frozenset({"print", "input", "open", "exec", "eval", "setattr", "delattr", "breakpoint", "exit"})

_STATEFUL_IN_TRAINING: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.modules.dropout._DropoutNd,
    nn.RReLU, nn.MultiheadAttention, nn.RNNBase, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
)
_UNKNOWN = object()


@dataclass
class Effects:
    """Why an arm cannot be computed speculatively (``where``) or traced as a branch (``cond``)."""

    no_where: list[str] = field(default_factory=list)
    no_cond: list[str] = field(default_factory=list)

    def merge(self, other: Effects) -> None:
        for mine, theirs in ((self.no_where, other.no_where), (self.no_cond, other.no_cond)):
            mine.extend(r for r in theirs if r not in mine)


def scoped_walk(nodes: Any) -> Iterator[ast.AST]:
    """Every node under ``nodes`` (a node or a list), not entering nested defs or classes."""
    stack = list(nodes) if isinstance(nodes, list) else [nodes]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # its name is bound here; its body is another scope
        stack.extend(ast.iter_child_nodes(node))


def stored_names(nodes: Any) -> list[str]:
    """Local names assigned under ``nodes``, in source order."""
    found: dict[str, tuple[int, int]] = {}
    for node in scoped_walk(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        else:
            continue
        where = (node.lineno, node.col_offset)
        if name not in found or where < found[name]:
            found[name] = where
    return sorted(found, key=found.__getitem__)


def loaded_names(nodes: Any) -> set[str]:
    return {n.id for n in scoped_walk(nodes) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def function_locals(fdef: ast.FunctionDef) -> set[str]:
    """The method's local names: its arguments and every name it assigns."""
    args = fdef.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    return names | set(stored_names(fdef.body))


def names_before(fdef: ast.FunctionDef, line: int) -> set[str]:
    """Names that may hold a value when ``line`` runs: arguments, and names assigned earlier."""
    args = fdef.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in scoped_walk(fdef.body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.lineno < line:
            names.add(node.id)
    return names


def arm_exit(stmts: list[ast.stmt]) -> str:
    """``"returns"`` (ends with its only ``return``), ``"falls"`` (never leaves early) or
    ``"other"`` (returns from a nested block, or breaks out of an enclosing loop)."""
    exits: list[ast.stmt] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Return) or (isinstance(node, (ast.Break, ast.Continue)) and not in_loop):
            exits.append(node)
        loop = isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        for child in ast.iter_child_nodes(node):
            visit(child, in_loop or (loop and child in getattr(node, "body", [])))

    for stmt in stmts:
        visit(stmt, False)
    if not exits:
        return "falls"
    if stmts and isinstance(stmts[-1], ast.Return) and exits == [stmts[-1]]:
        return "returns"
    return "other"


class Resolver:
    """Resolves the callee of a call in the method to live objects (globals, ``self`` attributes)."""

    def __init__(self, globals_: dict[str, Any], instances: list[nn.Module], local_names: set[str]):
        self.globals = globals_
        self.instances = instances
        self.locals = local_names

    def resolve(self, expr: ast.expr) -> list[Any]:
        """The objects ``expr`` may be (one per instance for ``self.x``), or [] when unknown."""
        if isinstance(expr, ast.Name):
            if expr.id == "self" and self.instances:
                return list(self.instances)
            if expr.id in self.locals:
                return []
            if expr.id in self.globals:
                return [self.globals[expr.id]]
            value = getattr(builtins, expr.id, _UNKNOWN)
            return [] if value is _UNKNOWN else [value]
        if isinstance(expr, ast.Attribute):
            out = []
            for base in self.resolve(expr.value):
                value = getattr(base, expr.attr, _UNKNOWN)
                if value is _UNKNOWN:
                    return []
                out.append(value)
            return out
        return []


def reads_parameters(arm: Any, resolver: Resolver) -> bool:
    """Whether ``arm`` reads a parameter (directly or by calling a module holding one)."""
    for node in scoped_walk(arm):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            for obj in resolver.resolve(node):
                if isinstance(obj, nn.Parameter) or (isinstance(obj, nn.Module) and next(obj.parameters(), None) is not None):
                    return True
    return False


def _name_of(fn: Any) -> str:
    return str(getattr(fn, "__name__", "") or "")


def _is_torch(fn: Any) -> bool:
    module = str(getattr(fn, "__module__", "") or "")
    return module == "torch" or module.startswith(("torch.", "torch._"))


def _pure_leaf(module: nn.Module) -> str | None:
    """None when calling ``module`` twice changes nothing; else why it would."""
    from ..dynamo.names import default_leaf

    if not default_leaf(module):
        return f"its forward is user code ({type(module).__name__}) that fxprep does not look into"
    if module.training and isinstance(module, _STATEFUL_IN_TRAINING):
        return f"{type(module).__name__} in training mode updates statistics or draws random numbers"
    return None


def _call_effects(call: ast.Call, resolver: Resolver, arm_locals: set[str], out: Effects) -> None:
    text = ast.unparse(call.func)
    kwargs = {k.arg: k.value for k in call.keywords if k.arg}
    inplace = kwargs.get("inplace")
    if "out" in kwargs or (isinstance(inplace, ast.Constant) and inplace.value is True):
        out.no_where.append(f"`{text}(...)` writes in place")
    targets = resolver.resolve(call.func)
    if targets:
        for fn in targets:
            name = _name_of(fn)
            if isinstance(fn, nn.Module):
                why = _pure_leaf(fn)
                if why is not None:
                    out.no_where.append(f"calls `{text}`: {why}")
                continue
            if fn in (print, input, breakpoint) or (fn is getattr(builtins, name, None) and name in SIDE_EFFECT_BUILTINS):
                reason = f"`{text}(...)` is a Python side effect"
                out.no_where.append(reason)
                out.no_cond.append(reason)
                continue
            if fn is warnings.warn or isinstance(getattr(fn, "__self__", None), logging.Logger) or getattr(fn, "__module__", "") == "logging":
                reason = f"`{text}(...)` logs (a Python side effect)"
                out.no_where.append(reason)
                out.no_cond.append(reason)
                continue
            if _is_torch(fn) or getattr(fn, "__module__", None) in ("math", "operator", "_operator") or fn in vars(math).values():
                if name in RANDOM:
                    out.no_where.append(f"`{text}(...)` draws random numbers (both sides would draw)")
                elif name.endswith("_") and not name.endswith("__"):
                    out.no_where.append(f"`{text}(...)` writes in place")
                elif name in RISKY:
                    out.no_where.append(f"`{text}(...)` can raise or give NaN/inf outside its domain")
                continue
            if fn is getattr(builtins, name, None) and name in PURE_BUILTINS:
                continue
            if isinstance(fn, type) and (issubclass(fn, (tuple, list, dict, torch.Size)) or _is_torch(fn)):
                continue
            out.no_where.append(f"calls `{text}`, which fxprep cannot tell is free of side effects")
        return
    if isinstance(call.func, ast.Attribute):
        method = call.func.attr
        base = call.func.value
        base_local = isinstance(base, ast.Name) and base.id in arm_locals
        if method in MUTATING_METHODS and not base_local:
            reason = f"`{text}(...)` mutates a Python object (a side effect)"
            out.no_where.append(reason)
            out.no_cond.append(reason)
        elif hasattr(torch.Tensor, method) and method not in MUTATING_METHODS:
            if method in RANDOM:
                out.no_where.append(f"`{text}(...)` draws random numbers (both sides would draw)")
            elif method.endswith("_") and not method.endswith("__") and not base_local:
                out.no_where.append(f"`{text}(...)` writes in place")
            elif method in RISKY:
                out.no_where.append(f"`{text}(...)` can raise or give NaN/inf outside its domain")
        elif not base_local:
            out.no_where.append(f"calls `{text}`, which fxprep cannot tell is free of side effects")
        return
    out.no_where.append(f"calls `{text}`, which fxprep cannot tell is free of side effects")


def _constant_number(node: ast.expr) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _constant_number(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    return None


def effects(arm: Any, resolver: Resolver) -> Effects:
    """What in ``arm`` (statements or an expression) rules out ``torch.where`` / ``torch.cond``."""
    out = Effects()
    arm_locals = set(stored_names(arm))
    for node in scoped_walk(arm):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            reason = f"`{type(node).__name__.lower()}` statement (a Python side effect)"
            out.no_where.append(reason)
            out.no_cond.append(reason)
        elif isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            out.no_where.append("yields or awaits")
            out.no_cond.append("yields or awaits")
        elif isinstance(node, (ast.Raise, ast.Assert)):
            reason = "raises an exception (a run-time check, not a value)"
            out.no_where.append(reason)
            out.no_cond.append(reason)
        elif isinstance(node, ast.NamedExpr):
            out.no_where.append("an assignment expression (:=)")
            out.no_cond.append("an assignment expression (:=)")
        elif isinstance(node, ast.Try):
            out.no_where.append("a try block (the untaken side may raise)")
        elif isinstance(node, ast.Delete):
            out.no_where.append("a del statement")
            out.no_cond.append("a del statement")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            reason = f"writes the attribute `{ast.unparse(node)}` (a Python side effect)"
            out.no_where.append(reason)
            out.no_cond.append(reason)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in arm_locals):
                out.no_where.append(f"writes `{ast.unparse(node)}` in place")
        elif isinstance(node, ast.AugAssign):
            target = node.target
            if isinstance(target, ast.Attribute):
                continue  # reported as an attribute write
            if not (isinstance(target, ast.Name) and target.id in arm_locals and _assigned_before(arm, target)):
                out.no_where.append(f"`{ast.unparse(node).splitlines()[0]}` may write a tensor in place")
        elif isinstance(node, ast.Call):
            _call_effects(node, resolver, arm_locals, out)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            divisor = _constant_number(node.right)
            if divisor is None or divisor == 0:
                out.no_where.append(f"`{ast.unparse(node)}` divides by a computed value (inf/NaN where it is 0)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = _constant_number(node.right)
            if exponent is None or exponent < 0 or exponent != int(exponent):
                out.no_where.append(f"`{ast.unparse(node)}` can give NaN/inf (negative or non-integer power)")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if any(isinstance(n, (ast.Call, ast.Compare, ast.BinOp)) for n in ast.walk(node.slice)):
                out.no_where.append(f"`{ast.unparse(node)}` indexes with a computed index (may be out of range)")
    return out


def _assigned_before(arm: Any, target: ast.Name) -> bool:
    """Whether ``target``'s name is assigned in ``arm`` by a plain assignment before ``target``."""
    for node in scoped_walk(arm):
        if isinstance(node, ast.Assign) and node.lineno < target.lineno:
            if any(isinstance(t, ast.Name) and t.id == target.id for t in node.targets):
                return True
    return False


__all__ = [
    "Effects", "Resolver", "arm_exit", "effects", "function_locals", "loaded_names", "names_before",
    "reads_parameters", "scoped_walk", "stored_names",
]
