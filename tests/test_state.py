"""The user's model is never changed, on every capture path, and state updates the prepared module
does not reproduce are named in the report (issue 10).

Before the fix: the fx path ran ``self.n += 1`` on the real buffer at trace time (the user's buffer
was 1 afterwards) and dropped the update from the graph without a word; with verification, a
forward doing ``self.steps = self.steps + 1; self.calls += 1`` left a new buffer object and
``calls == 1`` in the user's model although the report said the attributes were restored; and a
prepared module that skipped the original's state updates passed verification silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep
from tests.helpers import assert_unchanged, module_snapshot

torch.set_num_threads(1)


class InplaceCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.lin(x) * 2


class Rebinding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.calls = 0
        self.history: list[int] = []
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        self.calls += 1
        self.history.append(self.calls)
        return self.lin(x)


class RunningAverage(nn.Module):
    """A running average kept by hand: fx records only the part that involves the traced input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.full((3,), 5.0))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg.mul_(0.9).add_(x.mean(0) * 0.1)
        return self.lin(x)


class Untraceable(nn.Module):
    """A data-dependent branch that counts its calls: an opaque part on the fx+leaves path."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.seen += x.shape[0]
        if x.sum() > 0:
            return x * 2
        return x


class WithOpaquePart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.part = Untraceable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(self.lin(x)) + 1


def test_fx_without_example_leaves_the_buffer_alone_and_says_the_update_is_dropped() -> None:
    model = InplaceCounter()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, progress=False)
    assert_unchanged(model, before)
    assert float(model.n) == 0.0
    notes = "\n".join(fxprep.get_report(gm).notes)
    assert "WARNING" in notes and "updated buffer(s) n" in notes, notes


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_rebinding_forward_leaves_the_model_as_it_was_and_is_reported(tracer: str) -> None:
    model = Rebinding()
    steps = model.steps
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 3), tracer=tracer, progress=False)
    assert_unchanged(model, before)
    assert model.steps is steps and float(steps) == 0.0
    assert model.calls == 0 and model.history == []
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed"
    assert report.verification.state_not_reproduced == ["calls", "steps"], report.to_text()
    assert "state NOT reproduced: calls, steps" in report.to_text()
    assert any(n.startswith("WARNING: state not reproduced") for n in report.notes)


def test_fx_running_average_update_outside_the_graph_is_named() -> None:
    model = RunningAverage()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(4, 3), tracer="fx", progress=False)
    assert_unchanged(model, before)
    report = fxprep.get_report(gm)
    assert report.verification.state_not_reproduced == ["avg"], report.to_text()
    assert any("updated buffer(s) avg" in n for n in report.notes), report.notes


def test_dynamo_keeps_inplace_state_updates_in_the_graph() -> None:
    """Dynamo records ``self.n += 1`` and the running average in the graph: nothing to report, the
    user's model untouched by preparing, and the prepared module updates the user's buffers like
    the original does."""
    torch.manual_seed(0)
    model, twin = InplaceCounter(), InplaceCounter()
    avg_model = RunningAverage()
    for m in (model, avg_model):
        before = module_snapshot(m)
        gm = fxprep.prepare_model(m, example_inputs=torch.randn(4, 3), tracer="dynamo", progress=False)
        assert_unchanged(m, before)
        report = fxprep.get_report(gm)
        assert report.tracer == "dynamo"
        assert report.verification.state_not_reproduced == [], report.to_text()
        assert not any("state not reproduced" in n for n in report.notes)
        if m is model:
            twin.load_state_dict(model.state_dict())
            x = torch.randn(4, 3)
            gm(x)
            twin(x)
            assert float(model.n) == float(twin.n) == 1.0


@pytest.mark.parametrize("tracer", ["auto", "fx", "dynamo"])
@pytest.mark.parametrize("cls", [InplaceCounter, Rebinding, RunningAverage, WithOpaquePart])
def test_every_path_leaves_the_model_untouched(tracer: str, cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls()
    before = module_snapshot(model)
    attrs = {n: dict(vars(m)) for n, m in model.named_modules()}
    try:
        fxprep.prepare_model(model, example_inputs=torch.randn(2, 3), tracer=tracer, progress=False)
    except fxprep.FxprepError:
        pass  # refusing is allowed (Dynamo cannot export a rebinding forward); changing the model is not
    assert_unchanged(model, before)
    for name, m in model.named_modules():
        assert all(vars(m).get(k) is v for k, v in attrs[name].items()), name
    if isinstance(model, WithOpaquePart):
        assert model.part.count == 0 and float(model.part.seen) == 0.0


class CountsIntoOutput(nn.Module):
    """The output reads a Python counter its forward updates: the graph bakes in the first value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.calls


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_state_the_next_output_depends_on_is_a_verification_failure(tracer: str) -> None:
    """Before: both runs started from the same state, so verification 'passed' although every
    later call of the prepared module computes ``x * 1`` and the original ``x * n``."""
    model = CountsIntoOutput()
    with pytest.raises(fxprep.EquivalenceError, match=r"second call: .*depends on state its forward updates \(calls\)"):
        fxprep.prepare_model(model, example_inputs=torch.ones(3), tracer=tracer, progress=False)
    assert model.calls == 0  # and the user's counter is untouched


class LazyHooks(nn.Module):
    """Registers a forward hook on a child the first time it runs, and marks itself (as
    transformers 5 does with its output-capturing hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_hooked", False):
            self.inner.register_forward_hook(lambda m, i, o: None)
            self._hooked = True
        return self.inner(x).relu()


def test_hooks_a_forward_registers_are_not_left_behind() -> None:
    """fxprep's runs put the flag back; the hook must go too, or the next call adds a second one."""
    model = LazyHooks().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4), progress=False)
    assert fxprep.get_report(gm).verification.status == "passed"
    assert not model.inner._forward_hooks and "_hooked" not in model.__dict__
    model(torch.randn(2, 4))
    assert len(model.inner._forward_hooks) == 1  # the user's own first call, as without fxprep
