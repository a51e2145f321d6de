"""Dynamo capture re-lifted to module level (``fxprep.capture.dynamo``).

Both re-lifting routes are exercised on every model here: ``"flag"`` (Dynamo's private
``install_free_tensors_for_export=False`` emits ``call_module`` for torch.nn leaves) and
``"regroup"`` (no private flag: leaf calls are collapsed from ``nn_module_stack``). They must agree
with each other and with the fx capture on which modules are called, in which order.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep.capture import dynamo as D
from fxprep.capture.common import LeafPolicy
from fxprep.capture.dynamo import names as dynamo_names
from fxprep.capture.dynamo import record, regroup
from fxprep.capture.fx import capture_fx
from fxprep.capture.request import CaptureRequest
from fxprep.core.inputs import ExampleInputs
from fxprep.families.transformers import model as hf
from fxprep.passes.functional_to_module import remaining_compute_ops

from .helpers import STE, ResidualBlock

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

ROUTES = ["flag", "regroup"] if D.flag_available() else ["regroup"]


def targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


def capture(model: nn.Module, example: ExampleInputs, route: str, policy: LeafPolicy | None = None):
    result, attempt = D.capture_dynamo(CaptureRequest(model, policy or LeafPolicy(), example, reuse=True), route=route)
    assert result is not None, attempt.error
    return result


@pytest.fixture
def force_route(monkeypatch: pytest.MonkeyPatch):
    def force(route: str) -> None:
        monkeypatch.setattr(D, "default_route", lambda: route)

    return force


# --------------------------------------------------------------------------------------------------
# A model with most of what makes re-lifting hard
# --------------------------------------------------------------------------------------------------
GLOBAL_BIAS = torch.tensor([1.0, 2.0, 3.0, 4.0])


class ScaledNorm(nn.Module):
    """A user leaf with a positional scalar and a keyword-only tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight * scale
        return y if bias is None else y + bias


class Kitchen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.idn = nn.Identity()
        self.drop = nn.Dropout(0.1)
        self.norm = ScaledNorm()
        self.lin = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.plain = torch.full((4,), 0.5)  # a tensor attribute, neither parameter nor buffer
        self.register_buffer("offset", torch.linspace(0, 1, 4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, object]:
        a, _ = self.mha(x, x, x, need_weights=False)
        z = x + self.idn(a)
        z = self.drop(z)
        z = self.norm(z, 2.0, bias=GLOBAL_BIAS if mask is None else mask)
        with torch.no_grad():
            c = torch.arange(4, device=x.device).float()
        z = z + c + self.plain + self.offset
        o, (h, _) = self.lstm(z)
        F.relu(o, inplace=True)
        return {"out": self.lin(o) + self.lin(h.transpose(0, 1)), "aux": (z.sum(),)}


def kitchen_example() -> ExampleInputs:
    g = torch.Generator().manual_seed(0)
    return ExampleInputs((), {"x": torch.randn(2, 3, 4, generator=g), "mask": torch.randn(4, generator=g)})


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("leaf_norm", [False, True])
def test_kitchen_prepares_on_each_route(route: str, leaf_norm: bool, force_route) -> None:
    force_route(route)
    model = Kitchen().eval()
    ex = kitchen_example()
    kwargs = {"module_classes_to_exclude": [ScaledNorm]} if leaf_norm else {}
    gm = fxprep.prepare_model(model, example_inputs=ex.kwargs, tracer="dynamo", **kwargs)
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert gm.meta[D.ROUTE_META] == route
    assert not remaining_compute_ops(gm)
    calls = targets(gm)
    assert calls[:4] == ["mha", "idn", "add", "drop"]
    assert "lstm" in calls and "lin" in calls and "lin_1" in calls  # the reused Linear was unrolled
    if leaf_norm:
        assert "norm" in calls and report.leaves == {"norm": "module_classes_to_exclude"}
        assert gm.get_submodule("norm") is model.norm
    for name in ("mha", "idn", "drop", "lstm", "lin"):
        assert gm.get_submodule(name) is model.get_submodule(name)
    for name, p in model.named_parameters():
        assert gm.get_parameter(name) is p
    assert list(gm.state_dict()) == list(model.state_dict())  # 'plain' is no buffer: not a key
    out = gm(**ex.kwargs)
    assert isinstance(out, dict) and list(out) == ["out", "aux"] and isinstance(out["aux"], tuple)
    # calling convention: positional works too, and the graph reads the user's tensors
    torch.testing.assert_close(gm(ex.kwargs["x"], ex.kwargs["mask"])["out"], model(**ex.kwargs)["out"])
    assert any("no_grad" in n for n in report.notes)
    assert any("device literal" in n for n in report.notes)
    assert not any(isinstance(a, torch.device) for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values()))


