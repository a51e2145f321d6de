"""A user's own hooks on a model's layers (activation statistics, a scaling experiment): the hooked
layer is one ``call_module`` of the user's module, its hooks run in the prepared module as they do
eagerly, and the rest of the model keeps what a model without hooks gets (shape-general capture,
block reuse for the layers without hooks). Hooks on the model itself run around its forward, as
fx and Dynamo see it: the prepared module runs them the same way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxprep
from tests.helpers_reuse import _stamped, hf


def _scaled(module: nn.Module, args: Any, out: Any) -> Any:
    return out * 2 if isinstance(out, torch.Tensor) else (out[0] * 2, *out[1:])


def _halved(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return (args[0] * 0.5, *args[1:]), kwargs


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.encoder.layer


def _call_modules(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "bert"])
def test_an_observing_hook_on_one_layer_keeps_reuse_and_shape_general(model_type: str) -> None:
    # the layer is called with arguments it never reads in the graph (a decoder layer's position_ids):
    # they are tied by value, the values coming from a run of the outer graph with the reused blocks in it
    model, _ = hf(model_type, layers=4)
    model.eval()
    layers = _layers(model)
    hooked = next(name for name, m in model.named_modules() if m is layers[1])
    calls: list[tuple[int, ...]] = []
    layers[1].register_forward_hook(lambda m, a, out: calls.append(tuple((out[0] if isinstance(out, tuple) else out).shape)))
    example = {"input_ids": torch.randint(0, 99, (1, 8))}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = fxprep.get_report(gm)
    assert hooked in _call_modules(gm)
    assert not any(t.startswith(f"{hooked}.") for t in _call_modules(gm))
    stamped = _stamped(report.reuse)
    assert stamped and hooked not in stamped and not any(hooked in v for v in stamped.values())
    assert any(n.startswith("Shape-general: the dimensions") for n in report.notes), report.notes
    ids = torch.randint(0, 99, (3, 13))
    calls.clear()
    with torch.no_grad():
        got = gm(input_ids=ids)[0]
        assert calls == [(3, 13, model.config.hidden_size)]  # the hook ran, once, at the new size
        want = model(input_ids=ids)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hooks_that_change_a_layer_s_input_and_output_act_in_the_prepared_module(dtype: torch.dtype) -> None:
    model, _ = hf("llama", layers=4)
    model = model.eval().to(dtype)
    layers = _layers(model)
    for layer in layers:  # every layer hooked: no block left to reuse, each layer one call
        layer.register_forward_hook(_scaled)
    layers[2].register_forward_pre_hook(_halved, with_kwargs=True)
    example = {"input_ids": torch.randint(0, 99, (2, 8))}
    gm = fxprep.prepare_model(model, example_inputs=example)
    assert all(f"model.layers.{i}" in _call_modules(gm) for i in range(4))
    ids = torch.randint(0, 99, (1, 11))
    with torch.no_grad():
        got = gm(input_ids=ids).logits
        want = model(input_ids=ids).logits
        for layer in layers:
            layer._forward_hooks.clear()
            layer._forward_pre_hooks.clear()
        without = model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, without)  # the hooks did change the result


# --- hooks on the model itself ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_s_own_hooks_run_around_the_prepared_graph(dtype: torch.dtype, tmp_path: Any) -> None:
    # fx and Dynamo trace forward(): a hook on the model is in no graph. Left on during preparing, a
    # hook changing the output made verification fail; now the prepared module runs the hooks itself
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval().to(dtype)
    seen: list[tuple[int, ...]] = []
    observer = model.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    model.register_forward_hook(lambda m, args, out: out * 2 + 1)
    x = torch.randn(1, 3, 64, 64, dtype=dtype)
    gm = fxprep.prepare_model(model, example_inputs=x)
    assert seen == []  # preparing ran the forward alone
    assert any("The model's own hooks (1 pre-forward, 1 forward)" in n for n in fxprep.get_report(gm).notes)
    y = torch.randn(2, 3, 64, 64, dtype=dtype)
    with torch.no_grad():
        got, want = gm(y), model(y)
    assert torch.equal(got, want) and seen == [(2, 3, 64, 64)] * 2
    observer.remove()  # the user's handle still works on the model; the prepared module keeps its copy
    with torch.no_grad():
        model(y)
        gm(y)
    assert seen == [(2, 3, 64, 64)] * 3
    with pytest.raises(fxprep.SerializationError, match="hooks"):
        fxprep.save(gm, tmp_path / "hooked")


def test_a_keyword_pre_hook_on_a_transformers_model_no_longer_stops_the_capture() -> None:
    # a pre-forward hook taking keyword arguments made Dynamo's whole-graph export fail
    # ("whole graph export entails exactly one guard export"); fx cannot trace the decorated forward
    model, _ = hf("llama", layers=3)
    model.eval()

    def no_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args, {**kwargs, "attention_mask": torch.ones_like(kwargs["attention_mask"])}

    model.register_forward_pre_hook(no_mask, with_kwargs=True)
    ids = torch.randint(0, 99, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :5] = 0  # a mask the hook replaces: ignoring the hook changes row 1
    assert fxprep.check_traceability(model, example_inputs={"input_ids": ids, "attention_mask": mask}).traceable
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids, "attention_mask": mask})
    assert fxprep.get_report(gm).tracer == "dynamo"
    with torch.no_grad():
        got = gm(input_ids=ids, attention_mask=mask).logits
        want = model(input_ids=ids, attention_mask=mask).logits
        masked = model.forward(input_ids=ids, attention_mask=mask).logits  # no hook
    assert torch.equal(got, want) and not torch.equal(got, masked)


def test_one_collector_closure_per_linear_keeps_the_layers_reused() -> None:
    # Dynamo guards each leaf's hooks by identity: one closure per layer (make_hook(name)) kept every
    # layer from being stamped out. Hooks running the same code are the same to the graph (each
    # instance's own Linear is called, with its own hooks); a hook running other code is not
    model, _ = hf("llama", layers=4)
    model.eval()
    counts: dict[str, int] = {}

    def make_hook(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            counts[name] = counts.get(name, 0) + 1
        return hook

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name}
    for name, linear in linears.items():
        linear.register_forward_hook(make_hook(name))
    model.model.layers[2].mlp.down_proj.register_forward_hook(lambda m, args, out: out * 0)  # other code
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 99, (1, 8))})
    report = fxprep.get_report(gm)
    stamped = _stamped(report.reuse)
    assert stamped == {"model.layers.0": ["model.layers.1", "model.layers.3"]}, report.reuse
    assert "mlp.down_proj._forward_hooks (hooks running other code" in report.reuse["why"]["model.layers.2"]
    ids = torch.randint(0, 99, (2, 5))
    counts.clear()
    with torch.no_grad():
        got = gm(input_ids=ids).logits
        assert counts == dict.fromkeys(linears, 1)  # each Linear's own hook, once
        want = model(input_ids=ids).logits
    assert torch.equal(got, want)


def test_a_global_module_hook_is_set_aside_while_preparing() -> None:
    # register_module_forward_hook (a profiler's) made Dynamo's export fail like a keyword pre-hook
    from torch.nn.modules.module import register_module_forward_hook

    model, _ = hf("llama", layers=3)
    model.eval()
    seen: list[type] = []
    handle = register_module_forward_hook(lambda m, args, out: seen.append(type(m)))
    try:
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 99, (1, 8))})
        report = fxprep.get_report(gm)
        assert report.tracer == "dynamo" and _stamped(report.reuse)
        assert any(n.startswith("1 global module hook(s)") for n in report.notes)
        assert seen == []  # set aside while preparing
        ids = torch.randint(0, 99, (2, 5))
        with torch.no_grad():
            got = gm(input_ids=ids).logits
            assert nn.Linear in seen  # back afterwards, for the prepared module's calls too
            want = model(input_ids=ids).logits
        assert torch.equal(got, want)
        handle.remove()  # the user's handle still removes it
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids)
        assert seen == []
    finally:
        handle.remove()
