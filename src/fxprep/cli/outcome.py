"""How a command ends: its exit code, its error message, and a Ctrl-C.

Every command body runs in :func:`guarded`: an :class:`~fxprep.errors.FxprepError` becomes its
readable message (in the command line's terms: ``--dynamic``, not ``dynamic=``, see :mod:`.advice`)
and its documented exit code, fxprep's own warnings are printed in full, a Ctrl-C is one line and
exit 130, and anything else is an internal error, never a raw traceback (``FXPREP_DEBUG=1`` shows it).
Nothing here imports torch: the body imports what it needs, inside the guard, so a Ctrl-C while
torch is being imported is still one line.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable

import typer

from ..errors import (
    EquivalenceError,
    ExportError,
    FxprepError,
    FxprepWarning,
    InvalidInput,
    ModelError,
    SerializationError,
)
from . import console as out
from .advice import in_flag_terms
from .interrupt import MESSAGE as INTERRUPTED
from .interrupt import interrupted

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY, EXIT_DELIVERY, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 fxprep could not prepare the model; 2 usage error (bad spec, input or "
    "option, or the model itself failed on the inputs); 3 verification failed; 4 save/load/export failed "
    "(including an -o that cannot be written); 130 interrupted."
)


def exit_code_for(err: BaseException) -> int:
    """The documented exit code of an exception."""
    if isinstance(err, EquivalenceError):
        return EXIT_VERIFY
    if isinstance(err, (SerializationError, ExportError)):
        return EXIT_DELIVERY
    if isinstance(err, (InvalidInput, ModelError)):
        return EXIT_USAGE
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILURE


def fail(err: BaseException, as_json: bool) -> typer.Exit:
    """Print ``err`` (its kind and exit code, then its message in flag terms) and the exit to raise."""
    code = exit_code_for(err)
    message = INTERRUPTED if isinstance(err, KeyboardInterrupt) else in_flag_terms(str(err))
    if as_json:
        print(json.dumps({"ok": False, "exit_code": code, "error_type": type(err).__name__, "error": message}))
    else:
        out.error(type(err).__name__, code, message)
    return typer.Exit(code)


def file_error(err: OSError) -> SerializationError:
    """A file the command could not read or write (a full disk, a read-only place): exit 4, in words."""
    where = f" {err.filename}" if err.filename else ""
    return SerializationError(f"cannot write or read{where}: {err.strerror or err}.")


def guarded(fn: Callable[[], int], as_json: bool) -> None:
    """Run a command body; FxprepErrors become readable messages and their exit codes, fxprep's own
    warnings are printed in full on standard error, a Ctrl-C is one line (exit 130), and any other
    exception is an internal error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", FxprepWarning)
        try:
            code = fn()
        except typer.Exit:
            raise
        except KeyboardInterrupt as err:
            interrupted()  # one line on standard error; later Ctrl-Cs ignored while the process winds down
            raise (fail(err, True) if as_json else typer.Exit(EXIT_INTERRUPTED)) from None
        except (FxprepError, OSError) as err:
            if os.environ.get("FXPREP_DEBUG"):
                raise
            raise fail(file_error(err) if isinstance(err, OSError) else err, as_json) from None
        except Exception as err:  # noqa: BLE001 - a bug: still no raw traceback unless asked
            if os.environ.get("FXPREP_DEBUG"):
                raise
            wrapped = FxprepError(
                f"internal error: {type(err).__name__}: {err}\nThis is a bug in fxprep (or in the model's own code). "
                f"Re-run with FXPREP_DEBUG=1 for the traceback and please report it."
            )
            raise fail(wrapped, as_json) from None
        finally:
            for w in caught:
                if issubclass(w.category, FxprepWarning):
                    out.warn(in_flag_terms(str(w.message)))
    raise typer.Exit(code)


def quiet_libraries() -> None:
    """Other libraries' warnings and logs off for this (short-lived) process; called inside the guard:
    it imports torch."""
    import logging

    warnings.filterwarnings("ignore")
    warnings.simplefilter("always", FxprepWarning)  # ahead of the line above: fxprep's own are printed (guarded)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    logging.getLogger("torch").setLevel(logging.ERROR)
    try:  # Dynamo / export log their guard and shape warnings through torch._logging
        import torch._logging

        torch._logging.set_logs(all=logging.ERROR)
    except (ImportError, TypeError, ValueError):
        pass
