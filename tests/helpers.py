"""Checks and fixtures shared by the test files: what every prepared module must satisfy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxprep.passes.functional_to_module import remaining_compute_ops


def module_snapshot(model: nn.Module) -> dict:
    """Everything prepare_model must leave untouched: tree, tensors, hooks, modes."""
    return {
        "tree": [(n, type(m), id(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "tensor_ids": {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        "hooks": [(n, list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()],
        "modes": [(n, m.training) for n, m in model.named_modules()],
        "attrs": {n: sorted(m.__dict__) for n, m in model.named_modules()},
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = module_snapshot(model)
    assert after["tree"] == before["tree"]
    assert after["tensor_ids"] == before["tensor_ids"]
    assert after["hooks"] == before["hooks"]
    assert after["modes"] == before["modes"]
    assert after["attrs"] == before["attrs"]
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k


def calls_per_module(gm: fx.GraphModule) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            key = id(gm.get_submodule(node.target))
            counts[key] = counts.get(key, 0) + 1
    return counts


def assert_clean(gm: fx.GraphModule, model: nn.Module) -> None:
    """The invariants of a prepared module: modules only, one call each, weights shared."""
    left = remaining_compute_ops(gm)
    assert not left, [(n.name, n.target) for n in left]
    assert all(c == 1 for c in calls_per_module(gm).values()), "a module is called twice"
    original = dict(model.named_parameters(remove_duplicate=False))
    for name, p in original.items():
        assert gm.get_parameter(name) is p, name
    original_ids = {id(p) for p in model.parameters()}
    assert all(id(p) in original_ids for p in gm.parameters()), "a parameter was copied"
    assert list(gm.state_dict()) == list(model.state_dict()) or set(gm.state_dict()) == set(model.state_dict())
    gm.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(gm.state_dict(), strict=True)


def fresh_like(*tensors: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in tensors)


class STE(torch.autograd.Function):
    """Straight-through rounding: forward rounds, backward passes the gradient unchanged (the
    quantization-aware-training pattern a custom autograd.Function exists for)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


# ViTs take their image size as an argument: a few patches instead of 224x224 (vit_h_14: 632M params).
# torchvision models of 100M parameters or more. Prepared, verified, saved and loaded, one needs up to
# ~10 GB (weights, the verification runs, the saved copy and the loaded one), so two at once exhaust
# a 24 GB machine: their zoo cases are marked ``serial`` and `make test-zoo` runs them one at a time.
BIG_TORCHVISION = frozenset({
    "vit_h_14", "vit_l_16", "vit_l_32", "convnext_large", "regnet_y_128gf", "regnet_y_32gf", "regnet_x_32gf",
    "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
    "wide_resnet101_2", "efficientnet_v2_l",
})


def zoo_params(names: list[str]) -> list[Any]:
    """``names`` for ``parametrize``, the models in :data:`BIG_TORCHVISION` marked ``serial``."""
    return [pytest.param(n, marks=pytest.mark.serial) if n in BIG_TORCHVISION else n for n in names]


TV_VIT_KWARGS: dict[str, dict[str, Any]] = {
    "vit_b_16": {"image_size": 32},
    "vit_b_32": {"image_size": 64},
    "vit_l_16": {"image_size": 32},
    "vit_l_32": {"image_size": 64},
    "vit_h_14": {"image_size": 28},
}


def with_batchnorm_statistics(model: torch.nn.Module, shape: tuple[int, ...]) -> torch.nn.Module:
    """``model`` in eval mode with BatchNorm statistics of random inputs shaped like ``shape``.

    Randomly initialised networks with BatchNorm at its initial statistics can output ~1e-10
    everywhere (mobilenet_v2/v3): a quantization error measured on that means nothing."""
    model.train()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, *shape[1:], generator=gen))
    return model.eval()


class ResidualBlock(nn.Module):
    """Linear, LayerNorm and a residual: the smallest block that block reuse stamps out.
    ``by_rows``: the result is reshaped by its rows before the residual, so a graph of it follows
    (or, captured static, fixes) the number of rows it is given."""

    def __init__(self, features: int, by_rows: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features)
        self.by_rows = by_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.lin(x))
        if self.by_rows:
            y = y.reshape(x.shape[0], 2, -1).flatten(1)
        return y + x


# --- quantization toolkits (tests/test_aimet_handoff.py, test_torch_ao.py, toolkit_cases.py) ------
QUANT = {"default_output_bw": 8, "default_param_bw": 8}  # AIMET QuantSim: 8-bit activations and weights
ENGINE = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"  # torch.ao's backend


def _float(out):
    """The first tensor of an output (QuantSim returns AIMET's dequantized tensors)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    return out.dequantize() if hasattr(out, "dequantize") else out


@dataclass
class DynamoTrace:
    """One Dynamo trace seen by :func:`dynamo_traces`: the traced module's class, whether Dynamo's
    fake-tensor cache was on as it started, and how it ended ("ok" or its error's first line)."""

    module: str
    cache: bool
    outcome: str = "running"


def dynamo_traces(monkeypatch: pytest.MonkeyPatch) -> list[DynamoTrace]:
    """Each Dynamo trace (a run of what ``torch._dynamo.export`` returns) from now on, appended as it
    starts: a spy that calls through, so the capture is the one fxprep makes."""
    traces: list[DynamoTrace] = []
    real = torch._dynamo.export

    def export(f: Any, *args: Any, **kwargs: Any) -> Any:
        inner = real(f, *args, **kwargs)

        def run(*a: Any, **k: Any) -> Any:
            trace = DynamoTrace(type(getattr(f, "__self__", f)).__name__,
                                bool(torch._dynamo.config.fake_tensor_cache_enabled))
            traces.append(trace)
            try:
                out = inner(*a, **k)
            except Exception as err:
                trace.outcome = str(err).split("\n", 1)[0]
                raise
            trace.outcome = "ok"
            return out

        return run

    monkeypatch.setattr(torch._dynamo, "export", export)
    return traces
