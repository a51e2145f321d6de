"""Block reuse where the repeated blocks hold opaque parts (issue 27, item 3: "block reuse kept
under dynamic shapes"): a scan kept opaque so that the length stays dynamic
(``fxprep.capture.dynamo.scans``) sits in every layer of a state-space model, and an excluded class in
every layer of an LLM. Each block is captured once with its parts as calls and stamped out, every copy
calling its own instance's part; a block's own capture that specialises the length is where the scan
is looked for, without capturing the whole model first (``fxprep.capture.dynamo.early_limit``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxprep
import fxprep.capture.dynamo as dynamo_route
from fxprep.capture.sites import OpaqueFunction, OpaqueMethod
from tests.helpers_models import Recurrent, kernel_fallback, selective_scan


def _stamped(gm: nn.Module) -> dict[str, list[str]]:
    return {k: v for k, v in fxprep.get_report(gm).reuse.get("captured", {}).items() if v}


def _whole_model_captures(monkeypatch: Any, model: nn.Module) -> list[nn.Module]:
    """Each Dynamo capture of ``model`` itself without block reuse (reuse's own outer capture goes
    through its own module's name, not this one)."""
    seen: list[nn.Module] = []
    real = dynamo_route.dynamo_export

    def counting(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is model:
            seen.append(module)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(dynamo_route, "dynamo_export", counting)
    return seen


def _same(gm: nn.Module, model: nn.Module, *xs: torch.Tensor) -> None:
    for x in xs:
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


class Block(nn.Module):
    """A layer whose scan is a helper method of a sublayer (RecurrentGemma's ``_rnn_scan``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = Recurrent(reads_weight=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.rec(x))


class Blocks(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_method_kept_opaque_in_every_block_is_stamped_bound_to_each_blocks_own() -> None:
    torch.manual_seed(0)
    model = Blocks(Block).eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {0: "batch", 1: "seq"}})
    assert _stamped(gm) == {"layers.0": ["layers.1", "layers.2"]}
    assert {f"layers.{i}.rec._scan" for i in range(3)} <= set(fxprep.get_report(gm).leaves)
    for i, layer in enumerate(model.layers):
        part = gm.get_submodule(f"layers.{i}.rec._scan")
        assert isinstance(part, OpaqueMethod) and part.owner is layer.rec and part.owner_path == f"layers.{i}.rec"
        assert gm.get_submodule(f"layers.{i}.rec.gate") is layer.rec.gate
    _same(gm, model, torch.randn(2, 6, 8), torch.randn(3, 17, 8), torch.randn(1, 50, 8))


def test_a_method_of_the_block_itself_is_bound_to_each_block() -> None:
    torch.manual_seed(0)
    model = Blocks(lambda: Recurrent(reads_weight=False)).eval()  # type: ignore[arg-type]
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {1: "seq"}})
    assert _stamped(gm) == {"layers.0": ["layers.1", "layers.2"]}
    for i, layer in enumerate(model.layers):
        part = gm.get_submodule(f"layers.{i}._scan")
        assert isinstance(part, OpaqueMethod) and part.owner is layer and part.owner_path == f"layers.{i}"
    _same(gm, model, torch.randn(2, 9, 8), torch.randn(2, 40, 8))


class DecoratedBlock(Block):
    """``Block`` whose ``forward`` a decorator wraps in ``(*args, **kwargs)``, as transformers'
    ``deprecate_kwarg`` wraps most decoder layers': Dynamo's frame for the block is the wrapper's,
    where the block is ``args[0]`` and its input ``args[1]``."""

    @kernel_fallback
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.rec(x))


def test_a_scan_in_blocks_whose_forward_a_decorator_wraps_is_found_in_the_blocks_capture(monkeypatch: Any) -> None:
    """The block's capture names its input's sizes ``L['args'][1]``: taken for the model's, its scan
    is found there, with no capture of the whole model (before: the input was looked for as
    ``L['args'][0]``, the block's guards went unread and the whole model was captured instead)."""
    torch.manual_seed(0)
    model = Blocks(DecoratedBlock).eval()
    whole = _whole_model_captures(monkeypatch, model)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {0: "batch", 1: "seq"}})
    assert whole == []
    assert _stamped(gm) == {"layers.0": ["layers.1", "layers.2"]}
    assert {f"layers.{i}.rec._scan" for i in range(3)} <= set(fxprep.get_report(gm).leaves)
    _same(gm, model, torch.randn(2, 6, 8), torch.randn(3, 17, 8))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.flip(-1) * sin


class RopeBlock(nn.Module):
    """Position tables passed in as a tuple, as transformers' decoder layers take them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.decay = nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = rotate(self.inp(x), *position_embeddings)
        return x + self.out(selective_scan(h, self.decay))


class RopeStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RopeBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, 8)
        position_embeddings = (angles.cos()[None], angles.sin()[None])
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings)
        return x


def test_a_scan_in_every_block_is_found_in_the_blocks_capture(monkeypatch: Any) -> None:
    """The length's symbol reaches each block twice (the states, and the position tables in a
    tuple): the block's capture names both after the model's input, so the rotation, which only
    multiplies tensors of one length, is not taken for a scan, and the whole model is never captured
    without reuse."""
    torch.manual_seed(0)
    model = RopeStack().eval()
    whole = _whole_model_captures(monkeypatch, model)
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 6, 8),), dynamic={"x": {1: "seq"}})
    leaves = fxprep.get_report(gm).leaves
    assert [k for k, v in leaves.items() if v.startswith("opaque: a loop over 'seq'")] == ["layers.0.selective_scan"]
    assert not any("rotate" in k for k in leaves), leaves
    assert whole == []
    assert _stamped(gm) == {"layers.0": ["layers.1", "layers.2"]}
    parts = [gm.get_submodule(f"layers.{i}.selective_scan") for i in range(3)]
    assert all(isinstance(p, OpaqueFunction) for p in parts) and len({id(p) for p in parts}) == 3
    _same(gm, model, torch.randn(2, 6, 8), torch.randn(2, 23, 8))


def test_mamba_layers_are_captured_once_with_their_scan(monkeypatch: Any) -> None:
    import transformers
    from transformers.models.mamba import modeling_mamba

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=3)
    model = transformers.MambaForCausalLM(config).eval()
    whole = _whole_model_captures(monkeypatch, model)
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, progress=False)
        if not hasattr(modeling_mamba, "mamba_selective_scan"):
            return  # transformers 5.0 writes the loop inline in the mixer's forward: no scan (tests/test_scans.py)
        # in bf16 the first layer takes the embeddings' bf16 and the others a float32 residual: two kinds
        assert _stamped(gm) == ({"backbone.layers.0": ["backbone.layers.1", "backbone.layers.2"]} if dtype == torch.float32
                                else {"backbone.layers.1": ["backbone.layers.2"]})
        assert "dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}}" in fxprep.get_report(gm).notes
        parts = [gm.get_submodule(f"backbone.layers.{i}.mixer.mamba_selective_scan") for i in range(3)]
        assert all(isinstance(p, OpaqueFunction) for p in parts)
        for batch, seq in ((3, 13), (2, 40)):
            other = torch.randint(3, 90, (batch, seq), generator=torch.Generator().manual_seed(seq))
            with torch.no_grad():
                expected = model(input_ids=other, use_cache=False).logits
                torch.testing.assert_close(gm(input_ids=other)["logits"], expected, rtol=0, atol=0)
    assert whole == []  # the scan was found in the layer's own capture


def test_the_layer_after_an_excluded_layer_is_the_twin_of_the_others() -> None:
    """An excluded layer's output has a gradient in eager (its own weights give it one): the graph's
    stand-in for it has one too, so the next layer is called as its twins are and stamped with them
    (it was captured apart, 'its inputs differ')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 12))
    gm = fxprep.prepare_model(model, modules_to_exclude=[model.model.layers[0]], example_inputs={"input_ids": ids},
                              progress=False)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed"
    assert _stamped(gm) == {"model.layers.1": [f"model.layers.{i}" for i in range(2, 5)]}
    assert gm.get_submodule("model.layers.0") is model.model.layers[0]
    other = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(gm(other).logits, model(other).logits, rtol=0, atol=0)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.lin(h))


