"""The report: what fxprep did to a model, and how sure it is of the result.

Reachable as ``gm.fxprep_report`` (or :func:`fxprep.get_report`) and rendered as text, markdown or
JSON: capture attempts, modules added, ops left functional, unrolled modules, input checks, notes,
the verification result and timings. The text is short by default; ``report.to_text(verbose=True)``
lists every module added, unrolled and checked by name.

See docs/getting-started.md and docs/cli.md.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CaptureAttempt:
    """One tracer's try, kept in the report whether it succeeded or not."""

    tracer: str
    ok: bool
    seconds: float
    error: str | None = None
    error_type: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    @classmethod
    def failed(cls, tracer: str, err: BaseException, start: float) -> CaptureAttempt:
        """The attempt of ``tracer`` (started at ``time.perf_counter()`` value ``start``) that
        raised ``err``, with the error described for people (file:line, category)."""
        from .diagnose import describe_exception

        return cls(tracer, False, time.perf_counter() - start, describe_exception(err), type(err).__name__, err)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the live exception out: it exists for the capture's own
        decisions and diagnosis, and a Dynamo error holds the traced frames' globals (modules,
        which cannot be copied: AIMET's QuantSim deep-copies the prepared module and its report)."""
        state = dict(self.__dict__)
        state["exception"] = None
        return state

    def to_dict(self) -> dict[str, Any]:
        return {
            "tracer": self.tracer,
            "ok": self.ok,
            "seconds": round(self.seconds, 4),
            "error": self.error,
            "error_type": self.error_type,
        }


@dataclass
class AddedModule:
    name: str
    cls: str
    reason: str


@dataclass
class LeftFunctional:
    node: str
    target: str
    scope: str
    reason: str


@dataclass
class Unrolled:
    original: str
    copies: list[str]
    shared_parameters: bool


