"""Hand-off to quantization: why the graph is made of modules.

A quantization toolkit attaches quantizers to modules. After ``prepare_model`` every activation and
element-wise op is a module, so "wrap every call_module output with a fake-quantizer" covers every
activation of the network; on a plain ``torch.fx.symbolic_trace`` the same rule misses the
functional ReLUs and adds. The prepared graph also goes through torch's own FX quantization flow.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithElementwiseAddOp, ModelWithFunctionalReLU, ModelWithReusedReLU
from fxprep.passes.functional_to_module import is_allowed_functional, remaining_compute_ops


class FakeQuant(nn.Module):
    """8-bit per-tensor affine fake quantization of one activation, calibrated by min/max."""

    def __init__(self):
        super().__init__()
        self.register_buffer("lo", torch.tensor(0.0))
        self.register_buffer("hi", torch.tensor(0.0))
        self.calibrating = True

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x  # tuples (max-pool indices), integer tensors: nothing to quantize
        if self.calibrating:
            self.lo = torch.minimum(self.lo, x.detach().min())
            self.hi = torch.maximum(self.hi, x.detach().max())
            return x
        scale = max(float(self.hi - self.lo) / 255.0, 1e-8)
        zero_point = int(min(max(round(-float(self.lo) / scale), 0), 255))
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 255)


def insert_fake_quant(gm: fx.GraphModule) -> list[str]:
    """After every ``call_module`` node, a FakeQuant that all of the node's users now read."""
    added = []
    for i, node in enumerate(list(gm.graph.nodes)):
        if node.op != "call_module":
            continue
        name = f"fq_{i}_{str(node.target).replace('.', '_')}"
        gm.add_submodule(name, FakeQuant())
        with gm.graph.inserting_after(node):
            fq = gm.graph.call_module(name, (node,))
        node.replace_all_uses_with(fq, delete_user_cb=lambda user, fq=fq: user is not fq)
        added.append(name)
    gm.recompile()
    return added


def uncovered_compute(gm: fx.GraphModule) -> list[str]:
    """Tensor-computing nodes whose output reaches the rest of the graph without a quantizer."""
    out = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and not is_allowed_functional(node):
            out.append(f"{node.op}:{getattr(node.target, '__name__', node.target)}")
        if node.op == "call_module" and not isinstance(gm.get_submodule(node.target), FakeQuant):
            users = list(node.users)
            if not (len(users) == 1 and users[0].op == "call_module" and isinstance(gm.get_submodule(users[0].target), FakeQuant)):
                out.append(f"module:{node.target}")
    return out


def fake_quantized(gm: fx.GraphModule, calibration: list[tuple[torch.Tensor, ...]]) -> fx.GraphModule:
    gm = copy.deepcopy(gm)
    insert_fake_quant(gm)
    with torch.no_grad():
        for args in calibration:
            gm(*args)
    for m in gm.modules():
        if isinstance(m, FakeQuant):
            m.calibrating = False
    return gm


