"""The prepared forward reaches submodules by dict reads, and stays live when toolkits swap modules.

The speed itself is measured in ``benchmarks/scale_bench.py``; here the mechanism it rests on is
counted (``nn.Module.__getattr__`` calls per forward, the cost the rewrite removes), and every way a
toolkit replaces a module is checked to reach the new one, as fx's own code would.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.fx as fx
import torchvision
from torch import nn

import fxprep
from fxprep.ops import BoundOp


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


# --- modules called without nn.Module.__call__'s frames -----------------------------------------

@contextmanager
def module_calls(only: type = nn.Module) -> Iterator[list[str]]:
    """The modules (of class ``only``) that went through ``nn.Module._call_impl`` inside the block."""
    calls: list[str] = []
    impl = nn.Module._call_impl.__code__

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is impl and isinstance(frame.f_locals.get("self"), only):
            calls.append(type(frame.f_locals["self"]).__name__)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _reference(gm: fx.GraphModule) -> fx.GraphModule:
    """fx's own code over the same modules (every call through ``nn.Module.__call__``)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def test_modules_skip_module_call_when_nothing_would_run_there() -> None:
    model, x, gm = _resnet()
    assert sum(isinstance(m, BoundOp) for m in gm.modules()) == 8  # the residual adds
    with torch.no_grad(), module_calls() as calls:
        got = gm(x)
    assert calls == [type(gm).__name__]  # the prepared module's own call; no leaf, no op module
    with torch.no_grad(), module_calls() as calls:
        want = _reference(gm)(x)
    assert calls.count("Add") == 8 and calls.count("Conv2d") == 20
    assert torch.equal(got, want) and torch.equal(got, model(x))


def test_hooks_on_leaves_take_the_module_call() -> None:
    _, x, gm = _resnet()
    conv = gm.get_submodule("layer1.0.conv1")
    with torch.no_grad():
        base = gm(x)
        handle = conv.register_forward_hook(lambda m, a, out: out * 2)
        with module_calls(nn.Conv2d) as calls:
            got = gm(x)
        assert calls == ["Conv2d"] and torch.equal(got, _reference(gm)(x)) and not torch.equal(got, base)
        handle.remove()
        assert torch.equal(gm(x), base)


class Subtract(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


def _double_second(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0], args[1] * 2)


def test_hooks_and_patches_on_op_modules_take_the_module_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a toolkit changes what an op module's call does is honoured: the prepared forward
    computes what fx's code computes over the same modules, and the call goes through ``__call__``."""
    _, x, gm = _resnet()
    op = gm.get_submodule("layer2.1.add")
    with torch.no_grad():
        base = gm(x)

    def check(expect_changed: bool = True, called: int = 1) -> None:
        with torch.no_grad(), module_calls(BoundOp) as calls:
            got = gm(x)
        with torch.no_grad():
            assert torch.equal(got, _reference(gm)(x))
        assert calls == ["Add"] * called
        assert not torch.equal(got, base) if expect_changed else torch.equal(got, base)

    seen: list[str] = []
    for register in (op.register_forward_pre_hook, op.register_forward_hook):
        hook = (lambda m, a: _double_second(m, a)) if register == op.register_forward_pre_hook else (lambda m, a, out: out * 2)
        handle = register(hook)
        check()
        handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    check(expect_changed=False, called=8)  # a global hook: every op module's call
    handle.remove()
    assert "Add" in seen
    handle = op.register_full_backward_hook(lambda m, gi, go: None)
    check(expect_changed=False)
    handle.remove()
    # a forward replaced on the instance, on the class (all eight adds): that forward is called, as
    # nn.Module.__call__ would (without its frames); a compiled call (Module.compile()) takes __call__
    with monkeypatch.context() as patch:
        patch.setitem(op.__dict__, "forward", lambda a, b: a + 2 * b)
        check(called=0)
    with monkeypatch.context() as patch:
        patch.setattr(type(op), "forward", lambda self, a, b: a - b)
        check(called=0)
    with monkeypatch.context() as patch:
        patch.setattr(op, "_compiled_call_impl", lambda a, b: op._call_impl(a, 2 * b))
        check()
    with torch.no_grad(), module_calls(BoundOp) as calls:
        assert torch.equal(gm(x), base)
    assert calls == []
    # swapped for a module that is no op module: a scripted one (reading its class's forward raises)
    gm.get_submodule("layer2.1")._modules["add"] = torch.jit.script(Subtract())
    check(called=0)


def test_tracers_and_compilers_see_op_modules_called() -> None:
    """fx re-tracing, torch.jit.trace (AIMET's connected graph), torch.export and torch.compile
    see each op module's call as they do in fx's code."""
    _, x, gm = _resnet()
    adds = [n for n, m in gm.named_modules() if isinstance(m, BoundOp)]
    class OpLeaves(fx.Tracer):  # what AIMET, torch.ao and NNCF's fx tracers do with modules they know
        def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
            return isinstance(m, BoundOp) or super().is_leaf_module(m, qualified_name)

    graph = OpLeaves().trace(gm)
    assert [n.target for n in graph.nodes if n.op == "call_module" and n.target in adds] == adds
    assert str(fx.symbolic_trace(gm).graph) == str(fx.symbolic_trace(_reference(gm)).graph)
    with torch.no_grad():
        scopes = {n.scopeName() for n in torch.jit.trace(gm, x).inlined_graph.nodes()}
    assert {f"__module.{name}" for name in adds} <= scopes
    exported = torch.export.export(gm, (x,), strict=True)
    stacks = [list(n.meta.get("nn_module_stack", {}).values()) for n in exported.graph.nodes]
    assert {name for name in adds} <= {path for stack in stacks for path, _ in stack}
    graphs: list[fx.GraphModule] = []

    def backend(g: fx.GraphModule, inputs: Any) -> Any:
        graphs.append(g)
        return g.forward

    torch._dynamo.reset()
    compiled = torch.compile(gm, backend=backend)
    with torch.no_grad():
        for _ in range(2):  # no guard of the fast path fails between calls: compiled once
            assert torch.equal(compiled(x), gm(x))
    assert len(graphs) == 1
    dynamo_paths = {str(v[0]) for n in graphs[0].graph.nodes for v in (n.meta.get("nn_module_stack") or {}).values()}
    assert all(any(p.endswith(name) for p in dynamo_paths) for name in adds)


def test_each_module_on_the_way_is_looked_up_once_per_call() -> None:
    """A parent module is bound to a local by the first line under it: every later lookup is one step."""
    model, x, gm = _resnet()
    namespace = type(gm).forward.__globals__
    original = namespace["_fxprep_child"]
    steps: list[int] = []

    def counting(parent: Any, names: tuple[str, ...]) -> Any:
        steps.append(len(names))
        return original(parent, names)

    namespace["_fxprep_child"] = counting
    try:
        with torch.no_grad():
            assert torch.equal(gm(x), model(x))
    finally:
        namespace["_fxprep_child"] = original
    # resnet18: the 4 layers, their 8 blocks and 3 downsample containers bound once each
    assert set(steps) == {1} and len(steps) > 60


class Collide(nn.Module):
    """A value named like a local of the rewritten forward (Dynamo names nodes after variables)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _fxprep_m0 = self.block[0](x)
        y = self.lin(_fxprep_m0)
        return self.block[1](y) + torch.sigmoid(y)


def test_a_node_named_like_the_rewrites_locals_keeps_fxs_code() -> None:
    torch.manual_seed(0)
    model = Collide().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x)
    assert "_fxprep_m0" in [n.name for n in gm.graph.nodes]
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
