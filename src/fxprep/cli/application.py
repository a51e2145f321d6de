"""The typer application of the ``fxprep`` command: its commands, ``--version``, and how it is run.

The commands' bodies are in :mod:`.prepare` and :mod:`.commands`; nothing here, nor in them at
import, imports torch: ``fxprep --help`` and ``fxprep --version`` answer in a fraction of a second
(``benchmarks/cli_startup.py`` measures it), and a command imports torch inside its guard
(:func:`.outcome.guarded`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..version import __version__
from . import commands, prepare
from .interrupt import interrupted
from .outcome import EXIT_CODES_HELP, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

app = typer.Typer(
    help=f"Turn PyTorch models into clean, verified, module-level torch.fx graphs.\n\n{EXIT_CODES_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"fxprep {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", help="Print fxprep's version and exit.", is_eager=True,
                                          callback=_version)] = False,
) -> None:
    """Turn PyTorch models into clean, verified, module-level torch.fx graphs."""


app.command("prepare")(prepare.prepare_command)
app.command("check")(commands.check_command)
app.command("show")(commands.show_command)
app.command("survey")(commands.survey_command)
app.command("demo")(commands.demo_command)


def _click_exception() -> type[Exception]:
    """click's base of usage errors: typer's own copy of click (typer >= 0.22), else click's."""
    import importlib

    try:
        module = importlib.import_module("typer._click.exceptions")
    except ImportError:
        module = importlib.import_module("click.exceptions")
    return module.ClickException


def run(argv: list[str] | None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` when None); its exit code.

    Not typer's standalone mode: there a Ctrl-C outside a command's body is "Aborted!" and exit 1
    (older typer) or a silent 130; here it is always one line and 130."""
    usage_error = _click_exception()
    try:
        result = app(args=argv, prog_name="fxprep", standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        return interrupted()
    except typer.Exit as err:
        result = err.exit_code
    except usage_error as err:
        err.show()  # type: ignore[attr-defined]
        return int(getattr(err, "exit_code", EXIT_USAGE))
    if result == EXIT_INTERRUPTED:  # typer's own answer to a Ctrl-C while it parsed (said once)
        return interrupted()
    return int(result) if isinstance(result, int) else EXIT_OK if result is None else EXIT_FAILURE
