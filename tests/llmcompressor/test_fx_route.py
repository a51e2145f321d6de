"""The code around the sequential targets traced by torch.fx first (llm-compressor's own granularity
and cost), with ``tracing_ignore``'s functions and transformers' mask builders called whole, checked
as the Dynamo graph is, and Dynamo's capture where fx fails (issue 58's cost)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.utils.match import match_named_modules
from llmcompressor.args import DatasetArguments
from llmcompressor.utils.pytorch.module import infer_sequential_targets
from torch import nn

import fxprep.compat.llmcompressor as fxlc
from fxprep.compat.llmcompressor.reproduce import compare_subgraphs

from .lc_models import calibration, causal_lm

IGNORE = DatasetArguments().tracing_ignore


def _batch(vocab: int, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# llama, gemma3_text (sliding and full layers), and the five whose layers llm-compressor's tracer hands no mask
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "mistral", "phi3", "mixtral", "qwen3_moe", "starcoder2"])
def test_text_types_are_traced_by_fx_and_reproduce_the_model(model_type):
    model = causal_lm(model_type, num_hidden_layers=2)
    sample = _batch(model.config.vocab_size)
    subgraphs = fxlc.fxprep_subgraphs(model, sample, infer_sequential_targets(model, None), IGNORE, 1)
    capture = fxlc.last_capture()
    assert capture.report.tracer == "fx", capture.report.notes
    assert capture.report.verification.status == "passed"
    masks = [n for n in capture.gm.graph.nodes if n.op == "call_function" and "mask" in getattr(n.target, "__name__", "")]
    assert masks  # the mask builder is one call, run as eager runs it
    layers = list(match_named_modules(model, infer_sequential_targets(model, None)))
    with calibration(model):
        found = compare_subgraphs(model, subgraphs, sample, layers)
        other = compare_subgraphs(model, subgraphs, _batch(model.config.vocab_size, length=7, seed=1), layers)
    assert found.equal and found.calls == 2, str(found)
    assert other.equal and other.calls == 2, str(other)  # an fx graph is as general as the model's code


def gate(h: torch.Tensor) -> torch.Tensor:
    """Data-dependent: fx cannot trace into it (Dynamo can)."""
    if h.sum() > 0:
        return h * 2
    return h - 1


class _Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.lin(h).relu()


class _Gated(nn.Module):
    def __init__(self, depth: int = 2, gated: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block() for _ in range(depth)])
        self.gated = gated

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if self.gated:
            h = gate(h)
        for layer in self.layers:
            h = layer(h)
        return h


def test_tracing_ignore_names_functions_fx_calls_whole():
    model = _Gated().eval()
    sample = {"input_ids": torch.randint(0, 16, (1, 5))}
    layers = [(f"layers.{i}", b) for i, b in enumerate(model.layers)]
    subgraphs = fxlc.fxprep_subgraphs(model, sample, ["_Block"], ["gate"], 1)
    capture = fxlc.last_capture()
    assert capture.report.tracer == "fx"
    assert any(n.target is gate for n in capture.gm.graph.nodes)  # called whole
    for sign in (1, -1):  # both sides of its `if` at calibration: it runs at each call
        model.emb.weight.data.abs_().mul_(sign)
        with torch.no_grad():
            found = compare_subgraphs(model, subgraphs, sample, layers)
        assert found.equal, str(found)
    fxlc.fxprep_subgraphs(model, sample, ["_Block"], [], 1)  # not named: fx stops at its `if`, Dynamo captures
    capture = fxlc.last_capture()
    assert capture.report.tracer.startswith("dynamo")
    assert any("torch.fx was tried first" in n and "control flow" in n for n in capture.report.notes)


def test_on_meta_the_fx_capture_runs_no_layer():
    """A model on meta: the fx capture of the code around the layers runs none of them (a 7B's 32
    layers run on meta for their shapes cost more than the rest of the capture)."""
    with torch.device("meta"):
        model = _Gated(depth=6, gated=False).eval()  # (gate's `if` cannot run on meta)
    _Block.calls = 0
    subgraphs = fxlc.fxprep_subgraphs(model, {"input_ids": torch.randint(0, 16, (1, 5))}, ["_Block"], ["gate"], 1)
    assert fxlc.last_capture().report.tracer == "fx"
    assert len(subgraphs) == 7 and _Block.calls == 0  # a head (the embedding) and a subgraph per layer


class _ShapeGated(_Gated):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if h.shape[1] > 3:  # fx cannot branch on a traced size; Dynamo can, on meta too
            h = h * 2
        for layer in self.layers:
            h = layer(h)
        return h


def test_on_meta_the_twin_of_a_layer_fx_calls_whole_holds_nothing_and_dynamo_gets_a_whole_twin():
    """fx runs no module it keeps whole, so on meta their twins are the module objects alone (a 7B's
    layers are most of its modules); where fx fails, Dynamo's capture runs them for their shapes and
    gets a twin with everything in them."""
    with torch.device("meta"):
        model = _Gated(depth=3, gated=False).eval()
        gated = _ShapeGated(depth=3, gated=False).eval()
    sample = {"input_ids": torch.randint(0, 16, (1, 5))}
    fxlc.fxprep_subgraphs(model, sample, ["_Block"], [], 1)
    capture = fxlc.last_capture()
    assert capture.report.tracer == "fx"
    for layer in model.layers:
        twin = capture.twin.twin_of[id(layer)]
        assert type(twin) is _Block and not twin._modules and not twin._parameters
    _Block.calls = 0
    subgraphs = fxlc.fxprep_subgraphs(gated, sample, ["_Block"], [], 1)
    capture = fxlc.last_capture()
    assert capture.report.tracer.startswith("dynamo") and len(subgraphs) == 4
    assert _Block.calls >= 3 and not capture.stood_in  # each layer ran on meta, on its whole twin
    assert all(capture.twin.twin_of[id(layer)]._modules for layer in gated.layers)
