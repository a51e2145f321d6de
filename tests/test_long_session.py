"""Long sessions: the hundredth capture in a process is the same as the first.

Before the fix, every Dynamo capture of a model whose ``forward`` is torch's own (an
``nn.Sequential`` root) left a cache entry on Dynamo's shared wrapper frame; after eight of them
Dynamo's recompile limit refused any further capture, ``tracer="auto"`` silently fell back to fx,
and even ``tracer="dynamo"`` returned the fx-based hybrid result.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep

torch.set_num_threads(1)


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * x.shape[-1]


@pytest.mark.parametrize("tracer", ["dynamo", "auto"])
def test_twenty_sequential_models_in_a_row_all_use_dynamo(tracer: str) -> None:
    for i in range(20):
        gm = fxprep.prepare_model(_sequential(), example_inputs=torch.randn(3, 4), tracer=tracer, progress=False)
        report = fxprep.get_report(gm)
        assert report.tracer == "dynamo", (i, report.to_text())
        assert [a.tracer for a in report.attempts] == ["dynamo"], (i, report.to_text())
        assert report.verification.status == "passed"


def test_many_instances_of_one_user_class_all_use_dynamo() -> None:
    for i in range(12):
        gm = fxprep.prepare_model(Block().eval(), example_inputs=torch.randn(2, 4), tracer="dynamo", progress=False)
        assert fxprep.get_report(gm).tracer == "dynamo", i


def test_users_own_compiled_sequentials_do_not_stop_fxprep() -> None:
    """The user's torch.compile calls fill Dynamo's shared frame up to its limit; fxprep's capture
    still runs (its call lifts the limit) and the user's compiled entries are left in place."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.external_utils import wrap_inline

    shared = wrap_inline(lambda: None).__code__
    for _ in range(10):
        compiled = torch.compile(_sequential(), backend="eager")
        compiled(torch.randn(3, 4))
    before = len(_debug_get_cache_entry_list(shared))
    for _ in range(3):
        gm = fxprep.prepare_model(_sequential(), example_inputs=torch.randn(3, 4), tracer="dynamo", progress=False)
        assert fxprep.get_report(gm).tracer == "dynamo"
    assert len(_debug_get_cache_entry_list(shared)) >= before
    torch._dynamo.reset()


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Dynamo's export cannot capture this whole
            return self.fc(x)
        return -x


def test_forced_dynamo_never_returns_another_tracers_result() -> None:
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(DataDependent(), example_inputs=torch.ones(2, 4), tracer="dynamo", progress=False)
    tracers = [a.tracer for a in info.value.attempts]
    # Dynamo whole, then Dynamo with the failing part opaque (the root here: it cannot be); never fx
    assert tracers[0] == "dynamo" and all(t.startswith("dynamo") for t in tracers), tracers
