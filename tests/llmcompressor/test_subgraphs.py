"""fxprep's subgraphs: each target receives and returns what it does in eager (the mask included),
the modules modifiers hook see eager's calls, llm-compressor's options keep their meaning, the model is
left as found, and bad input is said plainly."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch
from compressed_tensors.offload import set_onload_device
from compressed_tensors.utils.match import match_named_modules
from llmcompressor.args import DatasetArguments
from llmcompressor.utils.pytorch.module import infer_sequential_targets
from torch import nn

import fxprep.compat.llmcompressor as fxlc
from fxprep.compat.llmcompressor.reproduce import compare_subgraphs
from fxprep.errors import InputMismatch, InvalidInput, MissingDependency, TraceFailure

from .lc_models import calibration, causal_lm

IGNORE = DatasetArguments().tracing_ignore


def batch(model: nn.Module, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def subgraphs_of(model: nn.Module, sample: dict, targets=None, per_subgraph: int = 1) -> list:
    targets = infer_sequential_targets(model, targets)
    return fxlc.fxprep_subgraphs(model, sample, targets, IGNORE, per_subgraph)


# the five types whose layers llm-compressor's tracer hands attention_mask=None (issue 58)
@pytest.mark.parametrize("model_type", ["mistral", "phi3", "mixtral", "qwen3_moe", "starcoder2"])
def test_every_layer_receives_what_it_receives_in_eager(model_type):
    model = causal_lm(model_type, num_hidden_layers=3)
    sample = batch(model)
    subgraphs = subgraphs_of(model, sample)
    layers = [(n, m) for n, m in match_named_modules(model, infer_sequential_targets(model, None))]
    with calibration(model):
        found = compare_subgraphs(model, subgraphs, sample, layers)
        # another length than the capture's: the graph is shape-general
        other = compare_subgraphs(model, subgraphs, batch(model, length=7, seed=1), layers)
    assert found.equal and found.calls == 3, str(found)
    assert other.equal and other.calls == 3, str(other)
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda m, a, k: seen.append(k.get("attention_mask")),
                                                             with_kwargs=True)
    with calibration(model):
        fxlc.reproduce.run_subgraphs(model, subgraphs, sample)
    handle.remove()
    assert isinstance(seen[0], torch.Tensor) and seen[0].dim() == 4  # the causal mask eager attention adds


def test_modules_modifiers_hook_see_eager_calls():
    """Attention modules (AWQ's parents, KV-cache observers), decoder layers, norms (SmoothQuant) and
    lm_head get the calls eager gives them: same count, same arguments, same outputs."""
    model = causal_lm("llama")
    sample = batch(model)
    subgraphs = subgraphs_of(model, sample)
    watched = [(n, m) for n, m in model.named_modules()
               if type(m).__name__ in ("LlamaAttention", "LlamaDecoderLayer", "LlamaRMSNorm", "LlamaMLP")]
    watched.append(("lm_head", model.lm_head))
    with calibration(model):
        found = compare_subgraphs(model, subgraphs, sample, watched)
    assert found.equal and found.calls == 2 * 5 + 1 + 1, str(found)  # per layer: layer, attn, mlp, 2 norms; final norm; lm_head


def test_targets_per_subgraph_and_named_targets():
    model = causal_lm("llama", num_hidden_layers=4)
    sample = batch(model)
    subgraphs = subgraphs_of(model, sample, per_subgraph=2)
    assert [s.stage.blocks for s in subgraphs] == [(), ("model.layers.0", "model.layers.1"),
                                                    ("model.layers.2", "model.layers.3")]
    assert set(subgraphs[0].input_names) == {"input_ids", "attention_mask"}
    # what llm-compressor compresses at each subgraph's end: the model's own modules it calls
    last = subgraphs[-1].submodules(model)
    assert model.model.layers[3].mlp.down_proj in last and model.lm_head in last and model.model.layers[1] not in last
    assert all(any(m is o for o in model.modules()) for s in subgraphs for m in s.submodules(model))
    by_name = subgraphs_of(model, sample, targets=["re:.*layers\\.[02]$"])
    assert [s.stage.blocks for s in by_name] == [(), ("model.layers.0",), ("model.layers.2",)]
    with calibration(model):
        assert compare_subgraphs(model, by_name, sample, [("model.layers.1", model.model.layers[1])]).equal


def test_model_without_declared_blocks_is_cut_at_its_repeated_blocks():
    """No _no_split_modules: llm-compressor's targets are "__ALL__" (one subgraph); fxprep takes the
    items of the model's lists of like blocks."""
    model = causal_lm("llama", num_hidden_layers=3)
    model._no_split_modules = []
    assert infer_sequential_targets(model, None) == "__ALL__"
    sample = batch(model)
    subgraphs = subgraphs_of(model, sample)
    assert [s.stage.blocks for s in subgraphs][1:] == [("model.layers.0",), ("model.layers.1",), ("model.layers.2",)]
    with calibration(model):
        assert compare_subgraphs(model, subgraphs, sample, list(match_named_modules(model, ["LlamaDecoderLayer"]))).equal


def _state_of(model: nn.Module) -> list:
    return [(id(m), type(m), m.__dict__.get("forward"), id(m._parameters), id(m._buffers), dict(m._forward_hooks),
             dict(m._forward_pre_hooks), tuple(id(t) for t in m._parameters.values()) if isinstance(m._parameters, dict) else None)
            for m in model.modules()]


def test_wrapped_model_is_left_as_found_and_its_wrappers_run():
    """compressed-tensors' offloading wraps every module (caches for its tensors, a forward that moves
    inputs); the capture sees through them on a twin and changes nothing of the model."""
    model = causal_lm("llama")
    set_onload_device(model, "cpu")
    before = _state_of(model)
    sample = batch(model)
    subgraphs = subgraphs_of(model, sample)
    assert _state_of(model) == before
    capture = fxlc.last_capture()
    assert capture.twin.device.type == "cpu" and capture.report.verification.status == "passed"
    layer = subgraphs[1].stage.get_submodule("model.layers.0")
    assert layer is model.model.layers[0] and "forward" in layer.__dict__  # the model's own, wrapper and all


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        count = ctypes.c_int(h.shape[1]).value  # a C call: Dynamo stops here, fx too
        for layer in self.layers[:count]:
            h = layer(h)
        return h


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.encoder = _Encoder()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.emb(input_ids))


