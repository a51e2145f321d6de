"""The ``control_flow="rewrite"`` loop: capture, learn the failing site, rewrite it, capture again.

A site is the innermost user frame a tracer failed in, when it is an ``if`` on a tensor. It gets
``torch.where``, ``torch.cond`` or a refusal (:mod:`.analysis`); the rewritten model is run eagerly
and must match the original, and a site whose untaken arm misbehaves, or that fails to trace, moves
one step further. Refused sites stay opaque, diagnosed. Rewritten methods are bound to the instances
only inside :meth:`ControlFlowRewrite.bound`.

See docs/concepts/control-flow.md ("Under the hood").
"""

from __future__ import annotations

import ast
import contextlib
import linecache
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs, split_calls
from ...core.runs import preserved_state, run_model
from ...families import Family, family_for
from ...reporting.report import CaptureAttempt, Report, RewrittenSite
from ..common import CaptureResult
from . import runtime
from .analysis import Effects, Resolver, arm_exit, effects, function_locals, reads_parameters, scoped_walk
from .sites import (
    COMPREHENSIONS,
    COND,
    NOT_REWRITABLE,
    REFUSED,
    ROUTE,
    WHERE,
    Site,
    first_line,
    innermost_user_frame,
    node_at,
    source_text,
)
from .source import (
    Installed,
    Method,
    SourceUnavailable,
    compile_function,
    install,
    method_at,
    parse,
    uninstall,
)
from .transform import Planned, rewrite

MAX_ROUNDS = 24


