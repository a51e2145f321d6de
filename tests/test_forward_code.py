"""The prepared forward reaches submodules by dict reads, and stays live when toolkits swap modules.

The speed itself is measured in ``benchmarks/scale_bench.py``; here the mechanism it rests on is
counted (``nn.Module.__getattr__`` calls per forward, the cost the rewrite removes), and every way a
toolkit replaces a module is checked to reach the new one, as fx's own code would.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torchvision
from torch import nn

import fxprep


@contextmanager
def count_getattr() -> Iterator[list[str]]:
    """Every ``nn.Module.__getattr__`` call made inside the block, by name."""
    calls: list[str] = []
    original = nn.Module.__getattr__

    def counting(self: nn.Module, name: str) -> Any:
        calls.append(name)
        return original(self, name)

    nn.Module.__getattr__ = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        nn.Module.__getattr__ = original  # type: ignore[method-assign]


def _resnet() -> tuple[nn.Module, torch.Tensor, fx.GraphModule]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    return model, x, fxprep.prepare_model(model, example_inputs=x)


def test_forward_reaches_leaves_without_module_getattr() -> None:
    model, x, gm = _resnet()
    with torch.no_grad(), count_getattr() as eager:
        want = model(x)
    with torch.no_grad(), count_getattr() as prepared:
        got = gm(x)
    assert torch.equal(got, want)
    # eager resnet18 reaches each child from its parent (~70 lookups); fx's chains from the root cost
    # ~200; the rewritten forward none for modules (the leaves' own forwards still read their weights)
    leaf_reads = [n for n in prepared if n not in ("weight", "bias", "running_mean", "running_var")]
    assert leaf_reads == [], leaf_reads[:10]
    assert len(prepared) < len(eager)
    # what people read is still fx's code
    assert "getattr(self.layer1, \"0\").conv1(" in gm.code and "_modules" not in gm.code


def test_copies_and_pickles_keep_the_fast_forward() -> None:
    _, x, gm = _resnet()
    with torch.no_grad():
        want = gm(x)
    for twin in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        with torch.no_grad(), count_getattr() as calls:
            assert torch.equal(twin(x), want)
        assert "conv1" not in calls and "layer1" not in calls


class Marker(nn.Module):
    """A wrapper that forwards attribute access to what it wraps, as AIMET's ONNX markers do."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args: Any) -> Any:
        self.calls += 1
        return self.inner(*args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class Double(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_swapped_modules_are_the_ones_called() -> None:
    _, x, gm = _resnet()
    with torch.no_grad():
        base = gm(x)
        # 1. setattr on a container (AIMET's QuantSim wrappers, torch.ao's swap_module)
        conv = gm.get_submodule("layer1.0.conv2")
        gm.get_submodule("layer1.0").conv2 = Double(conv)
        swapped = gm(x)
        reference = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # fx's own code on the same modules
        assert torch.equal(swapped, reference(x)) and not torch.equal(swapped, base)
        # 2. a direct write into _modules (torch.ao's convert)
        gm.get_submodule("layer1.0")._modules["conv2"] = conv
        assert torch.equal(gm(x), base)
        # 3. a container replaced by a wrapper that forwards attribute access (AIMET's ONNX export)
        marker = Marker(gm.layer1)
        gm.layer1 = marker
        assert torch.equal(gm(x), base)
        assert torch.equal(fx.GraphModule(gm, copy.deepcopy(gm.graph))(x), base)
        # 4. add_module after a graph edit and recompile
        gm.add_submodule("layer2.0.extra", nn.Identity())
        node = next(n for n in gm.graph.nodes if n.target == "layer2.0.conv1")
        with gm.graph.inserting_after(node):
            extra = gm.graph.call_module("layer2.0.extra", (node,))
        node.replace_all_uses_with(extra, delete_user_cb=lambda user: user is not extra)
        gm.recompile()
        assert torch.equal(gm(x), base)
        assert any(n.target == "layer2.0.extra" for n in gm.graph.nodes)
