"""Progress of long work: which stage ``prepare_model`` is in, while it is in it.

Every stage and the cheap-to-report steps inside a long capture are announced through a context
variable (:func:`step`, no progress object passed down), and shown as ``logging`` records on the
``"fxprep"`` logger, as a one-line ``rich`` display on an interactive terminal, or as plain lines
when ``progress=True`` forces them into a pipe. ``progress=False`` shows and logs nothing. ``rich``
is imported only when the display is shown.

See docs/guides/progress.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("fxprep")

_CURRENT: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("fxprep_progress", default=None)


def interactive() -> bool:
    """Whether standard error is a terminal a person is watching (not a pipe, a file or a dumb terminal)."""
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class Reporter:
    """The progress of one piece of work (one ``prepare_model`` call): stages and steps within them.

    Each event is a log record on the ``"fxprep"`` logger carrying ``fxprep_model``, ``fxprep_stage``
    and ``fxprep_event`` (``"stage"``, ``"step"`` or ``"done"``) as attributes, so tools can follow
    the work without parsing the message.
    """

    def __init__(self, title: str, display: Any = None) -> None:
        self.title = title
        self.stage_name = ""
        self.start = time.perf_counter()
        self._display = display
        self._task: Any = None
        if display is not None:
            self._task = display.add_task(title, total=None, stage="starting")

    def _emit(self, event: str, message: str) -> None:
        logger.info("%s: %s", self.title, message,
                    extra={"fxprep_model": self.title, "fxprep_stage": self.stage_name, "fxprep_event": event})
        if self._display is not None:
            self._display.update(self._task, stage=message)

    def stage(self, name: str) -> None:
        """A new stage starts (the previous one ends)."""
        self.stage_name = name
        self._emit("stage", name)

    def step(self, text: str) -> None:
        """A step inside the current stage (a retry, a part made opaque, one more input verified)."""
        self._emit("step", f"{self.stage_name}: {text}" if self.stage_name else text)

    def finish(self, error: BaseException | None) -> None:
        seconds = time.perf_counter() - self.start
        self.stage_name = "done"
        outcome = f"failed ({type(error).__name__}) after {seconds:.1f}s" if error else f"done in {seconds:.1f}s"
        self._emit("done", outcome)


def _rich_display() -> Any:
    """A transient one-line display on standard error: spinner, model, stage, elapsed time."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, emoji=False, highlight=False)
    return Progress(SpinnerColumn(), TextColumn("{task.description}:", markup=False),
                    TextColumn("{task.fields[stage]}", markup=False), TimeElapsedColumn(),
                    console=console, transient=True, redirect_stdout=False, redirect_stderr=False)


@contextlib.contextmanager
def _plain_lines() -> Iterator[None]:
    """Plain lines on standard error through the ``"fxprep"`` logger, unless the program already
    routes that logger somewhere (then its own handlers print the records, once)."""
    if logger.hasHandlers() and logger.getEffectiveLevel() <= logging.INFO:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fxprep: %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the program's root handlers (at WARNING) would drop them anyway
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def reporting(progress: Any, title: str) -> Iterator[Reporter | None]:
    """Report the stages of the work inside the ``with`` block, as ``progress`` asks.

    ``progress``: ``None`` (display on a terminal, log records always), ``True`` (display on a
    terminal, plain lines on standard error otherwise) or ``False`` (nothing). A nested call (a
    ``prepare_model`` inside another one's work) reports into the outer reporter.
    """
    if progress is False or _CURRENT.get() is not None:
        token = _CURRENT.set(_CURRENT.get() if progress is not False else None)
        try:
            yield _CURRENT.get()
        finally:
            _CURRENT.reset(token)
        return
    with contextlib.ExitStack() as stack:
        display = None
        if interactive():
            display = stack.enter_context(_rich_display())
        elif progress is True:
            stack.enter_context(_plain_lines())
        reporter = Reporter(title, display)
        token = _CURRENT.set(reporter)
        try:
            yield reporter
        except BaseException as err:
            reporter.finish(err)
            raise
        else:
            reporter.finish(None)
        finally:
            _CURRENT.reset(token)


def stage(name: str) -> None:
    """Announce a new stage of the current work (nothing when no work is being reported)."""
    reporter = _CURRENT.get()
    if reporter is not None:
        reporter.stage(name)


def step(text: str) -> None:
    """Announce a step inside the current stage (nothing when no work is being reported)."""
    reporter = _CURRENT.get()
    if reporter is not None:
        reporter.step(text)
