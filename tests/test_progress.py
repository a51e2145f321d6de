"""Progress on long work: the stages of prepare_model as log records, lines or nothing, as asked."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap

import torch
from torch import nn

import fxprep
from fxprep.reporting import progress


@dataclasses.dataclass
class Pair:
    y: torch.Tensor
    z: torch.Tensor


class DataclassOut(nn.Module):
    """Dynamo's export refuses a dataclass output; fx takes it: a prepare with a fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Pair:
        y = self.lin(x)
        return Pair(y, y * 2)


class Branchy(nn.Module):
    """No tracer takes the data-dependent branch in ``gate``: it becomes an opaque part."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.gate(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def _events(caplog) -> list[tuple[str, str]]:
    return [(r.fxprep_event, r.getMessage()) for r in caplog.records if r.name == "fxprep"]


def test_stages_in_order_for_a_prepare_with_a_fallback(caplog):
    caplog.set_level(logging.INFO, logger="fxprep")
    gm = fxprep.prepare_model(DataclassOut().eval(), example_inputs=torch.randn(2, 4), name="pair")
    assert gm.fxprep_report.tracer == "fx"
    events = _events(caplog)
    assert [m for e, m in events if e == "stage"] == [
        "pair: reference run", "pair: capture 1/2: dynamo", "pair: capture 2/2: fx", "pair: passes", "pair: verification",
    ]
    assert events[-1][0] == "done" and events[-1][1].startswith("pair: done in ")
    assert all(r.fxprep_model == "pair" for r in caplog.records if r.name == "fxprep")


def test_steps_inside_a_long_capture(caplog):
    """The opaque-leaf fallback reports each part it makes opaque, extra verifications are reported."""
    caplog.set_level(logging.INFO, logger="fxprep")
    fxprep.prepare_model(Branchy().eval(), example_inputs=torch.ones(2, 4), verify_inputs=[-torch.ones(2, 4)])
    messages = [m for _, m in _events(caplog)]
    opaque = next(i for i, m in enumerate(messages) if "gate made opaque" in m)
    hybrid = messages.index("Branchy: capture: Dynamo with the untraceable parts opaque")
    assert hybrid < opaque < messages.index("Branchy: passes")
    assert "Branchy: verification: verify_inputs[0]" in messages


def test_failure_is_the_last_event(caplog):
    caplog.set_level(logging.INFO, logger="fxprep")
    try:
        fxprep.prepare_model(DataclassOut().eval(), example_inputs=torch.randn(2, 5))
    except fxprep.ModelError:
        pass
    events = _events(caplog)
    assert events[-1][0] == "done" and "failed (ModelError)" in events[-1][1]


def test_progress_false_is_silent(caplog, capsys):
    caplog.set_level(logging.DEBUG, logger="fxprep")
    fxprep.prepare_model(DataclassOut().eval(), example_inputs=torch.randn(2, 4), progress=False)
    assert _events(caplog) == []
    assert capsys.readouterr().err == ""


def test_non_interactive_runs_print_nothing_unless_asked(capsys):
    """Under pytest standard error is not a terminal: nothing by default, plain lines with True."""
    assert not progress.interactive()
    fxprep.prepare_model(DataclassOut().eval(), example_inputs=torch.randn(2, 4))
    assert capsys.readouterr().err == ""
    fxprep.prepare_model(DataclassOut().eval(), example_inputs=torch.randn(2, 4), progress=True, name="pair")
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["fxprep: pair: reference run", "fxprep: pair: capture 1/2: dynamo", "fxprep: pair: capture 2/2: fx"]
    assert lines[-1].startswith("fxprep: pair: done in ")
    assert logging.getLogger("fxprep").handlers == []  # the temporary handler is gone


def test_bad_progress_value():
    try:
        fxprep.prepare_model(DataclassOut().eval(), progress="loud")
    except fxprep.InvalidInput as err:
        assert "progress must be one of None, True, False" in str(err)
    else:
        raise AssertionError("progress='loud' was accepted")


def test_terminal_display_in_a_pseudo_terminal(tmp_path):
    """On a terminal the rich display runs (a pty stands in for one) and leaves no log lines."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import os, pty, sys
        def child():
            import torch, fxprep
            from fxprep.reporting import progress
            assert progress.interactive()
            gm = fxprep.prepare_model(torch.nn.Sequential(torch.nn.Linear(2, 2)).eval(),
                                      example_inputs=torch.randn(1, 2), name="seq")
            print("OK", gm.fxprep_report.verification.status)
        pid, fd = pty.fork()
        if pid == 0:
            os.environ["TERM"] = "xterm"
            child()
            os._exit(0)
        out = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        os.waitpid(pid, 0)
        sys.stdout.write(out.decode(errors="replace"))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "OK passed" in proc.stdout, proc.stdout + proc.stderr
    assert "seq: capture 1/2: dynamo" in proc.stdout  # the display (spinner, stage, time)...
    assert "fxprep: seq:" not in proc.stdout  # ...not plain lines
