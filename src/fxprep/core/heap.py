"""Keeping the garbage collector's full passes off the objects preparing does not own.

Capture allocates hundreds of thousands of short-lived objects, which sets off full
(oldest-generation) collections, and a full pass walks every object in the process: with
``transformers`` imported and a Llama model built, one pass took 0.3 s of a 3 s prepare; after
Dynamo's export of a 7B-shaped Llama, the full passes during fxprep's own passes took 0.19 s of
0.6 s (measured on the 2-core dev machine). ``gc.freeze()`` moves what exists to the permanent
generation, so a full pass only walks what was allocated since.

:func:`frozen_heap` freezes the heap for the length of a prepare and unfreezes it after;
:func:`freeze_more` (called when Dynamo's export returns) freezes what the export left too, but only
inside a freeze fxprep made: a caller that froze objects itself (a pre-fork server) keeps its own
freeze untouched, and nothing is frozen for good. Freezing never frees or keeps anything: garbage
among frozen objects is collected by the first pass after ``gc.unfreeze()``.

This module depends on nothing of fxprep's.
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
