"""The shape-general capture's first try, read from its guards (fxprep.capture.dynamo.guard_read).

The first try declares the found dimensions maybe-dynamic and keeps the capture only where every
guard Dynamo recorded holds at every size it evaluates; anything else is captured again with the
dimensions declared. Tested on tiny transformers-style models (the dimensions are found from the
input names of a ``PreTrainedModel``), counting Dynamo's whole-model traces, and on the evaluation
itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import sympy
import torch
import transformers

import fxprep
from fxprep.capture.dynamo import guard_read

from .helpers import dynamo_traces
from .helpers_models import chunked_scan


class _Tiny(transformers.PreTrainedModel):
    """The smallest model whose inputs fxprep reads as a transformers layout (batch, then tokens)."""

    config_class = transformers.PretrainedConfig

    def __init__(self) -> None:
        super().__init__(transformers.PretrainedConfig())
        self.emb = torch.nn.Embedding(50, 8)
        self.lin = torch.nn.Linear(8, 8)


class _TakesAtMost(_Tiny):
    # DeepSeek's sparse-attention indexer keeps min(2048, seq) tokens: the guard `Min(2048, seq) <= seq`
    # holds at every size, and export's solver cannot prove it over a range
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        k = min(2048, h.shape[1])
        return h[:, :k].softmax(-1)


class _BranchesOnLength(_Tiny):
    # a guard that holds at the example's 8 tokens and not at 7 or 14
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        if h.shape[1] % 7 == 0:
            return h * 2
        return h + 1


class _PositionTable(_Tiny):
    # BERT's learned positions: ids[:, :seq] has 64 at most, so adding it needs `seq <= 64`
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(64, 8)
        self.register_buffer("ids", torch.arange(64)[None], persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(input_ids) + self.pos(self.ids[:, :input_ids.shape[1]]))


class _Windowed(_Tiny):
    # Mistral's sliding window: the mask is built one way below 4096 tokens and another from there on
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        if h.shape[1] >= 4096:
            return h * 2
        return h + 1


class _WindowThenChunks(_Tiny):
    # Lara-mini: a sliding window bounds the length (`seq < 512`), then a chunked scan's loop specialises it
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        if h.shape[1] >= 512:
            h = h * 2
        return chunked_scan(h)


class _MaskedChunks(_Tiny):
    # the mask's last `seq` columns: a guard relating the two inputs' lengths (each has its own symbol under
    # Dim.AUTO), then a chunked scan
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        return chunked_scan(h * attention_mask[:, -input_ids.shape[1]:, None])


class _RelativeTable(_Tiny):
    # ProphetNet's relative-position buckets: a table of 64 sliced to the length in a helper method, where
    # no loop or branch makes the `seq <= 64` guard, so keeping the method opaque lifts no limit
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rel", torch.randn(64, 64), persistent=False)

    def _relative(self, length: int) -> torch.Tensor:
        return self.rel[:length, :length]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        bias = self._relative(input_ids.shape[1])
        return torch.softmax(h @ h.transpose(1, 2) + bias, -1) @ h


class _TwoStreamsLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, streams: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        main, other = self.lin(streams).chunk(2, dim=1)
        return torch.cat([main * mask[..., None], other], dim=1)


class _TwoStreams(_Tiny):
    # ProphetNet's main and predicted streams side by side: each layer is given the length twice over
    # (`2*seq`) with a mask of the length, and the guards its own capture puts on both relate them
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_TwoStreamsLayer() for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        mask = (input_ids > 3).to(h.dtype)
        streams = torch.cat([h, h.flip(1)], dim=1)
        for layer in self.layers:
            streams = layer(streams, mask)
        return self.lin(streams)


def _exact_at(gm: Any, model: torch.nn.Module, *shapes: tuple[int, int]) -> None:
    """``gm`` computes exactly what ``model`` does on random ids of each ``(batch, seq)``."""
    for batch, seq in shapes:
        ids = torch.randint(0, 50, (batch, seq))
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids), model(ids), rtol=0, atol=0)


def _prepare_counting(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    """``model`` prepared on 1x8 ids, and how many times Dynamo traced it."""
    traces = dynamo_traces(monkeypatch)
    torch.manual_seed(0)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 50, (1, 8))})
    return gm, len(traces)


def test_guards_that_hold_at_every_size_keep_the_first_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _TakesAtMost().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces == 1, traces  # before the first try: a capture for the violation, one with a range, a third
    text = fxprep.get_report(gm).to_text()
    assert "input_ids dim 1 (seq)" in text and "so calls at any size of them are accepted" in text, text
    _exact_at(gm, model, (2, 5), (3, 14), (1, 3000))


def test_a_guard_that_fails_at_some_size_is_captured_again_and_the_length_stays_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _BranchesOnLength().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces >= 2, traces  # the first try was not kept: its guard fails at 7 tokens
    assert "the model's code specialises 'seq' to 8" in fxprep.get_report(gm).to_text()
    _exact_at(gm, model, (3, 8))  # the batch stays free, the length is the example's
    for seq in (7, 14):  # where the graph would compute h + 1 and the model h * 2
        with pytest.raises(fxprep.InputMismatch, match="specialises 'seq' to 8"):
            gm(input_ids=torch.randint(0, 50, (1, seq)))


def _guard(expr: Any) -> tuple[Any, dict[str, Any]]:
    return expr, {str(s): s for s in expr.free_symbols}


def test_the_sizes_tried_reach_each_constant_and_its_fractions() -> None:
    seq = sympy.Symbol("seq", integer=True, positive=True)
    expr, syms = _guard(sympy.Ne(2 * seq, 2000))
    sizes = {at["seq"] for at in guard_read._sizes(expr, syms, {"seq": 8})}
    assert 1000 in sizes  # 2*seq != 2000 fails at 1000 only
    assert {2, 3, 66, 2**24, 2**24 + 1} <= sizes
    assert not guard_read._holds(expr, syms, {"seq": 1000}) and guard_read._holds(expr, syms, {"seq": 999})


def test_two_dimensions_are_tried_together() -> None:
    batch, seq = sympy.symbols("batch seq", integer=True, positive=True)
    expr, syms = _guard(sympy.Ne(batch * seq, 4097 * 13))
    tried = guard_read._sizes(expr, syms, {"batch": 2, "seq": 8})
    assert {"batch": 13, "seq": 4097} in tried
    assert any(guard_read._holds(expr, syms, at) is False for at in tried)


def test_an_expression_that_is_not_a_truth_value_is_not_taken_for_one() -> None:
    seq = sympy.Symbol("seq", integer=True, positive=True)
    expr, syms = _guard(seq + 1)
    assert guard_read._holds(expr, syms, {"seq": 4}) is None
    held, syms = _guard(sympy.Le(sympy.Min(2048, seq), seq))
    assert all(guard_read._holds(held, syms, at) is True for at in guard_read._sizes(held, syms, {"seq": 8}))


def test_a_bound_a_stopped_first_try_finds_costs_no_capture_refused_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first try stops at `seq <= 64` (a scan search there finds none) and runs on to its end, still
    # maybe-dynamic: its guards fail only past 64, so it is kept within that range, and the branches are read
    # off its guards (before: a capture refused by export to suggest the range, one with it and a branch
    # trace for the limits, 4; at the last stop the range read off the stopping guard, 3)
    model = _PositionTable().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces == 2, traces  # the stopped first try, the same try to its end
    text = fxprep.get_report(gm).to_text()
    assert "Dynamo bounded 'seq' to <= 64 while capturing (its guard: input_ids.shape[1] <= 64)" in text, text
    _exact_at(gm, model, (2, 5), (3, 64))


def test_a_first_try_run_on_past_a_bound_stops_at_a_scan_behind_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first try stops at the window's bound, runs on past it and stops again at the chunk loop's guard,
    # where the scan search finds the scan: the try with it opaque holds within the window and is kept, its
    # branches read off its guards (before: the run-on try traced the loop unrolled to its end, then a strict
    # capture with the scan, one with the range and a branch trace: 7)
    model = _WindowThenChunks().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces == 3, traces  # stopped at the bound, stopped at the loop, the try with the scan opaque
    report = fxprep.get_report(gm)
    assert report.leaves.get("chunked_scan", "").startswith("opaque: a loop over 'seq'"), report.leaves
    assert "'seq' is dynamic <= 511: the model's code branches on it" in report.to_text(), report.to_text()
    _exact_at(gm, model, (2, 5), (1, 13), (3, 511))
    with pytest.raises(fxprep.InputMismatch):
        gm(input_ids=torch.randint(0, 50, (1, 512)))


def test_a_guard_relating_two_inputs_lengths_does_not_stop_the_first_try(monkeypatch: pytest.MonkeyPatch) -> None:
    # `input_ids` and `attention_mask` share 'seq' but each has its own symbol in the capture: the stop
    # evaluates a guard relating them with both at each size, as the guard reading does, so the first try
    # stops at the scan's loop, not at the slice (before: 3 traces, the second a strict capture refused)
    model = _MaskedChunks().eval()
    traces = dynamo_traces(monkeypatch)
    torch.manual_seed(0)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 50, (1, 8)),
                                                     "attention_mask": torch.ones(1, 8, dtype=torch.long)})
    assert len(traces) == 2, traces  # stopped at the loop, the try with the scan opaque
    assert list(fxprep.get_report(gm).leaves) == ["chunked_scan"]
    for batch, seq in ((2, 5), (1, 13)):
        ids, mask = torch.randint(0, 50, (batch, seq)), torch.randint(0, 2, (batch, seq))
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids, attention_mask=mask), model(ids, mask), rtol=0, atol=0)


def _log(*guards: tuple[Any, dict[Any, tuple[str, ...]]]) -> Any:
    from fxprep.capture.dynamo.guard_log import AddedGuard, GuardLog

    return GuardLog([AddedGuard(expr, sources, {}, ()) for expr, sources in guards])


def test_a_guard_naming_no_declared_dimension_is_not_read() -> None:
    # the strict capture checks only the declared dimensions: a guard on a value read from data (Qwen2-VL's
    # `u1 >= 0` on the values route) or on a block's size no declared one follows (its vision blocks' patch
    # count, `Eq(s60, 40)`) is kept there too; one mixing such a size with a declared one is not known to hold
    from fxprep.capture.shapes import autodims
    from fxprep.core.inputs import ExampleInputs

    model = _TakesAtMost().eval()
    call = ExampleInputs((), {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    proposal = autodims.Proposal({"input_ids": {1: "seq"}}, call)
    s0, s60 = sympy.symbols("s0 s60", integer=True, positive=True)
    u1 = sympy.Symbol("u1", integer=True)
    seq = {s0: ("L['input_ids'].size()[1]",)}
    patches = {s60: ("block:L['args'][0].size()[0]",)}
    assert guard_read.limiting(_log((u1 >= 0, {u1: ()})), proposal, model, call) is None
    assert guard_read.limiting(_log((sympy.Eq(s60, 40), patches)), proposal, model, call) is None
    assert guard_read.limiting(_log((s0 <= 2**40, seq), (u1 >= 0, {u1: ()})), proposal, model, call) is None
    mixed = guard_read.limiting(_log((sympy.Eq(s0, s60), {**seq, **patches})), proposal, model, call)
    assert mixed is not None and "not one declared dimension" in mixed
    bounded = guard_read.limiting(_log((s0 <= 64, seq)), proposal, model, call)
    assert bounded is not None and "does not hold at seq=65" in bounded


def test_a_branch_bounding_the_length_is_declared_and_read_off_the_first_try(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first try runs to its end and its guard `seq < 4096` fails at 4096 alone: that try is kept, its
    # graph holding where its guards do, with the range as a limit, and the branch that sets it is read off
    # its guards (Dynamo's own code made it, not a kernel's); before: a capture refused for the range, one
    # with it, and a whole-model trace for the branches (4), then the capture with the range declared (2)
    model = _Windowed().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces == 1, traces
    text = fxprep.get_report(gm).to_text()
    assert "'seq' is dynamic <= 4095: the model's code branches on it" in text and "h.shape[1] >= 4096" in text, text
    _exact_at(gm, model, (2, 4095))
    with pytest.raises(fxprep.InputMismatch):  # where the graph would compute h + 1 and the model h * 2
        gm(input_ids=torch.randint(0, 50, (1, 4096)))


def test_a_bound_no_loop_or_branch_made_is_no_scan_and_the_first_try_is_kept_within_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the first try stops at `seq <= 64` in the helper method; the scan search does not take it (the slice
    # of a fixed table, in no loop), so the try runs on past the bound and is kept (before: the method kept
    # opaque held at every size, the check at 65 found the original itself failing, and the prepare fell
    # back to static shapes after 4 traces)
    model = _RelativeTable().eval()
    gm, traces = _prepare_counting(model, monkeypatch)
    assert traces == 2, traces  # the stopped first try, the same try to its end
    report = fxprep.get_report(gm)
    assert not report.leaves, report.leaves
    assert "Dynamo bounded 'seq' to <= 63" in report.to_text(), report.to_text()
    _exact_at(gm, model, (2, 5), (3, 63))


def test_a_layers_guards_on_a_size_made_of_the_length_are_read_as_the_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    # each reused layer's own capture names its input's `2*seq` with a symbol of its own: written as 2*seq in
    # its guards, the relation to the mask's length holds at every size and the first try is kept (before:
    # a guard on a size that is no declared dimension sent it back, and strict captures followed)
    model = _TwoStreams().eval()
    traces = dynamo_traces(monkeypatch)
    torch.manual_seed(0)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 50, (1, 8))})
    report = fxprep.get_report(gm)
    assert report.reuse["captured"] == {"layers.0": ["layers.1"]}, report.reuse
    # the first try alone (under reuse: the outer capture, the layer's, the outer again with the layer's
    # output computed); before, 7: four more for a strict capture, its range and the capture with it
    assert len(traces) == 3 and "_TwoStreamsLayer" in {t.module for t in traces}, traces
    assert "so calls at any size of them are accepted" in report.to_text(), report.to_text()
    _exact_at(gm, model, (2, 5), (3, 14))
