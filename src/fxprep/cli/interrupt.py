"""A Ctrl-C, said in one line: ``fxprep: interrupted (Ctrl-C)`` on standard error, exit 130.

Standard library only, so that :func:`fxprep.cli.main` can say it whatever was being imported when
the Ctrl-C came (torch's import takes seconds: before, a Ctrl-C there was a 23-line traceback).
"""

from __future__ import annotations

import signal
import sys

EXIT_INTERRUPTED = 130
MESSAGE = "interrupted (Ctrl-C)"
_said = False


def interrupted() -> int:
    """Say it (once per process, whoever asks again) and return 130. A second Ctrl-C while the
    process winds down (torch's and the exporters' clean-up) is ignored, so no traceback follows."""
    global _said
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to ignore
        pass
    if not _said:
        _said = True
        print(f"fxprep: {MESSAGE}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