def test_routes_agree_with_each_other_and_fx() -> None:
    model = Kitchen().eval()
    ex = kitchen_example()
    policy = LeafPolicy(classes=(ScaledNorm,))
    got = {route: targets(capture(model, ex, route, policy).gm) for route in ROUTES}
    assert len({tuple(t) for t in got.values()}) == 1, got
    assert got[ROUTES[0]][:5] == ["mha", "idn", "drop", "norm", "lstm"]


@pytest.mark.parametrize("route", ROUTES)
def test_resnet_routes_match_fx(route: str) -> None:
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval()
    ex = ExampleInputs((torch.randn(1, 3, 32, 32),), {})
    fx_targets = targets(capture_fx(model, LeafPolicy())[0].gm)
    result = capture(model, ex, route)
    assert targets(result.gm) == fx_targets
    assert not [n for n in result.notes if not n.startswith("block reuse:")]  # reuse says what it did
    # reused ReLU ('layer1.0.relu' called twice): two calls, the second keyed '@1' in the stack
    relu_calls = [n for n in result.gm.graph.nodes if n.op == "call_module" and n.target == "layer1.0.relu"]
    assert len(relu_calls) == 2
    assert list(relu_calls[1].meta["nn_module_stack"])[-1] == "layer1.0.relu@1"
    assert relu_calls[0].meta["nn_module_stack"]["layer1.0"] == ("layer1.0", torchvision.models.resnet.BasicBlock)
    torch.testing.assert_close(result.gm(*ex.args), model(*ex.args))
    # user-named leaf classes: the blocks are called whole, the same way on every route and in fx
    policy = LeafPolicy(classes=(torchvision.models.resnet.BasicBlock,))
    blocks = targets(capture(model, ex, route, policy).gm)
    assert blocks == targets(capture_fx(model, policy)[0].gm)
    assert "layer1.0" in blocks and "layer1.0.conv1" not in blocks


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------
def tiny_llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def llama_inputs(batch: int = 2, seq: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


@pytest.mark.parametrize("route", ROUTES)
def test_llama_rmsnorm_leaf_on_each_route(route: str, force_route) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    force_route(route)
    model = tiny_llama()
    ex = llama_inputs()
    gm = fxprep.prepare_model(model, module_classes_to_exclude=[LlamaRMSNorm], example_inputs=ex, tracer="dynamo")
    report = gm.fxprep_report
    assert report.verification.status == "passed"
    calls = targets(gm)
    for name in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"):
        assert name in calls and gm.get_submodule(name) is model.get_submodule(name)
        assert report.leaves[name] == "module_classes_to_exclude"
    assert not remaining_compute_ops(gm)
    out = gm(**ex)
    assert type(out) is type(model(**ex, use_cache=False))
    assert set(gm.state_dict()) == set(model.state_dict())
    # the non-persistent rotary buffer stays out of the state_dict
    assert "model.rotary_emb.inv_freq" not in gm.state_dict()


def test_llama_dynamic_batch_and_sequence() -> None:
    model = tiny_llama()
    dims = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    gm = fxprep.prepare_model(model, example_inputs=llama_inputs(2, 5), tracer="dynamo", dynamic=dims)
    report = gm.fxprep_report
    assert any(n.startswith("verified on a second input size") for n in report.notes)
    bigger = llama_inputs(3, 9)
    torch.testing.assert_close(gm(**bigger).logits, model(**bigger, use_cache=False).logits)


def test_dynamic_batch_shorthand_and_validation() -> None:
    # (a Conv2d root once would not do: Dynamo guarded its batch to <= 15 and export refused the dynamic
    # dimension; before issue 10 a forced tracer="dynamo" then silently returned fx's result)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5)).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4), tracer="dynamo", dynamic="batch")
    assert gm.fxprep_report.tracer == "dynamo"
    assert any("second input size" in n for n in gm.fxprep_report.notes)
    x = torch.randn(7, 4)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxprep.InvalidInput):
        fxprep.prepare_model(model, example_inputs=x, dynamic={"x": {"0": "batch"}})
    with pytest.raises(fxprep.InvalidInput):
        fxprep.prepare_model(model, example_inputs=x, dynamic="everything")