class _FirstThenLayers(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.frozen = frozen
        self.first = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.layers = nn.ModuleList(_Residual() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            h = self.first(x)
        for layer in self.layers:
            h = layer(h)
        return h


@pytest.mark.parametrize("frozen", [False, True])
def test_an_excluded_modules_output_has_a_gradient_where_the_traced_modules_has(frozen: bool) -> None:
    """The blocks after a module are grouped the same whether that module is excluded or traced:
    its output has a gradient in the graph exactly where it has one eagerly (none when the model
    calls it under its own no_grad: then the first block is called otherwise than the next two)."""
    torch.manual_seed(0)
    model = _FirstThenLayers(frozen).eval()
    example = (torch.randn(2, 8),)
    traced = fxprep.prepare_model(model, example_inputs=example, progress=False)
    excluded = fxprep.prepare_model(model, modules_to_exclude=[model.first], example_inputs=example, progress=False)
    expected = {"layers.1": ["layers.2"]} if frozen else {"layers.0": ["layers.1", "layers.2"]}
    assert _stamped(traced) == _stamped(excluded) == expected
    assert fxprep.get_report(excluded).verification.status == "passed"
    _same(excluded, model, torch.randn(3, 8))


class _Halved(nn.Module):
    """Updates the output of an excluded module in place: fine in eager, where that output was made by
    an operation; a stand-in made as a leaf with a gradient would refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h.mul_(0.5)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_an_excluded_modules_output_updated_in_place_traces_as_in_eager() -> None:
    torch.manual_seed(0)
    model = _Halved().eval()
    gm = fxprep.prepare_model(model, modules_to_exclude=[model.first], example_inputs=(torch.randn(2, 8),),
                              progress=False)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo" and report.verification.status == "passed"  # not fx's fallback
    assert gm.get_submodule("first") is model.first
    _same(gm, model, torch.randn(3, 8))



class Segments(nn.Module):
    """Qwen2-VL's rope index: runs of one token type, grouped with ``itertools.groupby`` and a key
    function, which Dynamo does not trace (``Unsupported``)."""

    def runs(self, kinds: torch.Tensor) -> torch.Tensor:
        import itertools

        found = [key for key, _ in itertools.groupby(enumerate(kinds.tolist()), lambda t: t[1])]
        return torch.tensor(float(len(found)))

    def forward(self, kinds: torch.Tensor) -> torch.Tensor:
        return self.runs(kinds) * 2


class Residuals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).relu() + h


class GroupsAfterBlocks(nn.Module):
    """Repeated blocks, then a slice to a length read from data (captured deciding values,
    ``dynamo+values``) and the token-type runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Residuals() for _ in range(3))
        self.segments = Segments()
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, n: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        x = x[:, : int(n)]
        if x.shape[1] > 1:  # a question about a size read from data
            x = x - x.mean(1, keepdim=True)
        return self.head(x) * self.segments(kinds)


def test_python_dynamo_cannot_trace_around_the_blocks_costs_no_whole_model_capture(monkeypatch: Any) -> None:
    """Deciding values read from data, the outer capture under block reuse fails in the model's own
    code on Python Dynamo does not trace: the whole model's capture would fail there too (after
    tracing every block), so that failure is the capture's and the part is made opaque with no
    capture of the whole model."""
    torch.manual_seed(0)
    model = GroupsAfterBlocks().eval()
    whole = _whole_model_captures(monkeypatch, model)
    x, kinds = torch.randn(2, 6, 8), torch.tensor([0, 0, 1, 1, 0])
    gm = fxprep.prepare_model(model, example_inputs=(x, torch.tensor(4), kinds))
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo+values"
    assert report.leaves == {"segments.runs": "opaque: unsupported python at "
                             f"{__file__}:{Segments.runs.__code__.co_firstlineno + 3}"}
    assert _stamped(gm) == {"layers.0": ["layers.1", "layers.2"]}
    assert whole == []  # before: one, deciding values, failing on the same groupby after every block
    other = torch.tensor([1, 0, 1, 1, 1])  # two runs, not three: the opaque part runs on each call
    with torch.no_grad():
        torch.testing.assert_close(gm(x, torch.tensor(3), other), model(x, torch.tensor(3), other), rtol=0, atol=0)


def test_xlstms_loop_held_in_a_partial_is_its_backend_kept_opaque_in_every_stamped_block() -> None:
    """xLSTM's backend holds its kernels in ``functools.partial`` objects and its recurrent kernel
    loops over the length. Three things stood between it and a shape-general default: the outer
    capture's stand-in for a block, computing the block's output on fake tensors, fixed the length
    there (a guard set aside), so the block's own guards were not read as the length's and the
    maybe-dynamic try was kept within a range, then failed on a second size (static shapes); a patch
    of the kernel function never takes a call made through the partial, so no scan was kept opaque
    (the length dropped); and the backend kept opaque inside the blocks broke block reuse. In float32
    only: in bf16 the original itself fails from 64 tokens on (its chunked kernel mixes dtypes), where
    the check past the loop's guard is made, and static shapes are right."""
    import transformers

    from fxprep.cli.tiny import tiny_configs

    config = next(tiny_configs("xlstm"))[0]  # 2 blocks, width 32, 64-token chunks
    torch.manual_seed(0)
    model = transformers.xLSTMForCausalLM(config).eval()
    model.config.use_cache = False  # its cache's states are not sized for this config (transformers 5.x)
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, progress=False)
    report = fxprep.get_report(gm)
    assert "input_ids dim 0 (batch), input_ids dim 1 (seq) were found" in " ".join(report.notes), report.notes
    assert report.leaves.get("backbone.blocks.0.mlstm_layer.mlstm_backend", "").startswith("opaque: a loop over 'seq'")
    assert _stamped(gm) == {"backbone.blocks.0": ["backbone.blocks.1"]}
    for batch, seq in ((3, 13), (2, 70)):  # 70: past the 64-token chunk, where the kernel takes another way
        other = torch.randint(3, 90, (batch, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            expected = model(input_ids=other, use_cache=False).logits
            torch.testing.assert_close(gm(input_ids=other)["logits"], expected, rtol=0, atol=0)
