"""torch's own quantization flows on prepared graphs: FX graph mode (torch.ao) and PT2E (torchao).

FX graph mode must quantize at least what it quantizes on a plain ``torch.fx.symbolic_trace`` of the
same model: turning ``x + y`` into an ``fxprep.ops.Add`` module must not hide the add from it.
PT2E takes ``fxprep.export_program(...).module()``, and a quantizer configured by module name must
find the user's qualified names there.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torchvision
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

import fxprep
from fxprep import ops
from fxprep.passes import to_functional

from .helpers import ENGINE, with_batchnorm_statistics


def quantized_ops(gm: fx.GraphModule) -> int:
    """Ops that run quantized after ``convert_fx``: quantized modules and ``torch.ops.quantized`` calls."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and type(gm.get_submodule(node.target)).__module__.startswith("torch.ao.nn.quantized"):
            count += 1
        elif node.op == "call_function" and str(node.target).startswith("quantized."):
            count += 1
    return count


def fx_quantize(model: torch.nn.Module, x: torch.Tensor) -> fx.GraphModule:
    torch.backends.quantized.engine = ENGINE
    prepared = prepare_fx(model, get_default_qconfig_mapping(ENGINE), (x,))
    with torch.no_grad():
        for seed in range(2):
            prepared(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
    return convert_fx(prepared)


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (1, 3, 64, 64)),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(weights=None), (1, 3, 64, 64)),
}


def _fx_mode_case(name: str, build, shape) -> None:
    from fxprep.cli.specs import revive_zero_weights

    torch.manual_seed(0)
    model = with_batchnorm_statistics(build(), shape)
    revive_zero_weights(model)  # torchvision's ViT head starts at zero: every output would be 0
    x = torch.randn(*shape)
    traced = fx_quantize(fx.symbolic_trace(model), x)
    baseline = quantized_ops(traced)
    gm = fxprep.prepare_model(model, example_inputs=x)
    ours = fx_quantize(copy.deepcopy(gm), x)
    functional = fx_quantize(to_functional.run(copy.deepcopy(gm)), x)
    print(f"{name}: quantized ops symbolic_trace {baseline}, fxprep {quantized_ops(ours)}, "
          f"fxprep + to_functional {quantized_ops(functional)}")
    assert quantized_ops(ours) >= baseline > 0
    assert quantized_ops(functional) >= baseline
    with torch.no_grad():
        reference = model(x)

        def error(converted: fx.GraphModule) -> float:
            return float((converted(x) - reference).norm() / reference.norm())

        # as accurate as torch.ao is on its own trace (8-bit ViT with random weights is not accurate)
        bound = max(0.2, 1.05 * error(traced))
        assert error(ours) <= bound and error(functional) <= bound, (error(traced), error(ours), error(functional))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fx_mode_quantizes_what_symbolic_trace_does(name):
    _fx_mode_case(name, *MODELS[name])


@pytest.mark.zoo
def test_fx_mode_on_vit_b_16():
    _fx_mode_case("vit_b_16", lambda: torchvision.models.vit_b_16(weights=None), (1, 3, 224, 224))


def test_to_functional_turns_op_modules_back_into_the_calls_they_make():
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    with torch.no_grad():
        expected = gm(x)
    functional = to_functional.run(gm)
    assert not [m for m in functional.modules() if isinstance(m, ops.BoundOp)]
    assert any(n.op == "call_function" and n.target in (operator.add, operator.iadd) for n in functional.graph.nodes)
    assert functional.get_submodule("layer1.0.conv1") is model.layer1[0].conv1  # the user's layers stay
    with torch.no_grad():
        assert torch.equal(functional(x), expected)


def _pt2e(gm: fx.GraphModule, x: torch.Tensor, configure) -> fx.GraphModule:
    program = fxprep.export_program(gm, x)
    quantizer = x86.X86InductorQuantizer()
    configure(quantizer)
    prepared = prepare_pt2e(program.module(), quantizer)
    with torch.no_grad():
        prepared(x)
    return convert_pt2e(prepared)


def _quantized_convs(gm: fx.GraphModule) -> list[str]:
    """Module paths of the convolutions that read a dequantized input."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "conv2d" in str(node.target):
            source = node.args[0]
            if isinstance(source, fx.Node) and "dequantize" in str(source.target):
                stack = node.meta.get("nn_module_stack") or {}
                out.append(list(stack.values())[-1][0] if stack else "?")
    return out


def test_pt2e_quantizes_the_exported_program():
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x)
    config = x86.get_default_x86_inductor_quantization_config()
    converted = _pt2e(gm, x, lambda q: q.set_global(config))
    assert len(_quantized_convs(converted)) == 20  # every convolution of resnet18
    with torch.no_grad():
        reference = model(x)
        assert float((converted(x) - reference).norm() / reference.norm()) < 0.2


def test_pt2e_module_name_config_finds_the_users_qualified_names():
    """set_module_name_qconfig("layer1.0.conv1") quantizes that conv and nothing else."""
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x)
    config = x86.get_default_x86_inductor_quantization_config()
    converted = _pt2e(gm, x, lambda q: q.set_module_name_qconfig("layer1.0.conv1", config))
    assert _quantized_convs(converted) == ["layer1.0.conv1"]
