"""Preparing from several threads: what fxprep locks, and why its patches are invisible elsewhere.

Capture patches process-wide state for the length of a trace. Two rules make that safe:
:data:`GLOBAL_LOCK`, one re-entrant lock, is held around every stretch that patches or depends on
process-wide state, and every patch is confined to the tracing thread (:func:`confined`,
:class:`ConfinedPatcher`, :func:`confined_fx_patches`, :func:`quiet_logs`). This module depends on
nothing of fxprep's, so every tracer can use it.

See docs/security.md ("Concurrency model").
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx._symbolic_trace as fx_trace

# Held while state shared by the whole process is patched or relied on (see the module docstring).
GLOBAL_LOCK = threading.RLock()


def confined(new: Callable[..., Any], original: Callable[..., Any], owner: int | None = None) -> Callable[..., Any]:
    """``new`` on the thread ``owner`` (default: the calling thread), ``original`` on every other one.

    What replaces a process-wide function while one thread traces must not change what the others
    run: an unrelated eager model calling ``torch.zeros`` keeps calling torch's own ``zeros``.
    """
    owner = threading.get_ident() if owner is None else owner

    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return new(*args, **kwargs)
        return original(*args, **kwargs)

    with contextlib.suppress(AttributeError, TypeError):
        functools.update_wrapper(call, original)
    call.__wrapped__ = new  # type: ignore[attr-defined]  # what this thread sees (introspection, fx's wrap table)
    return call


def on_owner_thread(owner: int) -> bool:
    return threading.get_ident() == owner


class ConfinedPatcher(fx_trace._Patcher):
    """``torch.fx``'s patcher, each replacement confined to the thread that made the patcher.

    ``fx.Tracer.trace`` creates one patcher per trace (through the module-global ``_Patcher``) and
    uses it to replace ``Module.__call__``, ``Module.__getattr__``, ``torch.fx.wrap`` functions and
    ``math`` functions for the trace. This subclass passes each replacement through
    :func:`confined`, so only the tracing thread sees it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.owner = threading.get_ident()

    def patch(self, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        if getattr(frame_dict.get(name), "__fx_already_patched", False):
            return  # fx's own de-duplication, checked before wrapping (the wrapper carries the mark)
        original = frame_dict.get(name, getattr(builtins, name, None))
        if original is None:
            super().patch(frame_dict, name, new_fn, deduplicate)
            return
        super().patch(frame_dict, name, confined(new_fn, original, self.owner), deduplicate)

    def patch_method(self, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        original = getattr(cls, name)
        if getattr(original, "__fx_already_patched", False):
            return
        super().patch_method(cls, name, confined(new_fn, original, self.owner), deduplicate)


@contextlib.contextmanager
def confined_fx_patches() -> Iterator[None]:
    """Hold :data:`GLOBAL_LOCK` and make ``torch.fx`` traces started on this thread patch through
    :class:`ConfinedPatcher` (``fx.Tracer.trace`` looks ``_Patcher`` up in its module when a trace
    starts). A trace started meanwhile on another thread gets a patcher confined to *its* thread:
    the same behaviour as torch's, minus the leak into other threads."""
    with GLOBAL_LOCK:
        before = fx_trace.__dict__.get("_Patcher")
        fx_trace._Patcher = ConfinedPatcher  # type: ignore[misc]
        try:
            yield
        finally:
            fx_trace._Patcher = before  # type: ignore[misc]


class _OtherThreadsOnly(logging.Filter):
    """Drops the records below ``level`` that the thread which made it logs."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level
        self.owner = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.owner or record.levelno >= self.level


@contextlib.contextmanager
def quiet_logs(name: str, below: int) -> Iterator[None]:
    """Within, records under ``below`` that this thread logs on logger ``name`` are dropped; other
    threads' records, and the logger's level, are untouched (the logger-level alternative silenced
    an unrelated thread's errors for the length of a capture)."""
    logger = logging.getLogger(name)
    quiet = _OtherThreadsOnly(below)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