def test_grown_example_keeps_values_valid() -> None:
    model = tiny_llama()
    ex = ExampleInputs((), llama_inputs(2, 5))
    grown = D.grown_example(model, ex, {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}})
    assert grown.kwargs["input_ids"].shape == (2, 6)
    assert torch.equal(grown.kwargs["input_ids"][:, :5], ex.kwargs["input_ids"])
    assert grown.kwargs["attention_mask"].shape == (2, 6)


def test_hf_helpers() -> None:
    model = tiny_llama()
    inputs = hf.example_inputs_for(model, batch=1, seq_len=4)
    assert set(inputs) == {"input_ids", "attention_mask"} and inputs["input_ids"].shape == (1, 4)
    assert hf.capture_concrete_args(model, None, None) == {"use_cache": False}
    assert hf.capture_concrete_args(model, None, ExampleInputs((), {"use_cache": True})) is None
    assert hf.capture_concrete_args(nn.Linear(2, 2), None, None) is None
    assert hf.example_inputs_for(nn.Linear(2, 2)) is None
    assert hf.hf_symbolic_trace(model) is None  # transformers 5 has no transformers.utils.fx
    model.config._attn_implementation = "flash_attention_2"
    notes: list[str] = []
    with hf.capture_context(model, notes):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "flash_attention_2" and notes
    model.config._attn_implementation = "sdpa"


def test_hf_without_example_inputs_uses_config_inputs() -> None:
    model = tiny_llama()
    gm = fxprep.prepare_model(model)
    report = gm.fxprep_report
    assert report.tracer == "dynamo"
    assert report.verification.status == "skipped"
    assert any("built from the model config" in n for n in report.notes)
    ex = llama_inputs(2, 8)
    torch.testing.assert_close(gm(**ex).logits, model(**ex, use_cache=False).logits)


