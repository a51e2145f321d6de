"""The AST rewrite of a method's data-dependent sites.

:func:`rewrite` takes the method's ``def`` and the sites to rewrite (by line, each with its route)
and returns a new ``def`` in which each ``if`` and conditional expression becomes a call of
``__fxprep_branch__`` with the arms as nested functions, and the test's ``and``/``or``/``not``
become fxprep's tensor-aware helpers. Generated nodes keep the site's line; sites of another shape
are returned as problems, untouched.

See docs/concepts/control-flow.md ("Under the hood") for the exact forms.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from .analysis import arm_exit, function_locals, loaded_names, names_before, scoped_walk, stored_names

PREFIX = "_fxprep_"


@dataclass
class Planned:
    """A site to rewrite: where it is and which route it takes."""

    line: int
    route: str  # "where" | "cond"
    key: str


def _name(id_: str, store: bool = False) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Store() if store else ast.Load())


def _tuple(names: list[str], store: bool = False) -> ast.Tuple:
    return ast.Tuple(elts=[_name(n, store) for n in names], ctx=ast.Store() if store else ast.Load())


def _args(names: list[str]) -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], vararg=None, kwonlyargs=[],
                         kw_defaults=[], kwarg=None, defaults=[])


def _def(name: str, params: list[str], body: list[ast.stmt]) -> ast.FunctionDef:
    node = ast.parse(f"def {name}():\n    pass").body[0]
    assert isinstance(node, ast.FunctionDef)
    node.args = _args(params)
    node.body = body or [ast.Pass()]
    return node


def _tuple_text(names: list[str]) -> str:
    return f"({', '.join(names)}{',' if len(names) == 1 else ''})"


def _value_text(arm: list[ast.stmt], name: str, fn: str) -> str:
    """How the value an arm leaves in local ``name`` reads in the report."""
    stores = [s for s in arm if name in {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}]
    if not stores:
        return name
    if len(stores) == 1 and isinstance(stores[0], ast.Assign) and len(stores[0].targets) == 1 \
            and isinstance(stores[0].targets[0], ast.Name):
        return ast.unparse(stores[0].value)
    return f"{fn}(...).{name}"


def _helper_call(helper: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(func=_name(helper), args=args, keywords=[])


def test_expr(test: ast.expr) -> ast.expr:
    """``test`` with its boolean operators routed through the tensor-aware helpers."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _helper_call("__fxprep_not__", [test_expr(test.operand)])
    if isinstance(test, ast.BoolOp):
        helper = "__fxprep_and__" if isinstance(test.op, ast.And) else "__fxprep_or__"
        result = test_expr(test.values[-1])
        for value in reversed(test.values[:-1]):
            thunk = ast.Lambda(args=_args([]), body=result)
            result = _helper_call(helper, [test_expr(value), thunk])
        return result
    return test


def _needed(stmts: list[ast.stmt]) -> list[str]:
    """Names the statements read before assigning them themselves (in order of first read)."""
    assigned: set[str] = set()
    needed: dict[str, None] = {}
    for stmt in stmts:
        for name in sorted(loaded_names(stmt)):
            if name not in assigned:
                needed.setdefault(name, None)
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = list(stmt.targets)
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and getattr(stmt, "value", None) is not None:
            targets = [stmt.target]
        for t in targets:
            assigned.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return list(needed)