@dataclass
class RewrittenSite:
    """One data-dependent site met with ``control_flow="rewrite"``: what it was, what it became
    (``route``: "torch.where", "torch.cond" or "not rewritten"), why, and which inputs ran which
    branch (``branches``: "true"/"false" -> input labels)."""

    location: str
    modules: list[str]
    code: str
    route: str
    became: str = ""
    reasons: list[str] = field(default_factory=list)
    branches: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_text(self) -> str:
        where = ", ".join(m or "(root)" for m in self.modules) or "?"
        lines = [f"{self.route.upper()} at {self.location} in {where}", *("    | " + c for c in self.code.splitlines())]
        if self.became:
            lines.append(f"    became: {self.became}")
        lines += [f"    why: {r}" for r in self.reasons]
        for side in ("true", "false"):
            if self.branches:
                ran = self.branches.get(side, [])
                lines.append(f"    {side} branch: " + (f"verified on {', '.join(ran)}" if ran else "NOT exercised by any input"))
        lines += [f"    ! {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class Verification:
    """Outcome of comparing original and prepared on the example inputs."""

    status: str  # "passed", "failed", "skipped"
    max_abs_diff: float | None = None
    rtol: float | None = None
    atol: float | None = None
    outputs_compared: int = 0
    grad: bool = False
    grad_max_abs_diff: float | None = None
    detail: str = ""
    label: str = ""  # what the inputs were, when fxprep built them (control_flow="rewrite")
    # buffers / scalar attributes a run of the original leaves other than a run of the prepared module
    state_not_reproduced: list[str] = field(default_factory=list)
    # how the prepared module's attention calls differ from eager's (:mod:`fxprep.verify.attention_calls`); "" when alike
    attention: str = ""
    # what the result assumed: values the graph holds as constants that no call checks (fxprep.runtime.baked)
    assumed: list[str] = field(default_factory=list)


@dataclass
class Report:
    """What :func:`fxprep.prepare_model` did, at ``gm.fxprep_report``: the route and its attempts, the
    modules added, unrolled and left, the input checks, notes, verification and timings. ``print`` it
    for the short text, :meth:`to_text` ``(verbose=True)`` for all (docs/getting-started.md)."""

    model: str
    tracer: str | None = None
    attempts: list[CaptureAttempt] = field(default_factory=list)
    added: list[AddedModule] = field(default_factory=list)
    left: list[LeftFunctional] = field(default_factory=list)
    unrolled: list[Unrolled] = field(default_factory=list)
    leaves: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    issues: list[Any] = field(default_factory=list)
    verification: Verification = field(default_factory=lambda: Verification("skipped", detail="not run"))
    extra_verifications: list[Verification] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    inputs: str = ""
    control_flow: list[RewrittenSite] = field(default_factory=list)
    # Block reuse on the Dynamo path: {"captured": {block: [instances stamped from it]}, "why": {block: reason}}
    reuse: dict[str, Any] = field(default_factory=dict)
    # ops that only check the inputs (a position check, an assert): kept as calls, not made modules
    checks: list[LeftFunctional] = field(default_factory=list)

    # --- recording (called by the passes) -------------------------------------------------------
    def module_added(self, name: str, cls: str, reason: str) -> None:
        self.added.append(AddedModule(name, cls, reason))

    def left_functional(self, node: str, target: str, scope: str, reason: str) -> None:
        self.left.append(LeftFunctional(node, target, scope, reason))

    def input_check(self, node: str, target: str, scope: str, reason: str) -> None:
        self.checks.append(LeftFunctional(node, target, scope, reason))

    def module_unrolled(self, original: str, copies: list[str], shared: bool) -> None:
        self.unrolled.append(Unrolled(original, copies, shared))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The inverse of :meth:`to_dict` (issues stay plain dicts); KeyError/TypeError/ValueError
        when ``data`` is not such a dict."""
        return cls(
            str(data.get("model", "unknown")),
            tracer=data.get("tracer"),
            attempts=[CaptureAttempt(a["tracer"], bool(a["ok"]), float(a["seconds"]), a.get("error"), a.get("error_type"))
                      for a in data.get("attempts", [])],
            added=[AddedModule(**a) for a in data.get("added", [])],
            left=[LeftFunctional(**x) for x in data.get("left_functional", [])],
            unrolled=[Unrolled(**u) for u in data.get("unrolled", [])],
            leaves=dict(data.get("leaves", {})),
            notes=list(data.get("notes", [])),
            issues=list(data.get("issues", [])),
            verification=Verification(**data.get("verification", {"status": "skipped"})),
            timings=dict(data.get("timings", {})),
            inputs=str(data.get("inputs", "")),
            control_flow=[RewrittenSite(**c) for c in data.get("control_flow", [])],
            reuse=dict(data.get("reuse", {})),
            checks=[LeftFunctional(**x) for x in data.get("input_checks", [])],
        )

    # --- rendering ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tracer": self.tracer,
            "inputs": self.inputs,
            "attempts": [a.to_dict() for a in self.attempts],
            "added": [asdict(a) for a in self.added],
            "left_functional": [asdict(x) for x in self.left],
            "unrolled": [asdict(u) for u in self.unrolled],
            "leaves": dict(self.leaves),
            "notes": list(self.notes),
            "issues": [i.to_dict() if hasattr(i, "to_dict") else str(i) for i in self.issues],
            "verification": asdict(self.verification),
            "extra_verifications": [asdict(v) for v in self.extra_verifications],
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "control_flow": [asdict(c) for c in self.control_flow],
            "reuse": dict(self.reuse),
            "input_checks": [asdict(x) for x in self.checks],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str, **kwargs)

    def _verification_line(self) -> str:
        v = self.verification
        if v.status == "skipped":
            return f"skipped ({v.detail})"
        line = f"{v.status}: {v.outputs_compared} output tensor(s), max |diff| = {v.max_abs_diff:.3g}"
        line += f" (rtol={v.rtol:g}, atol={v.atol:g})"
        if v.grad:
            line += f"; gradients max |diff| = {v.grad_max_abs_diff:.3g}" if v.grad_max_abs_diff is not None else "; gradients checked"
        if v.detail:
            line += f" - {v.detail}"
        if v.state_not_reproduced:
            line += f" - state NOT reproduced: {', '.join(v.state_not_reproduced[:8])}"
        if v.assumed:
            line += (f" - assuming unchanged (held as constants, not checked at each call): {'; '.join(v.assumed[:4])}"
                     + ("; ..." if len(v.assumed) > 4 else ""))
        return line

    def to_text(self, verbose: bool = False) -> str:
        """The report as text: short (every count, the opaque parts and the notes; the modules added
        counted by class), or with ``verbose`` every module added, unrolled and checked, by name."""
        lines = [f"fxprep report for {self.model}"]
        if self.inputs:
            lines.append(f"  inputs: {self.inputs}")
        lines.append(f"  route: {self._route()}")
        for a in self.attempts:
            if verbose or not a.ok:
                lines.append(f"    - {a.tracer}: {'ok' if a.ok else 'failed'} in {a.seconds:.2f}s" + (f" - {a.error}" if a.error else ""))
        lines.append(f"  verification: {self._verification_line()}")
        for i, v in enumerate(self.extra_verifications, 1):
            lines.append(f"    + {v.label or f'verify_inputs[{i - 1}]'}: {v.status}, max |diff| = {v.max_abs_diff:.3g}"
                         + (f" - {v.detail}" if v.detail else ""))
        lines += self._modules_text(verbose)
        if self.control_flow:
            done = sum(c.route != "not rewritten" for c in self.control_flow)
            lines.append(f"  data-dependent control flow rewritten: {done} of {len(self.control_flow)} site(s)")
            for c in self.control_flow:
                lines.extend("    " + t for t in c.to_text().splitlines())
        if self.issues:
            lines.append(f"  issues: {len(self.issues)}")
            for i in self.issues:
                lines.extend("    " + t for t in (i.to_text() if hasattr(i, "to_text") else str(i)).splitlines())
        if self.notes:
            lines.append("  notes:")
            for text, members in group_notes(self.notes if verbose else _short_notes(self.notes)):
                lines.append(f"    ! {text}")
                lines.extend(f"        {m}" for m in members)
        if self.timings:
            lines.append(f"  timings: {self._timings_line()}")
        if not verbose and (self.added or self.unrolled or self.checks or len(self.left) > SHORT_LIST):
            lines.append("  (every module by name: report.to_text(verbose=True), fxprep prepare --verbose, or the graph view)")
        return "\n".join(lines)

    def _route(self) -> str:
        """The tracer that captured the model, and how (whole, or with opaque parts)."""
        if not self.tracer:
            return "none succeeded"
        ok = next((a for a in reversed(self.attempts) if a.ok), None)
        opaque = self.opaque_parts()
        how = f"with {len(opaque)} opaque part(s)" if opaque else "captured whole"
        return f"{self.tracer}, {how}" + (f" in {ok.seconds:.2f}s" if ok is not None else "")

    def opaque_parts(self) -> list[str]:
        """The parts of the model that run eagerly as calls the graph cannot see into."""
        return [name for name, why in self.leaves.items() if str(why).startswith("opaque")]

    def _modules_text(self, verbose: bool) -> list[str]:
        lines = [f"  modules added: {len(self.added)}" + (f" ({_by_class(self.added)})" if self.added and not verbose else "")]
        if verbose:
            lines += [f"    + {m.name} ({m.cls}): {m.reason}" for m in self.added]
        if self.unrolled:
            listed = verbose or len(self.unrolled) <= 4  # a few are read at a glance (AIMET's example: relu -> relu_1..3)
            lines.append(f"  reused modules unrolled: {len(self.unrolled)}"
                         + ("" if listed else f" ({sum(len(u.copies) for u in self.unrolled)} copies)"))
            for u in self.unrolled if listed else []:
                kind = "shared parameters" if u.shared_parameters else "independent copies"
                lines.append(f"    * {u.original} → {', '.join(u.copies)} ({kind})")
        if self.leaves:
            opaque = self.opaque_parts()
            lines.append(f"  kept as leaves: {len(self.leaves)}" + (f", {len(opaque)} of them opaque" if opaque else ""))
            shown = [(n, w) for n, w in self.leaves.items() if verbose or n in opaque or len(self.leaves) <= SHORT_LIST]
            lines += [f"    = {name}: {why}" for name, why in shown]
            if len(shown) < len(self.leaves):
                lines.append(f"    = ... {len(self.leaves) - len(shown)} more")
        lines.append(f"  ops left functional (outside the view/metadata allow-list): {len(self.left)}")
        shown_left = self.left if verbose else self.left[:SHORT_LIST]
        lines += [f"    - {x.node} = {x.target} in '{x.scope}': {x.reason}" for x in shown_left]
        if len(shown_left) < len(self.left):
            lines.append(f"    - ... {len(self.left) - len(shown_left)} more")
        if self.checks:
            lines.append(f"  input checks kept as calls (not modules: nothing to quantize): {len(self.checks)}"
                         + ("" if verbose else f" ({', '.join(sorted({x.scope or '(root)' for x in self.checks}))})"))
            lines += [f"    ? {x.node} = {x.target} in '{x.scope}': {x.reason}" for x in (self.checks if verbose else [])]
        return lines

    def _timings_line(self) -> str:
        """The stages' seconds, summed to the total (the time ``prepare_model`` took, every try included)."""
        parts = [f"{k} {v:.2f}s" for k, v in self.timings.items() if k != "total"]
        total = self.timings.get("total")
        return " + ".join(parts) + (f" = total {total:.2f}s" if total is not None else "")

    def to_markdown(self) -> str:
        md = [f"## fxprep report: `{self.model}`", ""]
        md.append(f"- **tracer**: {self.tracer or 'none succeeded'}")
        if self.inputs:
            md.append(f"- **inputs**: `{self.inputs}`")
        md.append(f"- **verification**: {self._verification_line()}")
        md.append(f"- **modules added**: {len(self.added)}; **unrolled**: {len(self.unrolled)}; "
                  f"**left functional**: {len(self.left)}; **leaves**: {len(self.leaves)}")
        if self.attempts:
            md += ["", "| tracer | result | seconds | error |", "|---|---|---|---|"]
            for a in self.attempts:
                md.append(f"| {a.tracer} | {'ok' if a.ok else 'failed'} | {a.seconds:.2f} | {(a.error or '').replace('|', '/')} |")
        if self.added:
            md += ["", "| module | class | why |", "|---|---|---|"]
            md += [f"| `{m.name}` | {m.cls} | {m.reason} |" for m in self.added]
        if self.left:
            md += ["", "| op left functional | scope | why |", "|---|---|---|"]
            md += [f"| `{x.target}` | `{x.scope}` | {x.reason} |" for x in self.left]
        if self.control_flow:
            md += ["", "| control-flow site | became | why | branches verified |", "|---|---|---|---|"]
            for c in self.control_flow:
                ran = "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in c.branches.items())
                md.append(f"| `{c.location}` `{c.code.splitlines()[0] if c.code else ''}` | {c.route}: `{c.became}` | "
                          f"{'; '.join(c.reasons)} | {ran} |".replace("\n", " "))
        if self.notes:
            for text, members in group_notes(self.notes):
                md += ["", f"> {text}"] + [f"> - {m}" for m in members]
        return "\n".join(md)

    def __str__(self) -> str:
        return self.to_text()


SHORT_LIST = 8  # lists longer than this are counted, not listed, in the short text


_OWN_CAPTURE = re.compile(r"^block reuse: '(?P<block>[^']+)' was captured on its own: ")


def _short_notes(notes: list[str]) -> list[str]:
    """The notes for the short text: each block that block reuse captured on its own (a note each,
    saying why: six for a ResNet-18) counted in one note; the verbose text keeps every one."""
    alone = [m["block"] for m in map(_OWN_CAPTURE.match, notes) if m is not None]
    if len(alone) < 2:
        return notes
    out = [n for n in notes if not _OWN_CAPTURE.match(n)]
    shown = ", ".join(alone[:4]) + (", ..." if len(alone) > 4 else "")
    out.append(f"block reuse: {len(alone)} blocks were captured on their own ({shown}): the model's code or "
               f"parameters differ from the blocks before them; the verbose report says how, block by block.")
    return out


def _by_class(added: list[AddedModule]) -> str:
    """``Mul 40, Add 24, Pow 9, ...``: the modules added, counted by class, most first."""
    counts = Counter(m.cls for m in added)
    shown = [f"{cls} {n}" for cls, n in counts.most_common(6)]
    return ", ".join(shown) + (", ..." if len(counts) > 6 else "")


# --- notes said once -----------------------------------------------------------------------------
# "WhisperEncoder (encoder) reads self.training at /path/generic.py:622": a module, what it does, where.
_MODULE_NOTE = re.compile(r"^(?P<subject>[\w.]+ \([^()]*\)) (?P<predicate>.+?) at (?P<file>\S+?):(?P<line>\d+)$")


def group_notes(notes: list[str]) -> list[tuple[str, list[str]]]:
    """Notes that say the same thing about different places, said once.

    A note reads ``<where>: <what it means>``; notes whose meaning (the text after the first
    ``": "``) is the same are grouped, first-seen order kept: ``(header, member lines)``. When the
    places are modules doing the same thing (``"Encoder (encoder) reads self.training at f.py:12"``)
    the header says it once and each module is one line with its source lines, so Whisper's
    fourteen ``self.training`` notes become one note listing six modules. A note said once stays
    as it is, with no member lines.
    """
    groups: dict[str, list[str]] = {}
    order: list[tuple[str, str]] = []
    for note in notes:
        head, sep, meaning = note.partition(": ")
        key = meaning if sep and head else note
        if key not in groups:
            groups[key] = []
            order.append((key, note))
        groups[key].append(head)
    out: list[tuple[str, list[str]]] = []
    for key, first in order:
        heads = groups[key]
        if len(heads) == 1:
            out.append((first, []))
            continue
        out.append(_grouped(key, heads))
    return out


def _grouped(meaning: str, heads: list[str]) -> tuple[str, list[str]]:
    matches = [_MODULE_NOTE.match(h) for h in heads]
    predicates = {m["predicate"] for m in matches if m is not None}
    if any(m is None for m in matches) or len(predicates) != 1:
        return f"in {len(heads)} places: {meaning}", heads
    places: dict[str, dict[str, list[str]]] = {}  # subject -> file -> lines
    for m in matches:
        assert m is not None
        places.setdefault(m["subject"], {}).setdefault(m["file"], []).append(m["line"])
    members = [f"{subject} at " + "; ".join(f"{file}:{', '.join(lines)}" for file, lines in files.items())
               for subject, files in places.items()]
    count = f"{len(places)} module{'s' if len(places) != 1 else ''}"
    if len(heads) != len(places):
        count += f" ({len(heads)} places)"
    return f"{predicates.pop()} in {count}: {meaning}", members