# --------------------------------------------------------------------------------------------------
# Parameters must never silently become constants
# --------------------------------------------------------------------------------------------------
class BiasCache(nn.Module):
    """The timm LeViT / EfficientFormer pattern: a tensor computed from a parameter on the first
    eval call, cached in a plain dict attribute, and reused afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.attention_biases = nn.Parameter(torch.randn(4))
        self.attention_bias_cache: dict[str, torch.Tensor] = {}

    def biases(self, device: torch.device) -> torch.Tensor:
        if self.training:
            return self.attention_biases * 2
        key = str(device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.attention_biases * 2
        return self.attention_bias_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.biases(x.device)


@pytest.mark.parametrize("route", ROUTES)
def test_parameter_cache_is_recomputed_not_baked(route: str, force_route) -> None:
    force_route(route)
    model = BiasCache().eval()
    x = torch.randn(2, 4)
    model(x)  # fills the cache, as the reference run of prepare_model would
    gm = fxprep.prepare_model(model, example_inputs=x, tracer="dynamo")
    reads = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "attention_biases" in reads, reads
    assert any("cache" in n and "emptied" in n for n in gm.fxprep_report.notes)
    assert model.attention_bias_cache  # the user's cache is back
    with torch.no_grad():
        model.attention_biases.add_(1.0)
    model.attention_bias_cache.clear()
    torch.testing.assert_close(gm(x), model(x))  # the prepared module follows the parameter


class GlobalConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + GLOBAL_BIAS


def test_constants_are_reported_and_kept_out_of_state_dict() -> None:
    model = GlobalConstant().eval()
    result = capture(model, ExampleInputs((torch.randn(2, 4),), {}), "regroup")
    assert result.gm.meta["fxprep_constants"]
    assert any("baked into the graph as constants" in n for n in result.notes)
    assert set(result.gm.state_dict()) == set(model.state_dict())


def test_unreferenced_parameters() -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("a", (x,)))
    gm = torch.fx.GraphModule(model, graph)
    assert D.unreferenced_parameters(gm, model) == ["b.weight", "b.bias"]


# --------------------------------------------------------------------------------------------------
# What Dynamo cannot take goes to fx, and the report keeps Dynamo's error
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Pair:
    y: torch.Tensor
    z: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Pair:
        y = self.lin(x)
        return Pair(y, y * 2)


class Timed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = self.lin(x)
        self.elapsed = time.perf_counter() - start
        return y


class WithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.sub(x))


@pytest.mark.parametrize("cls", [DataclassOut, Timed, WithScripted])
def test_dynamo_failures_fall_back_to_fx(cls: type[nn.Module]) -> None:
    model = cls().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))
    report = gm.fxprep_report
    assert report.tracer == "fx"
    assert report.verification.status == "passed"
    dynamo_attempt = report.attempts[0]
    assert dynamo_attempt.tracer == "dynamo" and not dynamo_attempt.ok and dynamo_attempt.error
    assert type(gm(torch.randn(2, 4))) is type(model(torch.randn(2, 4)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y
        return -y


def test_untraceable_model_fails_with_trace_failure() -> None:
    options = {"fallback": "error"}
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(DataDependent().eval(), example_inputs=torch.randn(2, 4), **options)
    text = str(info.value)
    assert "dynamo:" in text and "fx:" in text


def test_capture_dynamo_never_raises_for_capture_failures() -> None:
    result, attempt = D.capture_dynamo(
        CaptureRequest(DataDependent().eval(), LeafPolicy(), ExampleInputs((torch.randn(2, 4),), {}), reuse=True))
    assert result is None and not attempt.ok and attempt.exception is not None and attempt.tracer == "dynamo"


# --------------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------------
def test_resolve_source_forms() -> None:
    root = nn.Module()
    root.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)])
    root.blocks = nn.ModuleDict({"a": nn.Identity()})
    assert D.resolve_source("L['self'].layers", root) is root.layers
    assert D.resolve_source("getattr(L['self'].layers, '1')", root) is root.layers[1]
    assert D.resolve_source("getattr(getattr(L['self'].layers, '1'), '0')", root) is root.layers[1][0]
    assert D.resolve_source("L['self'].layers[slice(None, 2, None)].1", root) is root.layers[1]
    assert D.resolve_source("L['self'].layers[slice(1, None, None)].0", root) is root.layers[1]
    assert D.resolve_source("L['self'].layers[-1]", root) is root.layers[2]
    assert D.resolve_source("L['s'].blocks['a']", root) is root.blocks["a"]
    assert D.resolve_source("G['something']", root) is None
    assert D.resolve_source("L['self'].missing", root) is None


class GradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            frozen = self.a(x) * 2
        return self.b(x) + frozen


@pytest.mark.parametrize("route", ROUTES)
def test_no_grad_region_keeps_gradients(route: str, force_route) -> None:
    force_route(route)
    model = GradRegion()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4), tracer="dynamo", verify="grad")
    assert gm.fxprep_report.verification.grad
    assert not any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in gm.graph.nodes)
    gm(torch.randn(2, 4)).sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None


def test_route_argument() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError):
        D.capture_dynamo(CaptureRequest(model, LeafPolicy(), ExampleInputs((torch.randn(1, 2),), {})), route="bogus")
    assert D.default_route() == ("flag" if D.flag_available() else "regroup")


def test_modules_to_exclude_instance_and_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2)).eval()
    seen = []
    handle = model[2].register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        for route in ROUTES:
            result = capture(model, ExampleInputs((torch.randn(3, 4),), {}), route,
                             LeafPolicy(modules=(model[1],)))
            assert targets(result.gm) == ["0", "1", "2"]
            assert result.extra_leaves == {"1": "modules_to_exclude", "2": "has forward hooks"}
            seen.clear()
            result.gm(torch.randn(3, 4))
            assert seen == [1]  # the hook still runs: the hooked module is called, not inlined
    finally:
        handle.remove()


def test_meta_device_capture() -> None:
    with torch.device("meta"):
        model = Kitchen().eval()
    model.plain = torch.full((4,), 0.5, device="meta")
    ex = ExampleInputs((), {"x": torch.randn(2, 3, 4, device="meta"), "mask": torch.randn(4, device="meta")})
    for route in ROUTES:
        gm = capture(model, ex, route, LeafPolicy(classes=(ScaledNorm,))).gm
        assert targets(gm)[:4] == ["mha", "idn", "drop", "norm"]
        assert gm.get_submodule("lstm") is model.lstm


class WritesAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.history: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.saved = y * 2
        self.history["last"] = y + 1
        return y


@pytest.mark.parametrize("route", ROUTES)
def test_user_model_attributes_are_not_left_fake(route: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    model = WritesAttributes().eval()
    x = torch.randn(2, 4)
    model(x)
    before = (model.saved, dict(model.history), model.history)
    result = capture(model, ExampleInputs((x,), {}), route)
    assert any("writes module attributes" in n and "saved" in n for n in result.notes)
    assert model.saved is before[0] and model.history is before[2] and model.history == before[1]
    assert not any(isinstance(v, FakeTensor) for v in [model.saved, *model.history.values()])


@pytest.mark.skipif("flag" not in ROUTES, reason="needs Dynamo's call_module flag")
def test_hooked_module_does_not_poison_later_captures() -> None:
    hooked = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = hooked[0].register_forward_hook(lambda m, i, o: None)
    try:
        capture(hooked, ExampleInputs((torch.randn(2, 4),), {}), "flag")
    finally:
        handle.remove()
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    result = capture(plain, ExampleInputs((torch.randn(2, 4),), {}), "flag")
    assert targets(result.gm) == ["0", "1"]


def test_in_place_on_an_input_still_captures_with_dynamo() -> None:
    """Capture marks float inputs as requiring grad (to keep autograd.Functions); a model that
    writes into its input in place cannot run that way, and must still prepare on Dynamo."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return self.fc(x)

    model = InPlace()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4),), tracer="dynamo")
    assert gm.fxprep_report.tracer == "dynamo"
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x.clone()), model(x.clone()))