class _Sites:
    """Rewrites one method's planned sites; see :func:`rewrite`."""

    def __init__(self, fdef: ast.FunctionDef, planned: dict[int, Planned]):
        self.fdef = fdef
        self.planned = planned
        self.locals = function_locals(fdef)
        self.became: dict[int, str] = {}
        self.returned: dict[int, str] = {}  # the expression a returning site became
        self.problems: dict[int, str] = {}
        self.done: set[int] = set()

    def operands(self, line: int, reads: list[str]) -> list[str]:
        before = names_before(self.fdef, line)
        return [n for n in reads if n in before and n in self.locals and not n.startswith(PREFIX)]

    # -- conditional expressions --------------------------------------------------------------
    def expressions(self, node: ast.AST) -> None:
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        value[i] = self._visit_expr(item)
            elif isinstance(value, ast.AST):
                setattr(node, field, self._visit_expr(value))

    def _visit_expr(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return node  # a nested scope: its sites are not this method's
        self.expressions(node)
        plan = self.planned.get(getattr(node, "lineno", -1))
        if not isinstance(node, ast.IfExp) or plan is None or plan.line in self.done:
            return node
        reads = sorted(loaded_names(node.body) | loaded_names(node.orelse))
        params = self.operands(plan.line, reads)
        call = _helper_call("__fxprep_branch__", [
            ast.Constant(plan.route), ast.Constant(plan.key), test_expr(node.test),
            ast.Lambda(args=_args(params), body=node.body), ast.Lambda(args=_args(params), body=node.orelse),
            _tuple(params),
        ])
        self.done.add(plan.line)
        self.became[plan.line] = (
            f"torch.where({ast.unparse(node.test)}, {ast.unparse(node.body)}, {ast.unparse(node.orelse)})"
            if plan.route == "where" else
            f"torch.cond({ast.unparse(node.test)}, lambda {', '.join(params)}: {ast.unparse(node.body)}, "
            f"lambda {', '.join(params)}: {ast.unparse(node.orelse)}, {_tuple_text(params)})"
        )
        return ast.copy_location(call, node)

    # -- if statements ------------------------------------------------------------------------
    def block(self, stmts: list[ast.stmt], top: bool) -> list[ast.stmt]:
        out: list[ast.stmt] = list(stmts)
        i = len(out) - 1
        while i >= 0:
            stmt = out[i]
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    setattr(stmt, field, self.block(inner, False))
            for handler in getattr(stmt, "handlers", []) or []:
                handler.body = self.block(handler.body, False)
            plan = self.planned.get(stmt.lineno)
            if isinstance(stmt, ast.If) and plan is not None and plan.line not in self.done:
                new, consumed = self._if(stmt, out[i + 1:], top, plan)
                if new is not None:
                    out[i:i + 1 + consumed] = new
            i -= 1
        return out

    def _if(self, node: ast.If, rest: list[ast.stmt], top: bool, plan: Planned) -> tuple[list[ast.stmt] | None, int]:
        body, orelse = list(node.body), list(node.orelse)
        t_exit, f_exit = arm_exit(body), arm_exit(orelse)
        consumed = 0
        if t_exit == f_exit == "returns":
            form = "return"
        elif t_exit == f_exit == "falls":
            form = "assign"
        elif top and {t_exit, f_exit} == {"returns", "falls"}:
            form, consumed = "return", len(rest)
            if t_exit == "returns":
                orelse = orelse + copy.deepcopy(rest)
            else:
                body = body + copy.deepcopy(rest)
            for arm in (body, orelse):
                if arm_exit(arm) == "falls":
                    arm.append(ast.Return(value=None))
            if arm_exit(body) != "returns" or arm_exit(orelse) != "returns":
                self.problems[plan.line] = "the code after the `if` leaves the method early from a nested block"
                return None, 0
        else:
            self.problems[plan.line] = (
                "one branch returns (or breaks) from inside a nested block while the other falls through; "
                "only branches that both return, or both fall through, can be rewritten"
            )
            return None, 0
        reads = _needed(body) + [n for n in _needed(orelse) if n not in _needed(body)]
        line = plan.line
        t_name, f_name = f"{PREFIX}true_{line}", f"{PREFIX}false_{line}"
        if form == "assign":
            t_out, f_out = set(stored_names(body)), set(stored_names(orelse))
            before = names_before(self.fdef, line)
            outputs = [n for n in dict.fromkeys(stored_names(body) + stored_names(orelse))
                       if not n.startswith(PREFIX) and ((n in t_out and n in f_out) or n in before)]
            if not outputs:
                self.problems[plan.line] = "the branches assign no local that lives on after the `if`"
                return None, 0
            passed = [n for n in outputs if not (n in t_out and n in f_out)]
            params = self.operands(line, reads + [n for n in passed if n not in reads])
            ret = ast.Return(value=_tuple(outputs))
            t_def = _def(t_name, params, body + [ret])
            f_def = _def(f_name, params, orelse + [copy.deepcopy(ret)])
            call = self._call(plan, node.test, t_name, f_name, params)
            last: ast.stmt = ast.Assign(targets=[_tuple(outputs, store=True)], value=call)
            if plan.route == "where":
                joined = [f"torch.where({ast.unparse(node.test)}, {_value_text(body, o, t_name)}, "
                          f"{_value_text(orelse, o, f_name)})" for o in outputs]
                self.became[line] = f"{', '.join(outputs)} = {', '.join(joined)}"
            else:
                self.became[line] = (f"{', '.join(outputs)} = torch.cond({ast.unparse(node.test)}, {t_name}, {f_name}, "
                                     f"{_tuple_text(params)})")
        else:
            params = self.operands(line, reads)
            t_def, f_def = _def(t_name, params, body), _def(f_name, params, orelse)
            last = ast.Return(value=self._call(plan, node.test, t_name, f_name, params))
            texts = [self._arm_text(arm, name, params) for arm, name in ((body, t_name), (orelse, f_name))]
            expr = f"torch.{plan.route}({ast.unparse(node.test)}, {texts[0]}, {texts[1]})"
            if plan.route == "cond":
                expr = f"torch.cond({ast.unparse(node.test)}, {t_name}, {f_name}, {_tuple_text(params)})"
            self.became[line] = f"return {expr}"
            self.returned[line] = expr
            last.fxprep_line = line  # type: ignore[attr-defined]
        new = [t_def, f_def, last]
        for stmt in new:
            ast.copy_location(stmt, node)
        self.done.add(line)
        return new, consumed

    def _arm_text(self, arm: list[ast.stmt], name: str, params: list[str]) -> str:
        """How an arm reads in the report: its expression, or the expression of the site it is."""
        if len(arm) == 1 and isinstance(arm[0], ast.Return) and arm[0].value is not None:
            return ast.unparse(arm[0].value)
        inner = getattr(arm[-1], "fxprep_line", None) if arm else None
        if inner is not None and all(isinstance(s, ast.FunctionDef) for s in arm[:-1]):
            return self.returned[inner]
        return f"{name}({', '.join(params)})"

    def _call(self, plan: Planned, test: ast.expr, t_name: str, f_name: str, params: list[str]) -> ast.Call:
        return _helper_call("__fxprep_branch__", [
            ast.Constant(plan.route), ast.Constant(plan.key), test_expr(test), _name(t_name), _name(f_name),
            _tuple(params),
        ])


def mangle(tree: ast.AST, class_name: str) -> None:
    """Apply the private-name mangling a class body applies (``self.__x`` → ``self._Cls__x``):
    the rewritten method is compiled outside its class."""
    stripped = class_name.lstrip("_")
    if not stripped:
        return

    def m(name: str) -> str:
        if name.startswith("__") and not name.endswith("__") and "." not in name:
            return f"_{stripped}{name}"
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = m(node.id)
        elif isinstance(node, ast.Attribute):
            node.attr = m(node.attr)
        elif isinstance(node, ast.arg):
            node.arg = m(node.arg)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            node.arg = m(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not tree:
            node.name = m(node.name)


def rewrite(fdef: ast.FunctionDef, planned: dict[int, Planned], class_name: str) -> tuple[ast.FunctionDef, dict[int, str], dict[int, str]]:
    """A rewritten copy of ``fdef``; with what each site became and why a site could not be rewritten."""
    tree = copy.deepcopy(fdef)
    sites = _Sites(tree, planned)
    for stmt in tree.body:
        sites.expressions(stmt)
    tree.body = sites.block(tree.body, True)
    for line in planned:
        if line not in sites.done and line not in sites.problems:
            sites.problems[line] = "no `if` statement or conditional expression starts on this line"
    mangle(tree, class_name)
    ast.fix_missing_locations(tree)
    return tree, sites.became, sites.problems


__all__ = ["PREFIX", "Planned", "mangle", "rewrite", "scoped_walk", "test_expr"]
