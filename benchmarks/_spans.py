"""Where a ``prepare_model`` call spends its time, by fxprep's own stages: named functions wrapped
for the length of a ``with spans():`` block, each call's wall time and nesting recorded.

cProfile on a two-minute prepare costs as much as the prepare and lists Dynamo's internals; what
the shape-general cost question needs is coarser: how many whole-model Dynamo traces, how many
verification runs, which stage asked for each. Every reference to a wrapped function held by an
fxprep module (``from .verify import verify``) is swapped too, so calls through any of them count.
Imported by scripts run as ``python benchmarks/<script>.py``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# (module, attribute, label): the stages worth a line each; Dynamo's own export is every trace
WATCHED = (
    ("torch._dynamo", "export", "dynamo trace"),
    ("fxprep.api", "_prepare", "prepare attempt"),
    ("fxprep.api", "_capture", "capture stage"),
    ("fxprep.capture.cascade", "capture", "cascade.capture"),
    ("fxprep.capture.cascade", "capture_with_opaque_parts", "opaque-part fallback"),
    ("fxprep.capture.dynamo", "capture_dynamo", "capture_dynamo"),
    ("fxprep.capture.dynamo.reuse", "capture_reusing", "capture_reusing"),
    ("fxprep.capture.dynamo.fallback", "capture_dynamo_leaves", "dynamo+leaves"),
    ("fxprep.capture.dynamo.values", "capture_deciding_values", "dynamo+values"),
    ("fxprep.capture.dynamo.scans", "usable", "scan search"),
    ("fxprep.capture.dynamo.locate", "locate", "locate (eager replay)"),
    ("fxprep.capture.dynamo.scans", "watch", "scan watch (eager)"),
    ("fxprep.capture.dynamo.values", "broken_on_perturbed", "values: perturbed run"),
    ("fxprep.capture.dynamo.relift", "relift", "relift"),
    ("fxprep.capture.shape_general", "capture", "shape_general.capture"),
    ("fxprep.capture.shape_general", "limits", "shape_general.limits (branch trace)"),
    ("fxprep.capture.shape_general", "fallback", "shape_general.fallback"),
    ("fxprep.capture.dynamo.size_branches", "batch_branches", "batch probe trace"),
    ("fxprep.capture.dynamo.size_branches", "size_branches", "size_branches"),
    ("fxprep.verify", "verify", "verify"),
    ("fxprep.verify", "run_original", "reference run"),
    ("fxprep.api", "_passes", "passes"),
    ("fxprep.api", "_guard_inputs", "input guard"),
    ("fxprep.pipeline.verification", "verification", "verification stage"),
)


@dataclass
class Span:
    label: str
    start: float
    seconds: float = 0.0
    detail: str = ""
    children: list[Span] = field(default_factory=list)


@dataclass
class Recorder:
    root: Span = field(default_factory=lambda: Span("all", time.perf_counter()))
    stack: list[Span] = field(default_factory=list)

    def totals(self) -> dict[str, tuple[int, float]]:
        """label -> (calls, seconds), outermost calls only (a recursive one counts once)."""
        out: dict[str, tuple[int, float]] = {}

        def walk(span: Span, open_labels: frozenset[str]) -> None:
            for child in span.children:
                if child.label not in open_labels:
                    n, s = out.get(child.label, (0, 0.0))
                    out[child.label] = (n + 1, s + child.seconds)
                walk(child, open_labels | {child.label})

        walk(self.root, frozenset())
        return out

    def tree(self, min_seconds: float = 0.05) -> str:
        lines: list[str] = []

        def walk(span: Span, depth: int) -> None:
            for child in span.children:
                if child.seconds >= min_seconds or child.label == "dynamo trace":
                    lines.append(f"{'  ' * depth}{child.label:<40} {child.seconds:8.2f} s  {child.detail}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


def _detail(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if label == "dynamo trace" and args:
        spec = kwargs.get("dynamic_shapes")
        return f"{type(args[0]).__name__}{' dynamic' if spec else ''}"
    if label == "verify" and "what" in kwargs:
        return str(kwargs["what"])[:60]
    if label == "prepare attempt" and len(args) > 2 and isinstance(args[2], dict):
        return f"dynamic={args[2].get('dynamic', 'default')!r}"
    return ""


def _export(fn: Any, rec: Recorder) -> Any:
    """``torch._dynamo.export(model, ...)`` returns the function that traces: that call is the span."""
    def export(*args: Any, **kwargs: Any) -> Any:
        traced = fn(*args, **kwargs)
        return _wrapped(traced, "dynamo trace", rec, _detail("dynamo trace", args, kwargs))

    return export


def _wrapped(fn: Any, label: str, rec: Recorder, detail: str | None = None) -> Any:
    if label == "dynamo trace" and detail is None:
        return _export(fn, rec)

    def call(*args: Any, **kwargs: Any) -> Any:
        span = Span(label, time.perf_counter(), detail=detail if detail is not None else _detail(label, args, kwargs))
        (rec.stack[-1] if rec.stack else rec.root).children.append(span)
        rec.stack.append(span)
        try:
            return fn(*args, **kwargs)
        finally:
            rec.stack.pop()
            span.seconds = time.perf_counter() - span.start

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def spans() -> Iterator[Recorder]:
    """Record the :data:`WATCHED` calls made inside the block."""
    import importlib

    rec = Recorder()
    swapped: list[tuple[Any, str, Any]] = []
    for module_name, attr, label in WATCHED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, attr, None)
        if fn is None:
            continue
        wrapper = _wrapped(fn, label, rec)
        holders = [module] + [m for name, m in list(sys.modules.items())
                              if name.startswith("fxprep") and m is not None and m is not module
                              and getattr(m, attr, None) is fn]
        for holder in holders:
            swapped.append((holder, attr, fn))
            setattr(holder, attr, wrapper)
    try:
        yield rec
    finally:
        for holder, attr, fn in reversed(swapped):
            setattr(holder, attr, fn)
        rec.root.seconds = time.perf_counter() - rec.root.start
