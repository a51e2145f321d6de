"""Where the ``fxprep`` command writes, and how: text a person reads or a script parses.

Two rules, both learned from output that went wrong:

* Text that comes from the user or the model (model names, module names, error messages, reports)
  is printed as it is: no rich markup and no emoji codes, so ``transformers:llama: passed`` does not
  become ``transformers🦙 passed`` and a ``[bold]`` in a name is not swallowed.
* Output that goes to a pipe or a file is not wrapped: a report, a table or an error message is
  grepped, diffed and pasted into issues, so a line stays one line whatever its length. On a
  terminal rich fits tables to the window as usual.

The consoles are made when printing (not at import), so they follow the streams of the moment
(tests and callers that redirect ``sys.stdout`` get what they expect).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# Wide enough that no line of a report or table is wrapped when nobody is looking at a window.
PIPE_WIDTH = 100_000


def console(stderr: bool = False) -> Console:
    """A console on standard output (or error): no emoji, no highlighting, no wrapping into a pipe."""
    from rich.console import Console  # here, not at import: `fxprep --help` does not need rich

    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else PIPE_WIDTH
    return Console(stderr=stderr, emoji=False, highlight=False, width=width)


def say(text: str, *, stderr: bool = False, style: str | None = None) -> None:
    """Print ``text`` exactly (markup off), optionally in one style; never wrapped into a pipe."""
    console(stderr).print(text, markup=False, style=style, soft_wrap=True)


def show(renderable: Any, *, stderr: bool = False) -> None:
    """Print a rich object (a table)."""
    console(stderr).print(renderable)


def print_report(report: Any, *, verbose: bool = False) -> None:
    """The status line in colour, then the report as plain text (short, or every module with
    ``verbose``), its advice in the command's flags (:mod:`.advice`)."""
    from .advice import in_flag_terms

    status = report.verification.status
    style = {"passed": "bold green", "failed": "bold red"}.get(status, "bold yellow")
    say(f"{report.model}: {status}", style=style)
    say(in_flag_terms(report.to_text(verbose=verbose)))


def warn(text: str) -> None:
    """A warning on standard error, in full (never cut, no terminal codes of its own)."""
    say(f"warning: {text}", stderr=True, style="yellow")


def error(kind: str, code: int, message: str) -> None:
    """An error: its kind and exit code, then the message as it is, its first line on the same line
    (what a user reads first, and what a log's one-line summary keeps, says what went wrong)."""
    first, _, rest = message.partition("\n")
    say(f"error ({kind}, exit {code}): {first}", stderr=True, style="bold red")
    if rest:
        say(rest, stderr=True)
