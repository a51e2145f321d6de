"""The ``fxprep`` command: a thin layer over the library API.

Commands: ``prepare`` (prepare, verify, save, optionally export ONNX and write the graph view),
``check`` (can it be captured, and how), ``show`` (a saved graph as an HTML page, text, DOT or SVG),
``survey`` (a model zoo, one subprocess per model) and ``demo``. ``--json`` prints one JSON object
for scripts instead of the human output; ``--version`` prints the version.

Exit codes (also in ``fxprep --help``)::

    0  success
    1  fxprep could not prepare the model (capture or a pass failed)
    2  usage error: bad spec, input, option, or the model itself failed on the inputs
    3  verification failed: the prepared module computes something else
    4  saving, loading or exporting failed (including an -o that cannot be written)
    130 interrupted (Ctrl-C)

Errors are printed as the readable message of the :class:`~fxprep.errors.FxprepError` raised, never
as a traceback (``FXPREP_DEBUG=1`` shows it); fxprep's own warnings are printed in full on standard
error, other libraries' warnings are silenced. Progress is shown on a terminal (``--quiet`` hides it,
``--progress`` forces plain lines into a pipe or a log).

This file imports nothing but the standard library, so that :func:`main` is running (and a Ctrl-C
is one line and exit 130) before typer, rich or torch is imported; the commands are in
:mod:`.application` (the typer application and its error handling), :mod:`.prepare` and :mod:`.commands`.
"""

from __future__ import annotations

import sys
from typing import Any

from .interrupt import EXIT_INTERRUPTED, interrupted

__all__ = ["EXIT_INTERRUPTED", "console_main", "interrupted", "main"]


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (``sys.argv[1:]`` when None) and exit with the documented code."""
    sys.exit(_run(argv))


def console_main() -> None:
    """The ``fxprep`` console script: :func:`main`, then out of the process at once.

    Python's own finalisation after torch is imported (every module and object freed one by one)
    took 3 to 6 seconds on a busy 2-core machine: time the user waited after the last line, that no
    timing the command prints could show. So once the command is done, the output is flushed and the
    ``atexit`` handlers run (what finalisation does that has an effect: finalizers, multiprocessing's
    clean-up, logging), and the process ends without the rest."""
    code = _run(None)
    if "torch" not in sys.modules:
        sys.exit(code)
    import atexit
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`fxprep ... | head`)
            pass
    if code != EXIT_INTERRUPTED:  # after a Ctrl-C a half-imported library's handler would only add noise
        atexit._run_exitfuncs()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    try:
        from .application import run

        return run(argv)
    except KeyboardInterrupt:
        return interrupted()


def __getattr__(name: str) -> Any:
    """``fxprep.cli.app`` and the exit codes, where callers (and tests) found them before the
    typer application moved to :mod:`.application`; imported on first use."""
    import importlib

    if name in ("app", "exit_code_for") or name.startswith("EXIT_"):
        return getattr(importlib.import_module(f"{__name__}.application"), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
