"""Running the ``fxprep`` command in-process, shared by the CLI tests (tests/test_cli*.py, ...).

A file that invokes the CLI in-process also requests the ``_restore_process_state`` fixture of
tests/conftest.py (``pytestmark = pytest.mark.usefixtures("_restore_process_state")``): the CLI quiets
torch's logging and Python's warnings for its process, and the fixture undoes that after each test.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fxprep import cli

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(cli.app, list(args))
    assert "Traceback" not in result.output + (result.stderr or ""), result.output
    return result


def as_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])
