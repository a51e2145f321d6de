"""The concurrency model (docs/security.md, fxprep.core.threads): prepare_model from several threads at
once, on both capture paths, and an unrelated eager model running in another thread meanwhile.

Before the fix, fx's ``Module.__call__`` patch handed the eager thread Proxies while fxprep traced,
fxprep's ``torch.zeros`` wrappers leaked into it, and two Dynamo captures at once failed (or
crashed the process) about half the time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprep

torch.set_num_threads(1)


class _Round(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class Traced(nn.Module):
    """What fxprep patches while tracing, all in one forward: constructors sized from shapes, len,
    an autograd.Function, in-place operators, F.* calls and nested module calls."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 6 * 6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        y = y + torch.zeros(x.shape[0], 8, 6, 6)
        y += 1.0
        y = _Round.apply(y * 4) / 4
        return self.head(y) / len(x)


class Eager(nn.Module):
    """The unrelated model another thread keeps running: it calls every function fxprep patches."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x).mean((2, 3))
        h = h + torch.ones(len(x), 4) + torch.arange(4.0)
        h += 0.5
        return _Round.apply(self.fc(h) * 8) / 8


def _prepare(tracer: str) -> str:
    model = Traced().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 3, 6, 6), tracer=tracer, progress=False)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed", report.to_text()
    return str(report.tracer)


def _run_threads(targets: list[Any]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def wrapped(fn: Any) -> None:
        start.wait()
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - collected and asserted on
            errors.append(err)

    threads = [threading.Thread(target=wrapped, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


def test_two_threads_prepare_at_once_on_both_paths() -> None:
    results: list[tuple[str, str]] = []

    def work(tracer: str) -> None:
        for _ in range(4):
            results.append((tracer, _prepare(tracer)))

    errors = _run_threads([lambda: work("fx"), lambda: work("dynamo"), lambda: work("dynamo"), lambda: work("fx")])
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert len(results) == 16
    assert all(asked == got for asked, got in results), results


def test_eager_model_in_another_thread_is_undisturbed_while_fxprep_traces() -> None:
    torch.manual_seed(0)
    eager = Eager().eval()
    inputs = [torch.randn(2, 3, 5, 5) for _ in range(4)]
    with torch.no_grad():
        expected = [eager(x) for x in inputs]
    done = threading.Event()
    bad: list[str] = []
    prepared: list[str] = []
    runs = 0

    def run_eager() -> None:
        nonlocal runs
        try:
            deadline = time.monotonic() + 120
            # at least 400 calls, and for as long as the preparing threads still work
            while runs < 400 or (len(prepared) < 6 and time.monotonic() < deadline):
                x = inputs[runs % len(inputs)]
                try:
                    with torch.no_grad():
                        out = eager(x)
                    if not torch.equal(out, expected[runs % len(inputs)]):
                        bad.append(f"call {runs}: different output")
                except Exception as err:  # noqa: BLE001 - every failure is recorded
                    bad.append(f"call {runs}: {type(err).__name__}: {err}")
                runs += 1
        finally:
            done.set()

    def keep_preparing(tracer: str) -> None:
        while not done.is_set():
            prepared.append(_prepare(tracer))

    errors = _run_threads([run_eager, lambda: keep_preparing("fx"), lambda: keep_preparing("dynamo")])
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert len(prepared) >= 6, "the preparing threads did not overlap the eager runs"
    assert not bad, f"{len(bad)} of {runs} eager calls went wrong while fxprep traced: {bad[:5]}"


def test_patches_are_gone_and_confined() -> None:
    """After preparing, torch's functions are its own again; during a trace, another thread sees
    torch's own functions (the replacements are confined to the tracing thread)."""
    before = (torch.zeros, torch.autograd.Function.__dict__["apply"], nn.Module.__call__, nn.Module.__getattr__)
    seen: dict[str, Any] = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def look() -> None:
                seen["zeros"] = torch.zeros(1)
                seen["call"] = nn.Linear(1, 1)(torch.ones(1))

            t = threading.Thread(target=look)
            t.start()
            t.join()
            return x + torch.zeros(x.shape[0])

    fxprep.prepare_model(Probe(), tracer="fx", progress=False)
    after = (torch.zeros, torch.autograd.Function.__dict__["apply"], nn.Module.__call__, nn.Module.__getattr__)
    assert after == before
    assert isinstance(seen["zeros"], torch.Tensor) and isinstance(seen["call"], torch.Tensor), seen


def test_quieted_guard_logs_are_this_thread_s_only(caplog: pytest.LogCaptureFixture) -> None:
    # fxprep quiets Dynamo's expected constraint errors while it captures; an unrelated thread's
    # errors on the same logger must still be seen (the logger's level used to be raised instead)
    import logging

    from fxprep.capture.dynamo.export import quiet_guard_logs

    logger = logging.getLogger("torch._guards")
    with caplog.at_level(logging.DEBUG, logger="torch._guards"), quiet_guard_logs():
        logger.error("mine")
        other = threading.Thread(target=lambda: logger.error("theirs"))
        other.start()
        other.join()
        logger.critical("mine, critical")
    logger.error("mine, after")
    assert [r.getMessage() for r in caplog.records] == ["theirs", "mine, critical", "mine, after"]


def test_check_traceability_quiets_draft_export_for_its_own_thread_only(caplog: pytest.LogCaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """check_traceability's draft_export run repeats in a banner what the report says; it is
    quieted for the checking thread only. Before, the whole ``torch`` logger's level was raised for
    the run, so another thread's torch warnings were lost meanwhile."""
    import logging

    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x * 2
            return x[:1] + int(x.abs().sum().item())

    real = torch.export.draft_export
    theirs = logging.getLogger("torch.export._draft_export")

    def draft_export(*args, **kwargs):
        other = threading.Thread(target=lambda: theirs.warning("theirs"))  # while it runs
        other.start()
        other.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "draft_export", draft_export)
    level = logging.getLogger("torch").level
    with caplog.at_level(logging.DEBUG, logger="torch.export._draft_export"):
        report = fxprep.check_traceability(DataDependent(), example_inputs=(torch.randn(3, 4),))
    assert report.issues  # draft_export ran and found the data-dependent sites
    messages = [r.getMessage() for r in caplog.records if r.name == "torch.export._draft_export"]
    assert messages == ["theirs"]  # its banner (a warning on this thread) dropped, the other thread's kept
    assert logging.getLogger("torch").level == level
