"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the fuzzers tried in this run (their counts are part of the CI log; the tamper
    fuzzer draws anew each run, the index and model fuzzers too except where the ``CI`` variable is
    set, which makes hypothesis load its derandomized "ci" profile). A test reports its line as the
    user property "summary", which pytest-xdist carries from the workers, where ``print`` is captured."""
    lines = [value for outcome in ("passed", "failed") for report in terminalreporter.stats.get(outcome, [])
             if getattr(report, "when", "call") == "call"
             for name, value in getattr(report, "user_properties", []) if name == "summary"]
    if lines:
        terminalreporter.section("fuzz counts")
        for line in lines:
            terminalreporter.write_line(str(line))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Where FXPREP_TEST_STATUS names a directory (``.ci/run`` does), each process running tests writes
    the test it starts there (pid, start time, test id), one file per process: CI's heartbeat prints
    them, so a run cut off at its time limit says which tests were running and for how long."""
    status = os.environ.get("FXPREP_TEST_STATUS")
    if status and Path(status).is_dir():
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(status, name).write_text(f"{os.getpid()} {int(time.time())} {item.nodeid}\n")


@pytest.fixture
def seed_save(tmp_path):
    """AIMET's seed model with a reused ReLU, prepared on one image and saved: (directory, the prepared
    module, the input)."""
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    return io.save(gm, tmp_path / "saved"), gm, x


@pytest.fixture
def _restore_process_state(monkeypatch):
    """The CLI quiets torch's logging and Python warnings for its (short-lived) process; undo that
    after each in-process invocation so other test files see the defaults. Requested by the files
    that invoke the CLI in-process (``pytestmark = pytest.mark.usefixtures(...)``, see tests/helpers_cli.py)."""
    import logging
    import warnings

    import torch._logging

    for var in ("TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, os.environ.get(var, "")) if var in os.environ else monkeypatch.delenv(var, raising=False)
    level = logging.getLogger("torch").level
    filters = list(warnings.filters)
    yield
    warnings.filters[:] = filters
    logging.getLogger("torch").setLevel(level)
    torch._logging.set_logs()
