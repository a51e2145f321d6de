"""``check_traceability``: what each tracer makes of a model, before preparing it.

It runs every tracer on its own (not as a cascade), diagnoses each failure into located
:class:`~fxprep.reporting.diagnose.Issue` objects, and, when no tracer captures the whole model, says which
parts the hybrid capture would make opaque. When Dynamo fails, ``torch.export.draft_export`` is run
once to list every remaining data-dependent site in a single pass instead of one error at a time.

See docs/concepts/capture.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..capture import cascade
from ..capture.request import CaptureRequest
from ..capture.routes import Route
from ..core.inputs import normalize_example_inputs
from ..core.runs import hooks_left_as_found
from ..core.threads import GLOBAL_LOCK, quiet_logs
from ..families import Family, family_for
from ..reporting.diagnose import (
    CUSTOM_OP,
    DATA_DEPENDENT_BRANCH,
    DATA_DEPENDENT_LOOP,
    DATA_DEPENDENT_VALUE,
    FIXES,
    SPECIALISATION,
    Issue,
    diagnose,
    is_user_file,
    module_at,
)
from ..reporting.report import CaptureAttempt, Report, RewrittenSite
from . import root_hooks
from .arguments import check_concrete_args, check_model, defaults_as_concrete, leaf_policy

# Tracers that capture the model whole (the hybrid leaf fallback is reported apart).
WHOLE_MODEL_TRACERS = tuple(route for route in Route if route.whole)


@dataclass
class TraceReport:
    """Per-tracer outcome, the issues found, and the parts that would become opaque."""

    model: str
    attempts: list[CaptureAttempt] = field(default_factory=list)
    issues: list[Issue] = field(default_factory=list)
    opaque: dict[str, Issue] = field(default_factory=dict)
    hybrid_ok: bool | None = None
    # With control_flow="rewrite": each data-dependent site and whether the rewrite applies, and
    # the tracer that then captures the model whole (None: still not whole).
    control_flow: list[RewrittenSite] = field(default_factory=list)
    rewrite_tracer: str | None = None

    @property
    def traceable(self) -> bool:
        """True when at least one tracer captures the whole model."""
        return any(a.ok for a in self.attempts if a.tracer in WHOLE_MODEL_TRACERS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "traceable": self.traceable,
            "attempts": [a.to_dict() for a in self.attempts],
            "issues": [i.to_dict() for i in self.issues],
            "opaque": {k: v.to_dict() for k, v in self.opaque.items()},
            "hybrid_ok": self.hybrid_ok,
            "control_flow": [dataclasses.asdict(c) for c in self.control_flow],
            "rewrite_tracer": self.rewrite_tracer,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def _verdict(self) -> str:
        if self.traceable:
            ok = [a.tracer for a in self.attempts if a.ok and a.tracer in WHOLE_MODEL_TRACERS]
            return f"traceable whole by {', '.join(ok)}"
        rewrite = f"; with control_flow='rewrite' traceable whole by {self.rewrite_tracer}" if self.rewrite_tracer else ""
        if self.hybrid_ok:
            return f"not traceable whole; prepares with {len(self.opaque)} opaque part(s){rewrite}"
        if rewrite:
            return f"not traceable as written{rewrite}"
        return "not traceable, even with opaque parts: the root module's own forward must change"

    def to_text(self) -> str:
        lines = [f"fxprep check: {self.model}", f"  verdict: {self._verdict()}"]
        for a in self.attempts:
            lines.append(f"  - {a.tracer}: {'ok' if a.ok else 'failed'} ({a.seconds:.2f}s)" + (f" - {a.error}" if a.error else ""))
        if self.opaque:
            lines.append("  would become opaque:")
            for name, issue in self.opaque.items():
                lines.append(f"    = {name or '(root)'}: {issue.category} at {issue.location}")
        if self.control_flow:
            lines.append(f"  with control_flow='rewrite': {self._rewrite_verdict()}")
            for site in self.control_flow:
                lines.extend("    " + t for t in site.to_text().splitlines())
        if self.issues:
            lines.append(f"  issues ({len(self.issues)}):")
            for issue in self.issues:
                lines.extend("    " + t for t in issue.to_text().splitlines())
        return "\n".join(lines)

    def _rewrite_verdict(self) -> str:
        done = sum(c.route != "not rewritten" for c in self.control_flow)
        whole = f"traceable whole by {self.rewrite_tracer}" if self.rewrite_tracer else "still not traceable whole"
        return f"{done} of {len(self.control_flow)} data-dependent site(s) rewritten; {whole}"

    def to_markdown(self) -> str:
        md = [f"### fxprep check: `{self.model}`", "", f"**Verdict:** {self._verdict()}", "",
              "| tracer | result | seconds | error |", "|---|---|---|---|"]
        for a in self.attempts:
            md.append(f"| {a.tracer} | {'ok' if a.ok else 'failed'} | {a.seconds:.2f} | {(a.error or '').replace('|', '/')} |")
        if self.opaque:
            md += ["", "| opaque part | category | where |", "|---|---|---|"]
            md += [f"| `{k or '(root)'}` | {v.category} | `{v.location}` |" for k, v in self.opaque.items()]
        if self.control_flow:
            md += ["", f"**With `control_flow='rewrite'`:** {self._rewrite_verdict()}", "",
                   "| site | code | rewrite | why |", "|---|---|---|---|"]
            for c in self.control_flow:
                code = (c.code.splitlines() or [""])[0].replace("|", "/")
                md.append(f"| `{c.location}` | `{code}` | {c.route}{': `' + c.became + '`' if c.became else ''} | "
                          f"{'; '.join(c.reasons).replace('|', '/')} |")
        if self.issues:
            md += ["", "| category | module | where | code | fix |", "|---|---|---|---|---|"]
            for i in self.issues:
                md.append(f"| {i.category} | `{i.module or ''}` | `{i.location}` | `{(i.code or '').replace('|', '/')}` | {i.fix} |")
        return "\n".join(md)

    def __str__(self) -> str:
        return self.to_text()


def _draft_export_issues(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Issue]:
    """Every data-dependent site torch.export.draft_export finds, in one run. Its banner and its
    real-tensor decisions would repeat what the report says: this thread's records below ERROR on
    the two loggers that write them are dropped (other threads', and the loggers' levels, are
    untouched: :func:`fxprep.core.threads.quiet_logs`)."""
    try:
        with quiet_logs("torch.export._draft_export", below=logging.ERROR), \
                quiet_logs("torch.fx.experimental.symbolic_shapes", below=logging.ERROR):
            ep = torch.export.draft_export(model, args, kwargs)
    except Exception:  # noqa: BLE001 - draft_export is a best-effort extra
        return []
    report = getattr(ep, "_report", None)
    if report is None:
        return []
    names = dict(getattr(report, "str_to_filename", {}) or {})
    try:  # the ids are interned globally; the report's own table can miss some
        from torch._logging.structured import INTERN_TABLE

        for text, number in INTERN_TABLE.items():
            names.setdefault(number, text)
    except ImportError:
        pass
    issues = []
    for failure in report.failures:
        data = failure.data
        kind = str(getattr(failure.failure_type, "name", failure.failure_type))
        frame = None
        owner: str | None = None
        for entry in data.get("user_stack", []) or []:
            filename = entry.get("filename") if isinstance(entry, dict) else getattr(entry, "filename", None)
            filename = names.get(filename) if isinstance(filename, int) else filename
            line = entry.get("line") if isinstance(entry, dict) else getattr(entry, "lineno", None)
            if isinstance(filename, str) and is_user_file(filename):
                frame = (filename, line)
                found = module_at(model, filename, int(line or 0))
                owner = found if found is not None else owner
        if "FAKE_KERNEL" in kind:
            category = CUSTOM_OP
            message = f"torch.ops.{data.get('op')}: {kind.lower().replace('_', ' ')}"
        elif kind == "GUARD_ADDED":
            category = SPECIALISATION
            message = f"guard added: {data.get('expr')}"
        else:
            category = DATA_DEPENDENT_BRANCH
            message = f"data-dependent expression `{data.get('expr')}` specialised to {data.get('result')}"
        code = None
        if frame:
            import linecache

            code = linecache.getline(frame[0], int(frame[1] or 0)).strip() or None
        issues.append(Issue(category, message, FIXES[category], "draft_export", owner,
                            frame[0] if frame else None, int(frame[1]) if frame and frame[1] else None, code))
    return issues


def check_traceability(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    modules_to_exclude: list[nn.Module] | None = None,
    module_classes_to_exclude: list[type] | None = None,
    concrete_args: dict[str, Any] | None = None,
    draft_export: bool = True,
    control_flow: bool = True,
) -> TraceReport:
    """Run each tracer on ``model`` alone and say what can be captured, what cannot, where and why.

    Nothing is prepared; see docs/concepts/capture.md.

    Args:
        model: The ``nn.Module`` to check.
        example_inputs: As for :func:`fxprep.prepare_model` (Dynamo needs them, or a transformers config).
        modules_to_exclude: Module instances kept as single calls.
        module_classes_to_exclude: Module classes whose instances are kept as single calls.
        concrete_args: ``{argument name: value}`` fixed at capture.
        draft_export: List every data-dependent site with ``torch.export.draft_export`` when a tracer fails.
        control_flow: For data-dependent control flow, say per site whether ``control_flow="rewrite"`` applies.

    Returns:
        A :class:`TraceReport`: each tracer's attempt, the diagnosed issues, the parts that would be opaque.

    Raises:
        InvalidInput: An argument of the wrong kind.
    """
    family = family_for(model)  # asked once, as prepare_model does; the capture request carries it
    # tracers patch process-wide state (fxprep.core.threads)
    with GLOBAL_LOCK, hooks_left_as_found(model), family.working_on(model), \
            root_hooks.set_aside(model):  # as prepare_model does: they run around the forward, not in it
        request = _request(model, family, example_inputs, modules_to_exclude, module_classes_to_exclude, concrete_args)
        return _check_traceability(request, draft_export, control_flow)


def _request(model: Any, family: Family, example_inputs: Any, modules_to_exclude: Any, module_classes_to_exclude: Any,
             concrete_args: Any) -> CaptureRequest:
    """The capture request ``prepare_model`` would make for these arguments (default options): the
    same leaf policy, concrete arguments and tracers (fxprep.capture.cascade)."""
    model = check_model(model)
    policy = leaf_policy(model, modules_to_exclude, module_classes_to_exclude)
    example = normalize_example_inputs(example_inputs)
    concrete = family.concrete_args(model, check_concrete_args(model, concrete_args), example)
    concrete = defaults_as_concrete(model, example, concrete, Report(type(model).__name__))
    return CaptureRequest(model, policy, example, concrete, family=family)


def _check_traceability(request: CaptureRequest, draft_export: bool, control_flow: bool) -> TraceReport:
    model, example = request.model, request.example
    out = TraceReport(type(model).__name__)
    found = cascade.run_each(request)
    out.attempts = found.attempts + found.fallback
    for attempt in found.attempts:
        if attempt.exception is not None:
            out.issues += diagnose(attempt.exception, Route(attempt.tracer).rules, model)
    if not found.whole:
        out.hybrid_ok = found.hybrid is not None
        for site, issue in found.opaque:
            out.opaque[site.qualname] = issue
        if draft_export and example is not None:
            fresh = example.fresh_copy()
            out.issues += _draft_export_issues(model, fresh.args, fresh.kwargs)
        data_dependent = [i for i in out.issues
                          if i.category in (DATA_DEPENDENT_BRANCH, DATA_DEPENDENT_VALUE, DATA_DEPENDENT_LOOP)]
        if control_flow and data_dependent:
            out.control_flow, out.rewrite_tracer = _rewrite(request, data_dependent)
    return out


def _rewrite(request: CaptureRequest, issues: list[Issue]) -> tuple[list[RewrittenSite], str | None]:
    """The ``control_flow="rewrite"`` loop over the whole-model tracers (no opaque fallback); the
    data-dependent sites among ``issues`` it did not reach are assessed without capturing."""
    from ..capture.rewrite.session import ControlFlowRewrite

    model, example = request.model, request.example
    session = ControlFlowRewrite(model, example, [], request.concrete_args, family=request.family)
    result, attempts = session.capture(lambda: cascade.capture(request))
    for issue in issues:
        if issue.file is not None and issue.line is not None:
            session.assess(issue.file, issue.line)
    report = Report(type(model).__name__)
    report.attempts = attempts
    session.report(report, {}, result.tracer if result is not None else None)
    for site in report.control_flow:
        site.branches = {}  # nothing is verified by a check
    return report.control_flow, result.tracer if result is not None else None
