"""A data-dependent site: where it is in the user's source, and what was decided for it.

A site is found from a tracer failure (:func:`innermost_user_frame`: the innermost frame of user
code, Dynamo's user stack first) and located in the method's AST (:func:`node_at`: the ``if``,
conditional expression, loop or assert whose test is on that line). :class:`Site` carries the
decision (``route``) and why, what the code became, and which inputs ran which branch.
"""

from __future__ import annotations

import ast
import linecache
import traceback
from dataclasses import dataclass, field

from ...reporting.diagnose import is_user_file
from .analysis import scoped_walk
from .source import Method

WHERE, COND, REFUSED, NOT_REWRITABLE = "torch.where", "torch.cond", "refused", "not rewritable"
ROUTE = {WHERE: "where", COND: "cond"}


@dataclass
class Site:
    """One data-dependent site and what the loop decided for it."""

    key: str
    method: Method | None
    line: int
    end_line: int
    code: str
    route: str
    reasons: list[str] = field(default_factory=list)
    became: str = ""
    root_return: bool = False
    reads_parameters: bool = False
    probed: list[str] = field(default_factory=list)  # inputs the untaken side was checked on (where)
    broadcast: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    taken: dict[str, set[bool]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.route in ROUTE

    def step_down(self, reason: str) -> None:
        """``where`` → ``cond`` → refused, keeping why."""
        self.reasons.append(reason)
        self.route = COND if self.route == WHERE else REFUSED
        self.broadcast = []


def innermost_user_frame(err: BaseException) -> tuple[str, int] | None:
    """The innermost frame of user code the failure happened in (Dynamo's user stack first)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        stacks = []
        real = getattr(current, "real_stack", None)
        if real:
            stacks.append([(f.filename, f.lineno) for f in real])
        stacks.append([(f.f_code.co_filename, line) for f, line in traceback.walk_tb(current.__traceback__)])
        for stack in stacks:
            for filename, line in reversed(stack):
                if line and is_user_file(filename):
                    return filename, int(line)
        current = current.__cause__ or current.__context__
    return None


def source_text(method: Method, node: ast.AST, end: int | None = None) -> str:
    first = node.lineno  # type: ignore[attr-defined]
    last = end or getattr(node, "end_lineno", first) or first
    lines = [linecache.getline(method.filename, n).rstrip() for n in range(first, last + 1)]
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[indent:] for x in lines)


COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def node_at(fdef: ast.FunctionDef, line: int) -> ast.AST | None:
    """The innermost if / conditional expression / loop / assert of ``fdef`` (not of nested
    functions) whose test is on ``line``."""
    best: ast.AST | None = None
    for node in scoped_walk(fdef.body):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            test = node.test
            if node.lineno == line or test.lineno <= line <= (test.end_lineno or test.lineno):
                if best is None or node.lineno >= best.lineno:  # type: ignore[attr-defined]
                    best = node
        elif isinstance(node, (ast.For, *COMPREHENSIONS)):
            # a comprehension stands for its own ``for``: an ``ast.comprehension`` has no position
            iters = [node.iter] if isinstance(node, ast.For) else [g.iter for g in node.generators]  # type: ignore[attr-defined]
            if best is None and any(it.lineno <= line <= (it.end_lineno or it.lineno) for it in iters):
                best = node
    return best


def first_line(err: BaseException) -> str:
    """The line of ``err`` that says what went wrong (past Dynamo's "Got graph break/error:")."""
    text = [t.strip() for t in str(err).strip().splitlines() if t.strip()]
    if len(text) > 1 and text[0].endswith("Got graph break/error:"):
        explanation = next((t for t in text if t.startswith("Explanation:")), "")
        return f"{text[1]}{' - ' + explanation.removeprefix('Explanation: ') if explanation else ''}"
    return text[0] if text else type(err).__name__
