"""Opaque parts on the Dynamo path (``fxprep.capture.dynamo.opaque`` and ``.fallback``).

An excluded module is one ``call_module`` Dynamo never traces into, whatever its forward does; when
Dynamo fails, the smallest enclosing part is made opaque and Dynamo captures the rest; a condition on
a shape is specialised by Dynamo, never made opaque.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

import fxprep
from fxprep.reporting.diagnose import DATA_DEPENDENT_BRANCH, SHAPE_DEPENDENT_BRANCH, diagnose, shape_only

from .helpers import assert_unchanged, module_snapshot
from .helpers_models import Tower

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

class ListDriven(nn.Module):
    """Control flow driven by ``.tolist()``: Dynamo cannot capture it without a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = (x > 0).sum(-1).tolist()
        y = self.inner(x)
        for k, c in enumerate(counts):
            if c % 2:
                y = y + k
        return y


class ProxyMutating(nn.Module):
    """Mutates the dict behind a ``mappingproxy`` it reads (what Mistral3's vision tower trips on)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.table: dict[str, float] = {"scale": 1.0}
        self.view = types.MappingProxyType(self.table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.view["scale"]
        self.table["scale"] = before  # same value: eager results do not change
        return self.inner(x) * self.view["scale"]


class Host(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.middle = middle
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.middle(self.a(x))))


def call_modules(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("middle", [ListDriven, ProxyMutating])
@pytest.mark.parametrize("how", ["instance", "class"])
def test_excluded_module_is_one_call_dynamo_never_traces_into(middle: type, how: str) -> None:
    model = Host(middle()).eval()
    before = module_snapshot(model)
    x = torch.randn(3, 8)
    kwargs = {"modules_to_exclude": [model.middle]} if how == "instance" else {"module_classes_to_exclude": [middle]}
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="dynamo", fallback="error", **kwargs)
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert call_modules(gm) == ["a", "middle", "relu", "b"]  # middle.inner runs inside middle, not in the graph
    assert gm.middle is model.middle
    assert report.leaves == {"middle": f"{'modules' if how == 'instance' else 'module_classes'}_to_exclude"}
    for shape in ((3, 8), (5, 8)):  # the excluded module's Python runs at call time, on any data
        y = torch.randn(*shape)
        torch.testing.assert_close(gm(y), model(y))
    assert_unchanged(model, before)


def test_dynamo_fallback_makes_only_the_failing_parts_opaque() -> None:
    model = Tower().eval()
    before = module_snapshot(model)
    x = torch.randn(2, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+leaves" and report.verification.status == "passed"
    assert set(report.leaves) == {f"blocks.{i}" for i in range(3)}  # each block, none of the tower
    for reason in report.leaves.values():
        assert reason.startswith("opaque: ") and ".py:" in reason
    calls = call_modules(gm)
    assert calls == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert gm.stem is model.stem and gm.head is model.head
    assert [i.category for i in report.issues]  # each opaque part is diagnosed
    torch.testing.assert_close(gm(x), model(x))
    assert_unchanged(model, before)


def _flip(x: torch.Tensor) -> torch.Tensor:
    if x.abs().argmax().item() % 2:  # data-dependent branch inside a helper
        return -x
    return x


class HelperBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_flip(self.up(x)))


def test_dynamo_fallback_keeps_the_layers_around_an_opaque_function() -> None:
    model = Host(HelperBlock()).eval()
    x = torch.randn(2, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+leaves" and report.verification.status == "passed"
    assert list(report.leaves) == ["middle._flip"]
    calls = call_modules(gm)
    assert calls[:2] == ["a", "middle.up"] and calls[-3:] == ["middle.down", "relu", "b"]
    for name in ("a", "middle.up", "middle.down", "b"):
        assert gm.get_submodule(name) is model.get_submodule(name)
    for y in (x, -x, torch.randn(2, 8)):
        torch.testing.assert_close(gm(y), model(y))


class ShapeSwitch(nn.Module):
    """torchvision's ``FastRCNNPredictor``: ``if x.dim() == 4`` decides on a shape, not on data."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(8, 3)
        self.box = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 4:
            torch._assert(list(x.shape[2:]) == [1, 1], "expected 1x1 spatial")
        x = x.flatten(1)
        if x.shape[0] == 3:
            x = x * 2
        return self.cls(x), self.box(x)


