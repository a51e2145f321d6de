"""What one Dynamo capture learns about a model is not learned again by every later capture of the
same ``prepare_model`` call (issue 60: Llava-NeXT's default prepare traced the whole model 32 times,
16 of them failing on the same two things before each retry)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import fxprep

from .helpers import DynamoTrace, dynamo_traces


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Head(nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a value read from data: this part is called without tracing into it
            return x * scale
        return x - scale


def _defaults(self: nn.Module, x: torch.Tensor, scale: float = 1.0, **kwargs: Any) -> None:
    """The signature transformers' ``select_hidden_states`` binds the call's arguments to."""


_SIGNATURE = inspect.signature(_defaults)  # made outside the trace, as the decorator makes its own


class _MutatesKwargs(nn.Module):
    """Writes a default into the ``**kwargs`` it is called with (transformers'
    ``merge_with_config_defaults``), then binds them to a signature (a ``mappingproxy`` read), around
    three repeated blocks and a part Dynamo cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = _Head()

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("scale", 2.0)
        bound = _SIGNATURE.bind(self, x, **kwargs)
        bound.apply_defaults()
        for block in self.blocks:
            x = block(x)
        return self.head(x, bound.arguments["scale"])


def _ended(traces: list[DynamoTrace]) -> list[tuple[str, str]]:
    """``(traced module's class, how it ended)`` of each trace."""
    return [(t.module, t.outcome) for t in traces]


@pytest.mark.parametrize("reuse", [True, False])
def test_a_capture_starts_from_what_an_earlier_one_learned(monkeypatch: pytest.MonkeyPatch, reuse: bool) -> None:
    torch.manual_seed(0)
    model = _MutatesKwargs().eval()
    traces = dynamo_traces(monkeypatch)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4, 8),), reuse_blocks=reuse, progress=False)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo+leaves"
    for x in (torch.randn(2, 4, 8), -torch.rand(3, 4, 8)):  # both sides of the head's branch
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    outer = [end for name, end in _ended(traces) if name != "_Block"]
    # the fresh-kwargs root is learned once, by the first capture, for every later one
    assert sum("mapping proxy affected by dictionary mutation" in end for end in outer) == 1, traces
    # before the capture that is kept, the head's branch stops the model's capture once: with reuse,
    # the outer capture's failure around the blocks is the capture's (the whole model would fail the
    # same way), not traced again whole
    before = outer[:outer.index("ok")]
    assert sum("Data-dependent branching" in end for end in before) == 1, traces


def test_a_variant_for_another_model_learns_on_its_own() -> None:
    from fxprep.capture.request import CaptureRequest

    request = CaptureRequest(_MutatesKwargs())
    request.learned.fresh_kwargs = True
    assert request.replace(dynamic=False).learned is request.learned
    other = request.replace(model=_MutatesKwargs())
    assert other.learned is not request.learned and not other.learned.fresh_kwargs


class _ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        k = int(lengths[0].item())
        if k > 1:  # a Python bool of a value read from data: no plain Dynamo trace gets past it
            return torch.cat([self.lin(x[:, :k]), x[:, k:]], 1)
        return self.lin(x)


class _BlocksReadingData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ReadsData() for _ in range(3)])

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, lengths)
        return x


def test_the_batch_probe_makes_no_plain_trace_where_the_capture_could_not(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _BlocksReadingData().eval()
    traces = dynamo_traces(monkeypatch)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8), torch.tensor([2, 4])), dynamic=False,
                              progress=False)
    report = fxprep.get_report(gm)
    assert report.tracer in ("dynamo+leaves", "dynamo+values")
    outer = [end for name, end in _ended(traces) if name == "_BlocksReadingData"]
    # the batch probe's trace with a symbolic batch (the model as it is, no part opaque, no value
    # decided) would stop where the capture did: it is not made, and the report says why
    assert all(end == "ok" for end in outer[outer.index("ok"):]), traces
    assert any("as the capture itself could not" in note for note in report.notes), report.notes
    x, lengths = torch.randn(3, 6, 8), torch.tensor([2, 4])
    torch.testing.assert_close(gm(x, lengths), model(x, lengths), rtol=0, atol=0)


def test_a_block_output_that_had_to_be_computed_is_computed_from_the_start_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPM-Ant's shape-general capture makes two captures with block reuse (a per-step loop opaque,
    and without it); in the first, the stand-in's guessed block output does not hold and the model is
    traced again with it computed. The second capture computes it from the start."""
    import transformers

    from fxprep.cli.tiny import tiny_config

    config = tiny_config("cpmant")
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    traces = dynamo_traces(monkeypatch)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(3, 99, (1, 8))}, progress=False)
    names = [name for name, end in _ended(traces)]
    retraced = sum(1 for before, after in zip(names, names[1:]) if before == "CpmAntTransformerBlock"
                   and after == "CpmAntForCausalLM")
    assert retraced == 1, traces
    ids = torch.randint(3, 99, (2, 11))
    torch.testing.assert_close(gm(input_ids=ids)[0], model(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)