def test_transformers_fx_tracer_is_one_more_fx_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``transformers < 5`` installed, its own ``transformers.utils.fx.symbolic_trace`` is tried
    when fxprep's fx tracer fails. transformers 5 has no such module, so a stand-in with the same
    signature is installed; what is checked is the cascade, the report and the result."""
    import sys
    import types

    import transformers

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x  # data-dependent: fxprep's fx tracer stops here

    class TinyModel(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config: transformers.PretrainedConfig) -> None:
            super().__init__(config)
            self.proj = nn.Linear(4, 4)
            self.gate = Gate()
            self.post_init()

        def forward(self, input_embeds: torch.Tensor) -> torch.Tensor:
            return self.gate(self.proj(input_embeds))

    calls: list[list[str] | None] = []

    def symbolic_trace(model: nn.Module, input_names: list[str] | None = None) -> torch.fx.GraphModule:
        calls.append(input_names)

        class HFTracer(torch.fx.Tracer):  # the real HFTracer keeps such modules as leaves too
            def is_leaf_module(self, m: nn.Module, name: str) -> bool:
                return isinstance(m, Gate) or super().is_leaf_module(m, name)

        return torch.fx.GraphModule(model, HFTracer().trace(model))

    fake = types.ModuleType("transformers.utils.fx")
    fake.symbolic_trace = symbolic_trace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.utils.fx", fake)
    model = TinyModel(transformers.PretrainedConfig()).eval()
    example = {"input_embeds": torch.randn(2, 4)}
    gm = fxprep.prepare_model(model, example_inputs=example, tracer="fx", fallback="error")
    report = gm.fxprep_report
    assert [(a.tracer, a.ok) for a in report.attempts] == [("fx", False), ("hf_fx", True)]
    assert calls == [["input_embeds"]]
    assert report.verification.status == "passed"
    assert gm.get_submodule("proj") is model.proj
    x = -torch.ones(2, 4)
    torch.testing.assert_close(gm(input_embeds=x), model(input_embeds=x))


def test_without_transformers_fx_the_fx_failure_is_reported_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    result, attempt = hf.capture_hf_fx(model, ExampleInputs((torch.randn(1, 4),)))
    assert result is None and attempt is None  # not a transformers model: nothing to add


def test_dynamo_autograd_function_is_the_users_class_and_saves(tmp_path: Any) -> None:
    """Dynamo records a custom Function as a higher-order op over traced bodies; the prepared graph
    must call the user's class instead (its backward runs, and it saves by name)."""

    class Quant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return STE.apply(self.fc(x) * 4) / 4

    model = Quant()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4),), tracer="dynamo", verify="grad")
    assert gm.fxprep_report.tracer == "dynamo"
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert not [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and m is not gm]
    functions = [m for m in gm.modules() if type(m).__name__ == "AutogradFunction"]
    assert len(functions) == 1
    fxprep.save(gm, tmp_path / "q")
    loaded = fxprep.load(tmp_path / "q", trusted_modules=(STE.__module__,))
    x = torch.randn(2, 4, requires_grad=True)
    loaded(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # round() alone would give zero gradients


def test_prepared_model_is_freed_after_use() -> None:
    """Dynamo keeps the backends it compiled with in a process-wide table; export's holds the graph
    and so the user's modules. A prepared model must not stay alive once the user drops it."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 8),), tracer="dynamo")
    assert gm.fxprep_report.tracer == "dynamo"
    weight = weakref.ref(model[0].weight)
    del model, gm
    gc.collect()
    assert weight() is None, [type(r).__name__ for r in gc.get_referrers(weight())]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_eager_and_sdpa_attention(attention: str) -> None:
    """Both attention implementations prepare on Dynamo: eager's softmax/matmul become modules,
    SDPA's fused call becomes one; the output is the same ModelOutput as the original's."""
    model = tiny_llama()
    model.config._attn_implementation = attention
    ex = llama_inputs()
    gm = fxprep.prepare_model(model, example_inputs=ex, tracer="dynamo")
    assert gm.fxprep_report.tracer == "dynamo" and gm.fxprep_report.verification.status == "passed"
    assert not remaining_compute_ops(gm)
    sdpa_calls = [n for n in gm.graph.nodes if n.op == "call_module" and "scaled_dot_product" in n.target]
    assert bool(sdpa_calls) == (attention == "sdpa"), [n.target for n in gm.graph.nodes if n.op == "call_module"]
    out = gm(**ex)
    assert type(out) is type(model(**ex, use_cache=False))
    torch.testing.assert_close(out.logits, model(**ex, use_cache=False).logits)


# --------------------------------------------------------------------------------------------------
# Regrouping without copies: what the eager run keeps of its tensors
# --------------------------------------------------------------------------------------------------
class BReadFirst(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return b * 2 - a  # reads b first: order of use would bind ``a`` to b


class PairUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = BReadFirst()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(x.sin(), x.cos())


@pytest.mark.parametrize("route", ROUTES)
def test_same_shaped_arguments_are_told_apart_by_value(route: str, force_route) -> None:
    """Two same-shaped arguments computed outside any leaf: identity cannot say which is which, the
    order the leaf reads them in says it wrong, so the values recorded in the eager run decide."""
    force_route(route)
    model = PairUser().eval()
    gm = fxprep.prepare_model(model, None, [BReadFirst], example_inputs=(torch.randn(3, 5),), tracer="dynamo")
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert not any("order of use" in n for n in report.notes)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "pair"]
    assert [getattr(a.target, "__name__", a.target) for a in call.args] == ["sin", "cos"]


def test_recorded_leaf_calls_hold_no_tensors() -> None:
    """The eager run keeps shapes, dtypes, fingerprints and identities, not copies of the values
    (cloning them cost a fifth of vit_b_16's parameter bytes in RAM)."""
    from torch.utils import _pytree as pytree

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls = record.record_calls(model, {id(m): m for m in model}, ExampleInputs((torch.randn(3, 4),), {}), dynamo_names.Names(model))
    recs = [rec for recs in calls.values() for rec in recs]
    assert len(recs) == 3
    leaves = pytree.tree_leaves([(rec.args, rec.kwargs, rec.output) for rec in recs])
    assert leaves and all(isinstance(leaf, record.TensorSpec) for leaf in leaves)
    relu = calls[id(model[1])][0]
    assert relu.arg_origin == [("call", (0, 0))]  # identity survives: ReLU reads the first Linear's output
    assert relu.args[0].shape == (3, 4) and relu.args[0].total is not None


def test_produced_tensor_ids_are_forgotten_when_the_tensor_dies() -> None:
    """Leaf outputs are not kept alive, so an id may be reused: the entry must go with its tensor."""
    import gc

    table: dict[int, Any] = {}
    t = torch.ones(2)
    table[id(t)] = (0, 0, record.forget_when_dead(t, table))
    assert id(t) in table
    del t
    gc.collect()
    assert table == {}


def test_fingerprint_tells_layouts_alike_and_values_apart() -> None:
    torch.manual_seed(0)
    for shape in [(), (1,), (7,), (3, 5), (4, 1, 6), (65, 3)]:
        t = torch.randn(shape)
        spec = record.TensorSpec.of(t)
        assert spec.same_values(record.TensorSpec.of(t.clone()))
        if t.dim() >= 2:
            assert spec.same_values(record.TensorSpec.of(t.mT.contiguous().mT))  # same values, other strides
        for i in range(t.numel()):  # any single changed element is seen, sampled or not
            changed = t.clone()
            changed.view(-1)[i] += 1.0
            assert not spec.same_values(record.TensorSpec.of(changed)), (shape, i)
        assert not spec.same_values(record.TensorSpec.of(t.double()))
    assert not record.TensorSpec.of(torch.empty(2, 2, device="meta")).same_values(record.TensorSpec.of(torch.zeros(2, 2)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        return x + y


@pytest.mark.skipif(not D.flag_available(), reason="this torch has no install_free_tensors_for_export flag")
def test_flag_route_keeps_attention_without_an_eager_run(force_route, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the flag route Dynamo emits MultiheadAttention as one call_module, but files the getitem
    unpacking its output under the attention's own stack: that is still one call, and must not
    cost an eager recording run (a whole extra forward on vit_b_16)."""
    force_route("flag")
    recorded: list[int] = []
    real = regroup.record_calls
    monkeypatch.setattr(regroup, "record_calls", lambda *a, **k: recorded.append(1) or real(*a, **k))
    model = Attention().eval()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 5, 16),), tracer="dynamo")
    assert gm.fxprep_report.verification.status == "passed" and gm.meta[D.ROUTE_META] == "flag"
    assert recorded == []
    assert targets(gm)[:2] == ["ln", "attn"] and gm.get_submodule("attn") is model.attn
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "attn"]
    assert call.kwargs.get("need_weights") is False
    for user in call.users:  # the unpacking belongs to the caller, not inside the attention
        assert not any("attn" in str(k) for k in user.meta.get("nn_module_stack", {})), user.meta["nn_module_stack"]


def _with_defaults(func):
    """transformers' pattern (merge_with_config_defaults, then select_hidden_states): a default
    written into the decorated forward's ``**kwargs``, then ``inspect.Signature.bind``."""
    import functools
    import inspect

    signature = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("scale") is None:
            kwargs["scale"] = 2.0  # the config's value
        bound = signature.bind(self, *args, **kwargs)
        return func(*bound.args, **bound.kwargs)

    return wrapper


class KwargsDefaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @_with_defaults
    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return self.lin(x) * scale


def test_a_forward_writing_into_its_kwargs_then_binding_a_signature_is_captured() -> None:
    """Traced as the root, the forward's ``**kwargs`` is an input dict to Dynamo, and after its
    mutation Dynamo refuses the mappingproxy ``Signature.bind`` reads (Mistral3's vision features
    were opaque for it): fxprep traces from a root whose kwargs are the trace's own."""
    from fxprep.capture.dynamo.export import MUTATED_INPUT_DICT, dynamo_export
    from fxprep.core.inputs import ExampleInputs

    torch.manual_seed(0)
    model = KwargsDefaults().eval()
    x = torch.randn(2, 4)
    with pytest.raises(Exception, match=MUTATED_INPUT_DICT):  # noqa: B017, PT011 - what plain Dynamo says
        dynamo_export(model, ExampleInputs((), {"x": x}), "flag", None)
    gm = fxprep.prepare_model(model, example_inputs={"x": x})
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed" and not report.leaves
    assert gm.get_submodule("lin") is model.lin
    assert "forward" not in vars(model)  # the root put in for the capture is gone
    torch.testing.assert_close(gm(x=x), model(x=x))


class KwargsDefaultsStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(4) for _ in range(3))

    @_with_defaults
    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * scale


def test_a_forward_writing_into_its_kwargs_keeps_dynamic_dimensions_and_block_reuse() -> None:
    # the root put in for the capture carries the forward's signature, to which Dynamo matches the
    # dynamic-shapes spec by parameter name; the outer capture of block reuse is traced from it too
    torch.manual_seed(0)
    model = KwargsDefaultsStack().eval()
    gm = fxprep.prepare_model(model, example_inputs={"x": torch.randn(2, 4)}, dynamic={"x": {0: "batch"}})
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed" and not report.leaves
    assert {k: v for k, v in report.reuse["captured"].items() if v} == {"blocks.0": ["blocks.1", "blocks.2"]}
    assert "forward" not in vars(model)
    for batch in (1, 5):
        y = torch.randn(batch, 4)
        torch.testing.assert_close(gm(x=y), model(x=y))