def test_shape_condition_is_specialised_not_opaque() -> None:
    class Predictor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = ShapeSwitch()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.head(x.unsqueeze(-1).unsqueeze(-1))

    model = Predictor().eval()
    x = torch.randn(3, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and not report.leaves
    assert call_modules(gm)[-2:] == ["head.cls", "head.box"]
    assert any("static shapes" in note for note in report.notes)  # the guard, recorded
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("code", ["if x.dim() == 4:", "if x.shape[0] == 3:", "elif len(x.shape) > 2 and self.flag:",
                                  "return min(k, x.size(1))", "assert x.ndim == 2"])
def test_shape_only_conditions(code: str) -> None:
    assert shape_only(code)


@pytest.mark.parametrize("code", ["if x.sum() > 0:", "if x.shape[0] == y.max():", "if flag:", "if x[0] > 1:"])
def test_value_conditions_are_not_shape_only(code: str) -> None:
    assert not shape_only(code)


def test_fx_diagnoses_a_shape_condition_as_shape_dependent() -> None:
    model = ShapeSwitch()
    with pytest.raises(torch.fx.proxy.TraceError) as info:
        torch.fx.symbolic_trace(model)
    issue = diagnose(info.value, "fx", model)[0]
    assert issue.category == SHAPE_DEPENDENT_BRANCH
    assert issue.category != DATA_DEPENDENT_BRANCH and "shape" in issue.fix


def _dynamo_error(model: nn.Module, *args: torch.Tensor) -> BaseException:
    try:
        torch._dynamo.export(model)(*args)
    except Exception as err:  # noqa: BLE001 - the failure is what is wanted
        return err
    finally:
        torch._dynamo.reset()
    raise AssertionError("Dynamo captured the model: the test needs one it cannot")


def test_a_failure_in_a_unique_module_is_located_without_running_the_model() -> None:
    """The stack alone names the objects (one ``HelperBlock``, a free function): the frames are the
    very ones the eager replay finds, and the sites the same."""
    from fxprep.capture.dynamo.locate import locate, resolve, user_stack
    from fxprep.core.inputs import ExampleInputs

    model = Host(HelperBlock()).eval()
    x = torch.randn(2, 8)
    stack = user_stack(_dynamo_error(model, x))
    static = resolve(stack, model)
    eager = locate(stack, model, ExampleInputs((x,), {}))
    assert static is not None and eager is not None and len(eager.chains) == 1
    assert len(static.chains[0]) == len(eager.chains[0]) == len(stack)
    for mine, live in zip(static.chains[0], eager.chains[0]):
        assert mine.code is live.code and mine.owner is live.owner and mine.globals is live.globals
    assert static.chains[0][0].owner is model and static.chains[0][1].owner is model.middle
    assert [s.qualname for s, _ in static.sites(model)] == [s.qualname for s, _ in eager.sites(model)]
    assert static.sites(model)[0][0].qualname == "middle._flip"


def test_a_failure_in_one_of_several_identical_blocks_needs_the_eager_run() -> None:
    """Three ``Block``s run the failing code: the stack cannot say which, so nothing is guessed."""
    from fxprep.capture.dynamo.locate import resolve, user_stack

    model = Tower().eval()
    stack = user_stack(_dynamo_error(model, torch.randn(2, 8)))
    assert stack and resolve(stack, model) is None


@pytest.mark.parametrize(("make", "replayed"), [(lambda: Host(HelperBlock()), False), (Tower, True)])
def test_prepare_replays_the_model_only_when_the_stack_is_ambiguous(monkeypatch, make, replayed) -> None:
    """Each eager replay is one forward of the model (5 s for a Mask R-CNN on one thread)."""
    from fxprep.capture.dynamo import fallback

    real = fallback.locate
    stacks: list[list[tuple[str, str, int]]] = []

    def counting(stack, *args):  # noqa: ANN001, ANN202 - records the calls, then does the real work
        stacks.append(stack)
        return real(stack, *args)

    monkeypatch.setattr(fallback, "locate", counting)
    model = make().eval()
    x = torch.randn(2, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    assert gm.fxprep_report.tracer == "dynamo+leaves" and gm.fxprep_report.verification.status == "passed"
    assert any(stacks) is replayed
    torch.testing.assert_close(gm(-x), model(-x))


class Tail(nn.Module):
    """Counts its calls (outside the model: fxprep puts a model's own state back after each run)."""

    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.log = calls.append

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log(x.shape[0])
        return x * 2


def test_the_perturbed_recording_run_stops_after_the_last_opaque_call() -> None:
    """The second (perturbed) recording run is only compared up to the opaque part's calls: the
    rest of the model (a detector's heads) is not run a second time for nothing."""
    from fxprep.capture.dynamo.recording import record_sites
    from fxprep.capture.sites import Site
    from fxprep.core.inputs import ExampleInputs

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.middle = ListDriven()
            self.tail = Tail(calls)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.tail(self.middle(x))

    calls: list[int] = []
    model = Chain().eval()
    site = Site("middle")
    records = record_sites(model, ExampleInputs((torch.randn(3, 8),), {}), [site])
    assert len(records[site]) == 1 and records[site][0].inputs2 == [(3, 8)]  # the perturbed run got there
    assert calls == [3]  # the first run went through the whole model, the second stopped


def test_an_opaque_parts_real_value_laid_out_as_its_fake_is_a_real_tensor() -> None:
    """Under real values (the values capture), an opaque part's fake output with a symbolic size is
    contiguous, and its real value is made so too. That copy was made under the fake mode, so the
    'real' value was a fake tensor, and an operation meeting it beside an expanded real tensor
    failed (Qwen3.5's rotary multiply after its scan: "more than one element of the written-to tensor
    refers to a single memory location"), which made that function opaque too."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxprep.capture.dynamo.opaque import _propagate_real

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    mode.propagate_real_tensors = True
    x = torch.randn(2, 5, 3)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake_x = mode.from_tensor(x, symbolic_context=context)
    fake_x.real_tensor = x
    transposed = torch.randn(5, 2, 3).transpose(0, 1)  # what the part returns: a view, not contiguous
    with mode:  # as Dynamo calls the part: inside its fake mode
        out = torch.empty(2, fake_x.shape[1], 3)
        _propagate_real((out,), lambda args, kwargs: (transposed,), (fake_x,), {})
    assert isinstance(out.shape[1], torch.SymInt)
    assert type(out.real_tensor) is torch.Tensor and not isinstance(out.real_tensor, FakeTensor)
    assert out.real_tensor.is_contiguous()
    torch.testing.assert_close(out.real_tensor, transposed, rtol=0, atol=0)
