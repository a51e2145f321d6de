"""The ``fxprep`` command: a thin layer over the library API.

Commands: ``prepare``, ``check``, ``show``, ``survey`` and ``demo``; ``--json`` prints one JSON
object for scripts. Errors are printed as the :class:`~fxprep.errors.FxprepError` message, never a
traceback (``FXPREP_DEBUG=1`` shows it), and exit with the documented codes (0 success, 1 prepare
failed, 2 usage, 3 verification, 4 save/load/export, 130 interrupted). This file imports only the
standard library, so :func:`main` runs (and Ctrl-C is handled) before typer, rich or torch is
imported; the commands are in :mod:`.application`, :mod:`.prepare` and :mod:`.commands`.

See docs/cli.md.
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