class _Recurrent(nn.Module):
    """Its blocks run twice per call (a recurrent model's cycles, HRM's): each call must reach the block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for _ in range(2):
            for layer in self.layers:
                h = layer(h) + h
        return h


def test_a_layer_called_several_times_is_the_models_module_at_every_call():
    model = _Recurrent().eval()
    sample = {"input_ids": torch.randint(0, 16, (1, 5))}
    subgraphs = fxlc.fxprep_subgraphs(model, sample, ["_Block"], IGNORE, 1)
    calls = []
    handle = model.layers[0].register_forward_hook(lambda m, a, o: calls.append(1))
    with torch.no_grad():
        found = compare_subgraphs(model, subgraphs, sample, [(f"layers.{i}", b) for i, b in enumerate(model.layers)])
    handle.remove()
    assert found.equal and found.calls == 4, str(found)
    assert len(calls) == 4  # twice in eager, twice through the subgraphs: no unrolled copy took a call


def test_targets_inside_code_fxprep_cannot_capture_are_refused_with_the_diagnosis():
    model = _Toy().eval()
    with pytest.raises(TraceFailure) as info:
        fxlc.fxprep_subgraphs(model, {"input_ids": torch.randint(0, 16, (1, 4))}, ["_Block"], IGNORE, 1)
    text = str(info.value)
    assert "encoder.layers.0" in text and "kept whole" in text  # which targets, inside what
    assert f"{__file__}:{_Encoder.forward.__code__.co_firstlineno + 1}" in text  # the line that stopped it


def test_targets_that_match_nothing_name_the_model_classes():
    model = causal_lm("llama")
    with pytest.raises(InvalidInput, match="LlamaDecoderLayer"):
        fxlc.fxprep_subgraphs(model, batch(model), ["LlamaDecoderLayr"], IGNORE, 1)


def test_a_batch_with_other_keys_is_an_input_mismatch():
    model = causal_lm("llama")
    subgraphs = subgraphs_of(model, batch(model))
    with calibration(model), pytest.raises(InputMismatch, match="attention_mask"):
        subgraphs[0].forward(model, input_ids=batch(model)["input_ids"])


class _FixedLength(nn.Module):
    """Its code holds the example's length (a reshape to 5 tokens): another length cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids).reshape(1, 5, 8)
        for layer in self.layers:
            h = layer(h)
        return h


def test_a_batch_the_graph_was_not_captured_for_is_checked_then_refused_or_taken():
    model = _FixedLength().eval()
    subgraphs = fxlc.fxprep_subgraphs(model, {"input_ids": torch.randint(0, 16, (1, 5))}, ["_Block"], IGNORE, 1)
    with torch.no_grad(), pytest.raises(InputMismatch, match="do not run on it"):
        fxlc.reproduce.run_subgraphs(model, subgraphs, {"input_ids": torch.randint(0, 16, (1, 6))})
    assert subgraphs[0].accepted == set()


def test_without_llmcompressor_the_import_names_the_extra(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("fxprep.compat.llmcompressor")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llmcompressor", None)  # as if not installed
    with pytest.raises(MissingDependency) as info:
        import fxprep.compat.llmcompressor  # noqa: F401
    assert 'pip install "fxprep[llmcompressor]"' in str(info.value) and "\n" not in str(info.value)


def test_import_fxprep_imports_none_of_it():
    import subprocess

    code = ("import sys, fxprep; print(sorted(m for m in ('llmcompressor', 'compressed_tensors', 'datasets') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
