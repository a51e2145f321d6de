"""A per-step loop kept out of the graph so that the length it loops over stays dynamic
(``fxprep.capture.dynamo.scans``): state-space and linear-attention layers run their scan as a
Python loop when the compiled kernel is absent, and Dynamo unrolls it for the example's length.

The toy models loop as transformers' torch fallbacks do (a free function behind a
``functools.wraps`` wrapper, as ``use_kernel_func_from_hub_with_fallback`` binds it; a helper
method), then the real ones: Mamba (one step per token) and Kimi-Linear (one step per 64-token chunk).
"""

from __future__ import annotations

from typing import Any

import pytest
import sympy
import torch
from torch import nn
from torch.utils._sympy.functions import FloorDiv, Mod

import fxprep
from fxprep.capture.dynamo.guard_log import AddedGuard
from fxprep.capture.dynamo.scans import failing_size, hidden_inside
from fxprep.capture.sites import Site
from fxprep.cli import specs
from fxprep.core.inputs import ExampleInputs

from .helpers_models import Recurrent, chunked_scan, selective_scan


def scan_through(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A loop that calls a layer at each step: opaque, it would hide that layer from a quantizer."""
    state = torch.zeros_like(x[:, 0])
    out = []
    for t in range(x.shape[1]):
        state = layer(state) + x[:, t]
        out.append(state)
    return torch.stack(out, dim=1)


class Scanned(nn.Module):
    def __init__(self, through_layer: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.decay = nn.Parameter(torch.linspace(-1, 1, 8))
        self.through_layer = through_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = scan_through(h, self.mix) if self.through_layer else selective_scan(h, self.decay)
        return self.out(h)


class Stack(nn.Module):
    def __init__(self, reads_weight: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([Recurrent(reads_weight) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _same_at(gm: nn.Module, model: nn.Module, lengths: tuple[int, ...]) -> None:
    for n in lengths:
        x = torch.randn(2, n, 8)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_a_loop_in_a_function_is_kept_opaque_and_the_length_stays_free() -> None:
    torch.manual_seed(0)
    model = Scanned().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {1: "seq"}})
    report = fxprep.get_report(gm)
    text = report.to_text()
    assert report.leaves.get("selective_scan", "").startswith("opaque: a loop over 'seq'"), report.leaves
    assert "selective_scan runs eagerly, as one opaque call, so that 'seq' stays dynamic" in text, text
    assert "seq == 6" in text  # the guard the loop made, as the report quotes it
    modules = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert {"inp", "out"} <= modules  # the layers around the loop stay modules
    assert list(gm.state_dict()) == list(model.state_dict())
    opaque = [gm.get_submodule(t) for t in modules if "selective_scan" in t]
    assert len(opaque) == 1 and opaque[0].fn is selective_scan  # the wrapper the module binds, as it calls it
    _same_at(gm, model, (2, 7, 31, 100))


def test_a_loop_calling_a_layer_is_not_kept_opaque_for_the_length() -> None:
    torch.manual_seed(0)
    model = Scanned(through_layer=True).eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {1: "seq"}})
    report = fxprep.get_report(gm)
    # not as a scan: the opaque-part fallback for the dimensions the user declared may still take it
    assert not any(v.startswith("opaque: a loop over") for v in report.leaves.values()), report.leaves
    assert "runs eagerly, as one opaque call, so that" not in report.to_text()
    _same_at(gm, model, (6,))


def test_a_helper_method_is_kept_opaque_in_every_instance() -> None:
    torch.manual_seed(0)
    model = Stack().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {1: "seq"}})
    leaves = fxprep.get_report(gm).leaves
    assert {"layers.0._scan", "layers.1._scan"} <= set(leaves), leaves
    assert {"layers.0.gate", "layers.1.gate"} <= {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    _same_at(gm, model, (2, 9, 40))


def test_a_helper_method_reading_its_modules_weight_is_not_kept_opaque() -> None:
    torch.manual_seed(0)
    model = Stack(reads_weight=True).eval()
    call = ExampleInputs((torch.randn(2, 6, 8),), {})
    assert hidden_inside(model, call, Site("layers.0", "_scan")) == ["parameter layers.0.decay"]
    assert hidden_inside(Stack().eval(), call, Site("layers.0", "_scan")) == []  # its gate comes as an argument
    gm = fxprep.prepare_model(model, example_inputs=call.args, dynamic={"x": {1: "seq"}})
    assert not any(v.startswith("opaque: a loop over") for v in fxprep.get_report(gm).leaves.values())
    _same_at(gm, model, (6,))


def _guard(expr: Any, symbol: Any, **others: int) -> AddedGuard:
    named = {symbol: ("L['x'].size()[1]",), **{sympy.Symbol(k, integer=True): ("L['y'].size()[0]",) for k in others}}
    hints = {sympy.Symbol(k, integer=True): v for k, v in others.items()}
    return AddedGuard(expr, named, hints, ())


def test_the_size_where_a_guard_fails_is_found_above_the_example() -> None:
    s = sympy.Symbol("s0", integer=True, positive=True)
    padded = s + Mod(64 - Mod(s, 64), 64)
    assert failing_size(_guard(sympy.Eq(s, 8), s), {s}, 8) == 9  # one step per token
    assert failing_size(_guard(sympy.Eq(FloorDiv(padded, 64), 1), s), {s}, 8) == 65  # one 64-token chunk
    assert failing_size(_guard(s >= 2, s), {s}, 8) is None  # holds at every size
    b = sympy.Symbol("b", integer=True)
    assert failing_size(_guard(s * b <= 64, s, b=4), {s}, 8) == 17  # the other symbol at its example value
    # two inputs' lengths, one declared dimension (Dim.AUTO gives each its own symbol): they vary together
    t = sympy.Symbol("s1", integer=True, positive=True)
    assert failing_size(AddedGuard(sympy.Eq(s, t), {s: ("a",), t: ("b",)}, {s: 8, t: 8}, ()), {s, t}, 8) is None
    unbacked = sympy.Symbol("u0", integer=True)
    assert failing_size(AddedGuard(sympy.Eq(s, unbacked), {s: ("x",), unbacked: ()}, {}, ()), {s}, 8) is None


def _mask_below(x: torch.Tensor, window: int = 8) -> torch.Tensor | None:
    if x.shape[1] < window:  # BRANCH
        return None
    return torch.ones(x.shape[1], x.shape[1]).tril(-window)


def test_a_guard_made_by_a_branch_is_told_from_one_made_by_a_loop() -> None:
    # a function that decides on the length (the sliding-window mask) is not kept opaque as a scan: the
    # graph would hold what it returned at the example's size (None) at every size
    import inspect

    from fxprep.capture.dynamo.scans import on_branch

    lines, first = inspect.getsourcelines(_mask_below)
    branch = first + next(i for i, code in enumerate(lines) if "BRANCH" in code)
    lines, first = inspect.getsourcelines(selective_scan)
    loop = first + next(i for i, code in enumerate(lines) if "for t in range" in code)
    scan_file = inspect.getsourcefile(inspect.unwrap(selective_scan))  # tests/helpers_models.py
    assert on_branch(__file__, branch) and not on_branch(scan_file, loop) and not on_branch(__file__, branch + 2)


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(chunked_scan(self.inp(x)))


def test_a_scan_that_branches_on_the_length_and_returns_a_tensor_is_kept_opaque() -> None:
    torch.manual_seed(0)
    model = Chunked().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 3, 8),), dynamic={"x": {1: "seq"}})
    leaves = fxprep.get_report(gm).leaves
    assert leaves.get("chunked_scan", "").startswith("opaque: a loop over 'seq'"), leaves
    _same_at(gm, model, (2, 4, 5, 9, 40))


def _ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 90, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_takes_any_length(dtype: torch.dtype) -> None:
    from transformers.models.mamba import modeling_mamba

    built = specs.resolve("transformers:mamba")
    model = built.model.to(dtype).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    report = fxprep.get_report(gm)
    if not hasattr(modeling_mamba, "mamba_selective_scan"):
        # transformers before the hub-kernel fallbacks (5.0) writes the loop inline in the mixer's
        # forward, which uses the layer's weights: not a scan to keep opaque; the length stays, and why
        assert "input_ids dim 1 stays at the example's size: the model's code specialises 'seq' to 8" in report.to_text()
        assert not any(v.startswith("opaque: a loop over") for v in report.leaves.values())
        return
    assert "dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}}" in report.notes
    assert any(k.endswith("mamba_selective_scan") for k in report.leaves), report.leaves
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert {"layers.0.mixer.in_proj", "layers.1.mixer.x_proj", "layers.1.mixer.out_proj"} <= called
    assert {"layers.0.mixer.mamba_selective_scan", "layers.1.mixer.mamba_selective_scan"} <= called  # named per caller
    for batch, seq in ((3, 13), (2, 40)):
        ids = _ids(batch, seq, seq)
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).last_hidden_state
            torch.testing.assert_close(gm(input_ids=ids)["last_hidden_state"], expected, rtol=0, atol=0)


def test_a_chunked_scan_takes_lengths_past_one_chunk() -> None:
    built = specs.resolve("transformers:kimi_linear")  # transformers 5.24 (not in 5.0, the oldest supported)
    model = built.model.eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    assert "chunk_kimi_delta_attention runs eagerly" in text, text
    assert "also checked at seq 65" in text and "'seq' is dynamic" not in text  # no limit left
    for seq in (70, 130):
        ids = _ids(2, seq, seq)
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False)[0]
            torch.testing.assert_close(gm(input_ids=ids)["last_hidden_state"], expected)