class Attention(nn.Module):
    """Element-wise ops, matmuls, softmax, a functional layer norm on the module's own weights."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.norm_w = nn.Parameter(torch.ones(16))
        self.norm_b = nn.Parameter(torch.zeros(16))
        self.scale = 0.25

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        y = torch.cat([att @ v, x], dim=-1)[..., :16] + x
        y = F.layer_norm(y, (16,), self.norm_w, self.norm_b)
        return F.gelu(y) * torch.sigmoid(y)


def _cases():
    torch.manual_seed(0)
    cases = [
        (ModelWithFunctionalReLU().eval(), lambda: (torch.randn(1, 3, 32, 32),)),
        (ModelWithReusedReLU().eval(), lambda: (torch.randn(1, 3, 32, 32),)),
        (ModelWithElementwiseAddOp().eval(), lambda: (torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32))),
        (Attention().eval(), lambda: (torch.randn(2, 5, 16),)),
    ]
    try:
        import torchvision

        cases.append((torchvision.models.resnet18(weights=None).eval(), lambda: (torch.randn(1, 3, 64, 64),)))
    except ImportError:
        pass
    return cases


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model, make_inputs", _cases(), ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_module_level_fake_quant_covers_every_op(model, make_inputs):
    torch.manual_seed(0)  # the inputs, whatever ran before in this worker (the 0.1 bound is for these)
    gm = fxprep.prepare_model(model, example_inputs=make_inputs())
    assert remaining_compute_ops(gm) == []
    quantized = fake_quantized(gm, [make_inputs() for _ in range(4)])
    assert uncovered_compute(quantized) == []
    n_modules = sum(1 for n in gm.graph.nodes if n.op == "call_module")
    assert sum(isinstance(m, FakeQuant) for m in quantized.modules()) == n_modules
    x = make_inputs()
    with torch.no_grad():
        assert _rel_err(quantized(*x), model(*x)) < 0.1


def test_plain_fx_trace_leaves_ops_unquantized():
    """The counterfactual: the same rule on a plain symbolic trace misses functionals and adds."""
    model = ModelWithFunctionalReLU().eval()
    gm = fx.symbolic_trace(model)
    insert_fake_quant(gm)
    missed = uncovered_compute(gm)
    assert any("relu" in m for m in missed), missed
    traced_add = fx.symbolic_trace(ModelWithElementwiseAddOp().eval())
    insert_fake_quant(traced_add)
    assert any("add" in m for m in uncovered_compute(traced_add))


def test_reused_module_gets_one_quantizer_per_call():
    """Unrolling is what lets each call site of a reused ReLU keep its own statistics."""
    model = ModelWithReusedReLU().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32))
    quantized = fake_quantized(gm, [(torch.randn(1, 3, 32, 32),)])
    relu_ranges = {
        (float(m.lo), float(m.hi))
        for name, m in quantized.named_modules()
        if isinstance(m, FakeQuant) and "relu" in name
    }
    assert len(relu_ranges) == 4  # four call sites, four different calibrated ranges


def test_torch_ao_fx_quantization_accepts_the_prepared_graph():
    from torch.ao.quantization import get_default_qconfig_mapping, quantize_fx

    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
    model = ModelWithElementwiseAddOp().eval()
    x = (torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32))
    gm = fxprep.prepare_model(model, example_inputs=x)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(gm), get_default_qconfig_mapping(torch.backends.quantized.engine), x)
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32))
        prepared(*x)
    converted = quantize_fx.convert_fx(prepared)
    kinds = {type(m).__module__ for m in converted.modules()}
    assert any(k.startswith("torch.ao.nn.quantized") for k in kinds), kinds
    with torch.no_grad():
        assert _rel_err(converted(*x), model(*x)) < 0.1
    # the user's modules were not modified by torch's flow
    assert type(gm.conv1) is nn.Conv2d and gm.conv1 is model.conv1


class MaskedBlocks(nn.Module):
    """Writes into a tensor in place (``mask[:n, :n] = 0``, as Pixtral builds its block attention
    mask): fx generates that as a statement a re-trace's Proxy refuses."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[0] // 2
        mask = torch.full((x.shape[0], x.shape[0]), -2.0)
        mask[:n, :n] = 0
        mask[n:, n:] = 0
        return torch.softmax(self.proj(x) @ self.proj(x).T + mask, dim=-1) @ x


def test_torch_ao_retraces_a_graph_that_writes_into_a_tensor():
    from torch.ao.quantization import get_default_qconfig_mapping, quantize_fx

    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
    model = MaskedBlocks().eval()
    x = (torch.randn(6, 8),)
    # dynamic=False: shape-general (the batch free, the mask built from x.size(0)), torch.ao's prepare_fx
    # observes the mask where torch.full makes it, before the in-place writes, and its convert_fx then
    # adds a quantized copy of the unwritten mask (relative error 0.38): torch.ao's limit with tensors
    # written in place, not fxprep's graph, which matches the model at batch 9. Static, the mask is a
    # constant torch.ao folds.
    gm = fxprep.prepare_model(model, example_inputs=x, dynamic=False)
    assert gm.fxprep_report.tracer == "dynamo"
    assert any(n.op == "call_method" and n.target == "__setitem__" for n in gm.graph.nodes)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(gm), get_default_qconfig_mapping(torch.backends.quantized.engine), x)
    with torch.no_grad():
        prepared(*x)
    converted = quantize_fx.convert_fx(prepared)
    with torch.no_grad():
        assert _rel_err(converted(*x), model(*x)) < 0.1
