"""Keeping the garbage collector's full passes off the objects preparing does not own.

Capture allocates many short-lived objects, which set off full collections that walk every object in
the process (a large share of a prepare's time with transformers imported). :func:`frozen_heap`
freezes the heap with ``gc.freeze()`` for the length of a prepare, and :func:`freeze_more` freezes
what Dynamo's export left, only inside a freeze fxprep made; a caller's own freeze is left alone and
nothing is frozen for good. This module depends on nothing of fxprep's.

See docs/architecture.md ("Under the hood") for the measurements.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_owned = 0  # prepares in flight inside a freeze fxprep made (several threads may share one)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap while the block runs, unless the caller froze objects itself or turned the
    collector off."""
    global _owned
    with _LOCK:
        if _owned == 0 and (gc.get_freeze_count() or not gc.isenabled()):
            owner = False
        else:
            owner = True
            if _owned == 0:
                gc.freeze()
            _owned += 1
    try:
        yield
    finally:
        if owner:
            with _LOCK:
                _owned -= 1
                if _owned == 0:
                    gc.unfreeze()


def freeze_more() -> None:
    """Move what exists now to the permanent generation, inside a freeze :func:`frozen_heap` made."""
    with _LOCK:
        if _owned:
            gc.freeze()