class ControlFlowRewrite:
    """The rewrite loop for one model (see the module docstring).

    ``example`` and ``extra`` are in the form the user passed them (``extra``: ``verify_inputs``);
    ``concrete_args`` as given to ``prepare_model``; ``reference`` the original's output on the
    example, when already computed; ``family`` the model's (:func:`fxprep.families.family_for` when
    not given), whose changes to a method's source a rewrite starts from.
    """

    def __init__(self, model: nn.Module, example: ExampleInputs | None, extra: list[ExampleInputs],
                 concrete_args: dict[str, Any] | None = None, reference: Any = None, family: Family | None = None):
        self.model = model
        self.family = family if family is not None else family_for(model)
        self.example = example
        self.extra = extra
        self.concrete = concrete_args
        self._reference = reference
        self.sites: dict[str, Site] = {}
        self.trees: dict[tuple[type, str], ast.FunctionDef] = {}
        self.methods: dict[tuple[type, str], Method] = {}
        self.helpers: dict[tuple[type, str], dict[str, Any]] = {}  # what a method's changed source calls (the family's)
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self.constructed: list[tuple[str, ExampleInputs]] = []
        self.rounds = 0
        self._depth = 0
        self._installed: Installed = []

    def _source(self, method: Method) -> tuple[ast.FunctionDef, dict[str, Any]]:
        """``method``'s def to rewrite and the helpers it calls: as the family changes it for capture
        (its copy replaces the family's on the same instances), else the file's. Raises
        :class:`SourceUnavailable` as :func:`.source.parse` does."""
        changed = self.family.method_source(method)
        return changed if changed is not None else (parse(method), {})

    # -- binding --------------------------------------------------------------------------------
    def _compile(self, method: Method) -> Any | None:
        key = (method.cls, method.name)
        while True:
            active = [s for s in self.sites.values() if s.active and s.method is method]
            if not active:
                return None
            signature = (key, tuple(sorted((s.line, s.route) for s in active)))
            if signature in self._compiled:
                return self._compiled[signature]
            planned = {s.line: Planned(s.line, ROUTE[s.route], s.key) for s in active}
            tree, became, problems = rewrite(self.trees[key], planned, method.cls.__name__)
            for line, problem in problems.items():
                site = next(s for s in active if s.line == line)
                site.route, site.became = REFUSED, ""
                site.reasons.append(problem)
            if problems:
                continue
            for s in active:
                s.became = became.get(s.line, "")
            try:
                fn = compile_function(method, tree, {**runtime.HELPERS, **self.helpers.get(key, {})})
            except SourceUnavailable as err:
                for s in active:
                    s.route = REFUSED
                    s.reasons.append(str(err))
                continue
            self._compiled[signature] = fn
            return fn

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The model with every active site's method rewritten (on its instances only). Nested
        uses share one installation; a plan change inside refreshes it (:meth:`_refresh`)."""
        self._depth += 1
        if self._depth == 1:
            self._install()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                uninstall(self._installed)

    def _install(self) -> None:
        replacements = []
        for method in self.methods.values():
            fn = self._compile(method)
            if fn is not None:
                replacements.append((method, fn))
        self._installed = install(replacements)

    def _refresh(self) -> None:
        """Re-install after the plan changed, when inside :meth:`bound`."""
        if self._depth:
            uninstall(self._installed)
            self._install()

    # -- eager runs -----------------------------------------------------------------------------
    def _original_call(self, example: ExampleInputs) -> ExampleInputs:
        return split_calls(self.model, example, self.concrete)[0]

    def reference(self) -> Any:
        if self._reference is None and self.example is not None:
            with preserved_state(self.model):
                self._reference = run_model(self.model, self._original_call(self.example))
        return self._reference

    def record(self, example: ExampleInputs, label: str) -> tuple[Any, runtime.Recorder]:
        """Run the rewritten model eagerly on ``example`` noting what each site did."""
        recorder = runtime.Recorder(self.model)
        previous, runtime.RECORDER = runtime.RECORDER, recorder
        self._refresh()
        try:
            with self.bound(), preserved_state(self.model):
                out = run_model(self.model, self._original_call(example))
        finally:
            runtime.RECORDER = previous
        for key, taken in recorder.taken.items():
            if key in self.sites and key in recorder.tensor_pred:
                self.sites[key].taken.setdefault(label, set()).update(taken)
        return out, recorder

    def _check(self, changed: Site) -> None:
        """Run the rewritten model on the example: it must match the original, and each ``where``
        site's other side must be safe to compute (see the module docstring)."""
        if self.example is None:
            for site in self.sites.values():
                if site.route == WHERE:
                    site.step_down("no example inputs to compute both branches on, so torch.where could not be checked")
            return
        try:
            out, recorder = self.record(self.example, "example")
        except Exception as err:  # noqa: BLE001 - any eager failure of the rewrite refuses it, with its reason
            changed.route = REFUSED
            changed.reasons.append(f"fxprep's rewrite of it failed when run eagerly ({type(err).__name__}: {err})")
            return
        problem = _differs(self.reference(), out)
        if problem is not None:
            changed.route = REFUSED
            changed.reasons.append(f"fxprep's rewrite of it computed something else when run eagerly ({problem})")
            return
        recorders = [recorder]
        for i, extra in enumerate(self.extra):  # the untaken side is checked on every input given
            with contextlib.suppress(Exception):
                recorders.append(self.record(extra, f"verify_inputs[{i}]")[1])
        for site in self.sites.values():
            if site.route != WHERE:
                continue
            labels = ["example"] + [f"verify_inputs[{i}]" for i in range(len(recorders) - 1)]
            site.probed = [label for label, r in zip(labels, recorders) if site.key in r.probes]
            probe = _merged([r.probes[site.key] for r in recorders if site.key in r.probes])
            if probe is None:
                site.step_down("the example inputs never reached it with a tensor condition, so the two branches "
                               "could not be compared; torch.cond computes only the branch taken")
                continue
            problems = list(probe.problems)
            if probe.broadcast and not site.root_return:
                shapes = ", ".join(f"{a} vs {b}" for a, b in probe.broadcast)
                problems.append(f"the branches give different shapes ({shapes}); torch.where would hand the rest "
                                f"of the model a broadcast shape")
            if problems:
                site.step_down("; ".join(problems))
            else:
                site.broadcast = list(probe.broadcast)

    # -- learning from a failure ------------------------------------------------------------------
    def learn(self, err: BaseException) -> bool:
        """Adjust the plan for the failure ``err``; False when nothing more can be done. Inside
        :meth:`bound` the rewritten methods are re-installed for the new plan."""
        progress = self._learn(err)
        if progress:
            self._refresh()
        return progress

    def _learn(self, err: BaseException) -> bool:
        frame = innermost_user_frame(err)
        if frame is None:
            return False
        filename, line = frame
        method = method_at(self.model, filename, line)
        node = None
        fdef = None
        if method is not None:
            key = (method.cls, method.name)
            if key not in self.methods:
                try:
                    self.trees[key], self.helpers[key] = self._source(method)
                except SourceUnavailable:
                    self.trees[key] = None  # type: ignore[assignment]
                self.methods[key] = method
            method = self.methods[key]
            fdef = self.trees[key]
            node = node_at(fdef, line) if fdef is not None else None
        site_key = f"{filename}:{node.lineno if node is not None else line}"  # type: ignore[attr-defined]
        known = self.sites.get(site_key)
        if known is not None and known.active:
            known.step_down(f"the tracer failed on it: {type(err).__name__}: {first_line(err)}")
            self._check(known)
            return True
        if known is None and isinstance(node, (ast.If, ast.IfExp)) and method is not None and fdef is not None:
            site = self._new_site(site_key, method, fdef, node)
            self.sites[site_key] = site
            inner = node
            while isinstance(inner, ast.If) and len(inner.orelse) == 1 and isinstance(inner.orelse[0], ast.If):
                inner = inner.orelse[0]  # an elif chain is one decision: its links are planned together
                self.sites.setdefault(f"{filename}:{inner.lineno}", self._new_site(f"{filename}:{inner.lineno}", method, fdef, inner))
            if site.active:
                self._compile(method)
                if site.active:
                    self._check(site)
            return site.active
        enclosing = [s for s in self.sites.values() if s.active and s.method is method and s.line <= line <= s.end_line]
        if enclosing:
            site = max(enclosing, key=lambda s: s.line)
            site.step_down(f"the tracer failed inside it at line {line}: {type(err).__name__}: {first_line(err)}")
            self._check(site)
            return True
        if known is None:
            self.sites[site_key] = self._unrewritable(site_key, method, node, line, filename)
        return False

    def assess(self, filename: str, line: int) -> None:
        """Decide for a data-dependent site the capture loop did not reach (``fxprep check`` lists
        every site ``draft_export`` found): the same analysis and eager check, no capture."""
        method = method_at(self.model, filename, line)
        key = (method.cls, method.name) if method is not None else None
        if method is not None and key not in self.methods:
            try:
                self.trees[key], self.helpers[key] = self._source(method)  # type: ignore[index]
            except SourceUnavailable:
                self.trees[key] = None  # type: ignore[index,assignment]
            self.methods[key] = method  # type: ignore[index]
        if method is not None:
            method = self.methods[key]  # type: ignore[index]
        fdef = self.trees.get(key) if key is not None else None
        node = node_at(fdef, line) if fdef is not None else None
        site_key = f"{filename}:{node.lineno if node is not None else line}"  # type: ignore[attr-defined]
        if site_key in self.sites:
            return
        if isinstance(node, (ast.If, ast.IfExp)) and method is not None and fdef is not None:
            site = self.sites[site_key] = self._new_site(site_key, method, fdef, node)
            if site.active:
                self._compile(method)
                if site.active:
                    self._check(site)
        else:
            self.sites[site_key] = self._unrewritable(site_key, method, node, line, filename)

    def _unrewritable(self, key: str, method: Method | None, node: ast.AST | None, line: int, filename: str) -> Site:
        if isinstance(node, (ast.While, ast.For, *COMPREHENSIONS)):
            why = "a loop whose trip count depends on a tensor: it stays as it is (opaque), no sound rewrite"
        elif isinstance(node, ast.Assert):
            why = "an assert on a tensor (a run-time check, not a value)"
        elif method is None:
            why = "not in a method of one of the model's modules (a free function, or a method outside the model)"
        elif node is None and self.trees.get((method.cls, method.name)) is None:
            why = f"the source of {method.qualname} cannot be read"
        elif node is None:
            why = "inside a function or lambda nested in the method: fxprep rewrites the method's own code only"
        else:
            why = "not an `if` or conditional expression on a tensor"
        code = source_text(method, node) if method is not None and node is not None else linecache.getline(filename, line).strip()
        return Site(key, method, line, line, code.splitlines()[0] if isinstance(node, (ast.While, ast.For)) else code,
                    NOT_REWRITABLE, [why])

    def _new_site(self, key: str, method: Method, fdef: ast.FunctionDef, node: ast.If | ast.IfExp) -> Site:
        end = node.end_lineno or node.lineno
        arms: list[Any]
        root_return = False
        if isinstance(node, ast.IfExp):
            arms = [node.body, node.orelse]
            root_return = any(isinstance(s, ast.Return) and s.value is node for s in scoped_walk(fdef.body))
        else:
            arms = list(node.body) + list(node.orelse)
            exits = {arm_exit(node.body), arm_exit(node.orelse)}
            top = node in fdef.body
            if top and exits == {"returns", "falls"}:
                rest = fdef.body[fdef.body.index(node) + 1:]
                arms += rest
                end = max([end] + [s.end_lineno or s.lineno for s in rest])
            root_return = "returns" in exits and (top or exits == {"returns"})
        root_return = root_return and method.name == "forward" and any(m is self.model for m in method.instances)
        site = Site(key, method, node.lineno, end, source_text(method, node, end), WHERE, root_return=root_return)
        resolver = Resolver(method.raw.__globals__, method.instances, function_locals(fdef))
        found = Effects()
        for arm in arms:
            found.merge(effects(arm, resolver))
            site.reads_parameters = site.reads_parameters or reads_parameters(arm, resolver)
        if all(method.name in m.__dict__ for m in method.instances):
            site.route = REFUSED
            site.reasons.append(f"every module running it has its own `{method.name}` set on the instance (a wrapper "
                                f"library's?); fxprep leaves that alone")
        elif found.no_cond:
            site.route = REFUSED
            site.reasons.append("a branch cannot be made a pure function of tensors: " + "; ".join(found.no_cond))
        elif found.no_where:
            site.route = COND
            site.reasons.append("not torch.where (it computes both branches): " + "; ".join(found.no_where))
        return site

    # -- the loop -----------------------------------------------------------------------------------
    def capture(self, run: Callable[[], tuple[CaptureResult | None, list[CaptureAttempt]]]
                ) -> tuple[CaptureResult | None, list[CaptureAttempt]]:
        """Run ``run`` (the capture cascade) with the rewritten model until it succeeds or no
        failure leads to a site fxprep can rewrite further."""
        result: CaptureResult | None = None
        attempts: list[CaptureAttempt] = []
        for self.rounds in range(1, MAX_ROUNDS + 1):
            with self.bound():
                result, attempts = run()
            if result is not None:
                break
            if not any(self.learn(a.exception) for a in attempts if a.exception is not None):
                break
        return result, attempts

    # -- after capture ------------------------------------------------------------------------------
    def coverage(self) -> list[tuple[str, ExampleInputs]]:
        """Record which branch each input runs; where a branch of a rewritten site is run by no
        input and negating the example's floating-point tensors runs it, that input is returned
        (to be verified too, and said so)."""
        for i, extra in enumerate(self.extra):
            with contextlib.suppress(Exception):
                self.record(extra, f"verify_inputs[{i}]")
        if self.example is None:
            return []
        if not any(_missing(s) for s in self.sites.values() if s.active):
            return []
        negated = _negated(self.example)
        if negated is None:
            return []
        label = "the example negated (built by fxprep)"
        before = {k: _missing(s) for k, s in self.sites.items() if s.active}
        try:
            self.record(negated, label)
        except Exception:  # noqa: BLE001 - the model may not accept negated inputs
            return []
        gained = [k for k, missing in before.items() if missing - _missing(self.sites[k])]
        for site in self.sites.values():
            if site.key not in gained:
                site.taken.pop(label, None)
        if gained:
            self.constructed.append((label, negated))
        return list(self.constructed)

    def explain(self) -> str:
        """What the rewrite did, for a capture that failed even so."""
        lines = [f"control_flow='rewrite' tried {self.rounds} capture(s):"]
        for site in self.sites.values():
            lines.append(f"  - {site.key}: {site.route}" + (f" ({'; '.join(site.reasons)})" if site.reasons else ""))
        return "\n".join(lines)

    def report(self, report: Report, opaque: dict[str, str], tracer: str | None = None) -> None:
        """Add each site to ``report.control_flow`` (``opaque``: the capture's opaque leaves;
        ``tracer``: the one whose capture was kept; the report's attempts say who failed where)."""
        for attempt in report.attempts:
            frame = innermost_user_frame(attempt.exception) if attempt.exception is not None else None
            if frame is None or attempt.tracer == tracer:
                continue
            for site in self.sites.values():
                if site.active and site.method is not None and site.method.contains(*frame) \
                        and site.line <= frame[1] <= site.end_line:
                    site.notes.append(
                        f"{attempt.tracer} could not capture it as {site.route} ({first_line(attempt.exception)}); "  # type: ignore[arg-type]
                        f"{tracer} did: the "
                        f"prepared module runs it exactly, but torch.export / ONNX export of it may fail the same way")
        if self.sites:
            report.note(f"control_flow='rewrite': captured after {self.rounds} capture(s); "
                        f"{sum(s.active for s in self.sites.values())} of {len(self.sites)} data-dependent site(s) "
                        f"rewritten (see 'data-dependent control flow').")
        unverified = [f"{s.key} ({side})" for s in self.sites.values() if s.active and s.taken
                      for side, flag in (("true", True), ("false", False)) if flag in _missing(s)]
        if unverified:
            report.note(f"{len(unverified)} branch(es) of rewritten sites ran on no input, so they are not verified: "
                        f"{', '.join(unverified[:6])}; pass verify_inputs=[...] that take them.")
        names = {id(m): n for n, m in self.model.named_modules()}
        for site in self.sites.values():
            modules = [names.get(id(m), "?") for m in (site.method.instances if site.method else [])]
            route = site.route if site.active else "not rewritten"
            notes = list(site.notes)
            hidden = [m for m in modules if any(m == o or m.startswith(o + ".") for o in opaque if o)]
            if site.active and hidden:
                notes.append(f"its module ({', '.join(hidden)}) is kept opaque for another reason; there the original code runs")
            if site.broadcast:
                shapes = ", ".join(f"{a} (true) vs {b} (false)" for a, b in site.broadcast)
                notes.append(f"the branches' results have shapes {shapes}: the prepared module returns the broadcast "
                             f"shape on both branches (values equal; no value repeated); verification compares "
                             f"after broadcasting and says so")
            if site.route == WHERE and site.probed:
                notes.append(f"torch.where computes both branches on every input; the untaken one was computed "
                             f"on the side and checked for errors, NaN/inf, dtype and shape on: {', '.join(site.probed)}")
            if site.route == WHERE and site.reads_parameters:
                notes.append("torch.where computes both branches: parameters read only by one branch get zero "
                             "gradients (not None) when the other branch is taken")
            branches: dict[str, list[str]] = {}
            if site.active or site.taken:
                for side, flag in (("true", True), ("false", False)):
                    branches[side] = [label for label, taken in site.taken.items() if flag in taken]
            report.control_flow.append(RewrittenSite(
                location=site.key, modules=modules, code=site.code, route=route, became=site.became if site.active else "",
                reasons=list(site.reasons), branches=branches, notes=notes,
            ))

    @property
    def joins_with_where(self) -> bool:
        """Whether a site became ``torch.where`` (verification then accepts, and states, its
        documented differences: size-1 broadcasts, zero instead of None gradients)."""
        return any(s.route == WHERE for s in self.sites.values())


def _merged(probes: list[runtime.Probe]) -> runtime.Probe | None:
    if not probes:
        return None
    out = runtime.Probe()
    for p in probes:
        out.problems += [x for x in p.problems if x not in out.problems]
        out.broadcast += [x for x in p.broadcast if x not in out.broadcast]
    return out


def _missing(site: Site) -> set[bool]:
    taken: set[bool] = set()
    for t in site.taken.values():
        taken |= t
    return {True, False} - taken


def _negated(example: ExampleInputs) -> ExampleInputs | None:
    """``example`` with every floating-point tensor negated (None when it has none)."""
    found = []

    def neg(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            found.append(t)
            return -t.detach()
        return t

    args, kwargs = pytree.tree_map_only(torch.Tensor, neg, (example.args, example.kwargs))
    return ExampleInputs(tuple(args), dict(kwargs)) if found else None


def _differs(ref: Any, got: Any) -> str | None:
    flat_r, spec_r = pytree.tree_flatten(ref)
    flat_g, spec_g = pytree.tree_flatten(got)
    if spec_r != spec_g:
        return "another output structure"
    for a, b in zip(flat_r, flat_g):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
                return "different output values"
        elif type(a) is not type(b) or (a != b and a == a):
            return "different output values"
    return None
