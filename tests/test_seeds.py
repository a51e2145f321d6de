"""Every code example of the seed documents (shared/seeds/), run through fxprep as they describe."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep import ops

from .helpers import assert_clean, assert_unchanged, module_snapshot
from .seed_models import fx_docs, plain_len

pytestmark = pytest.mark.smoke  # run on the oldest supported versions too (make test-oldest)


# --- seed 000: the compression SDK's traceability requirements ----------------------------------
class NonTraceableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        # use "if" statement which will NOT be traceable
        if x.sum() > 0:
            return self.linear(x)
        else:
            return torch.zeros(10)


class TraceableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        condition = x.sum() > 0
        linear_output = self.linear(x)
        linear_output = linear_output * condition
        return linear_output


class StaticControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.my_cond = True
        self.num_loops = 5

    def forward(self, x):
        if self.my_cond:
            for _ in range(self.num_loops):
                x = x + 3
            return x
        else:
            return x


def test_non_traceable_if_gives_located_trace_failure():
    model = NonTraceableModel()
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(model, example_inputs=torch.rand(1, 10), tracer="fx", fallback="error")
    message = str(info.value)
    line = inspect.getsourcelines(NonTraceableModel.forward)[1] + 2
    assert f"test_seeds.py:{line}" in message
    assert "if x.sum() > 0:" in message
    assert "torch.where" in message
    issue = info.value.issues[0]
    assert issue.category == "data-dependent branch"
    assert issue.line == line


def test_traceable_rewrite_prepares_and_verifies():
    model = TraceableModel()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=torch.rand(1, 10))
    assert gm.fxprep_report.verification.status == "passed"
    assert isinstance(gm.get_submodule("linear"), nn.Linear) and gm.linear is model.linear
    assert_clean(gm, model)
    assert_unchanged(model, before)
    for x in (torch.rand(2, 10), -torch.rand(2, 10)):  # both signs of the condition
        torch.testing.assert_close(gm(x), model(x))


def test_static_control_flow_unrolls_the_constant_loop():
    model = StaticControlFlow()
    gm = fxprep.prepare_model(model, example_inputs=torch.rand(1, 10))
    adds = [m for m in gm.modules() if isinstance(m, ops.Add)]
    assert len(adds) == 5
    x = torch.rand(3, 10)
    torch.testing.assert_close(gm(x), x + 15)


# --- seed 002: torch.fx documentation -------------------------------------------------------------
class MyModule(nn.Module):
    def __init__(self, do_activation: bool = False):
        super().__init__()
        self.do_activation = do_activation
        self.linear = nn.Linear(512, 512)

    def forward(self, x):
        x = self.linear(x)
        if self.do_activation:
            x = torch.relu(x)
        return x


@pytest.mark.parametrize("do_activation", [False, True])
def test_static_flag_attribute(do_activation):
    model = MyModule(do_activation)
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 512))
    relus = [m for m in gm.modules() if isinstance(m, nn.ReLU)]
    assert len(relus) == (1 if do_activation else 0)
    assert_clean(gm, model)


class FlagModel(nn.Module):
    def forward(self, x, flag):
        if flag:
            return x
        else:
            return x * 2


@pytest.mark.parametrize("flag", [True, False])
def test_concrete_args_specialise_a_flag(flag):
    model = FlagModel()
    x = torch.randn(3)
    gm = fxprep.prepare_model(model, concrete_args={"flag": flag}, example_inputs=(x,))
    assert gm.fxprep_report.verification.status == "passed"
    torch.testing.assert_close(gm(x), x if flag else x * 2)


def test_concrete_args_positional_aimet_order():
    model = FlagModel()
    gm = fxprep.prepare_model(model, None, None, {"flag": True})
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x)


def test_flag_without_concrete_args_fails_clearly():
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(FlagModel(), tracer="fx", fallback="error")
    assert "concrete_args" in str(info.value)


def test_wrap_len_and_sqrt_at_module_scope():
    gm = fxprep.prepare_model(fx_docs.NormalizeModel(), example_inputs=torch.rand(3, 4), tracer="fx")
    x = torch.rand(5, 4)  # another batch size: fx records len(), so it is not baked in
    torch.testing.assert_close(gm(x), x / (5 ** 0.5))
    assert any(isinstance(m, ops.Div) for m in gm.modules())


def test_len_and_sqrt_without_wrap_are_recorded():
    model = plain_len.PlainLen().eval()
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=torch.randn(2, 3, 8, 8))
    x = torch.randn(5, 3, 8, 8)  # another batch size: len() was recorded, not baked
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("cls", [plain_len.ZerosFromShape, plain_len.ArangeFromShape])
def test_constructor_sized_from_traced_shape(cls):
    model = cls()
    x = torch.randn(4, 4)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
    y = torch.randn(6, 6)  # a new batch size must give a new size, not the traced one
    torch.testing.assert_close(gm(y), model(y))


def test_range_over_traced_shape_is_reported_precisely():
    class Loop(nn.Module):
        def forward(self, x):
            out = x
            for i in range(x.shape[0]):
                out = out + i
            return out

    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(Loop(), tracer="fx", fallback="error")
    issue = info.value.issues[0]
    assert issue.category == "iteration over a traced value"
    assert "range(x.shape[0])" in (issue.code or "")
    assert issue.file and issue.file.endswith("test_seeds.py")


class MySpecialSubmodule(nn.Module):
    def forward(self, x):
        return torch.neg(x)


class LeafDemo(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.submod = MySpecialSubmodule()

    def forward(self, x):
        return self.submod(self.linear(x))


def test_leaf_modules_default_and_custom():
    model = LeafDemo()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets[0] == "linear" and "submod" not in targets  # traced through: neg → Neg module
    assert any(isinstance(m, ops.Neg) for m in gm.modules())
    gm2 = fxprep.prepare_model(model, module_classes_to_exclude=[MySpecialSubmodule], example_inputs=torch.randn(2, 3))
    assert [n.target for n in gm2.graph.nodes if n.op == "call_module"] == ["linear", "submod"]
    assert gm2.submod is model.submod


class CustomTracerDemo(nn.Module):
    def forward(self, x):
        return torch.relu(x) + torch.ones(3, 4)


def test_custom_tracer_example_constant_constructor():
    model = CustomTracerDemo()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4))
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), torch.relu(x) + 1)
    # fxprep's tracer is a torch.fx.Tracer subclass that can itself be used the torch.fx way
    from fxprep.capture.common import LeafPolicy
    from fxprep.capture.fx import FxprepTracer

    graph = FxprepTracer(LeafPolicy()).trace(model)
    traced = torch.fx.GraphModule(model, graph)
    torch.testing.assert_close(traced(x), torch.relu(x) + 1)


# --- seed 003: AIMET Model Preparer examples ------------------------------------------------------
class ModelWithFunctionalReLU(nn.Module):
    """Model that uses functional ReLU instead of nn.Modules. Expects input of shape (1, 3, 32, 32)"""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x).relu()
        return x


class ModelWithReusedReLU(nn.Module):
    """Model that uses single ReLU instances multiple times in the forward. Expects input of shape (1, 3, 32, 32)"""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.relu(x)
        x = self.conv2(x)
        x = self.relu(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        x = self.relu(x)
        return x


class ModelWithElementwiseAddOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5, bias=False)
        self.conv2 = nn.Conv2d(3, 6, 5)

    def forward(self, *inputs):
        x1 = self.conv1(inputs[0])
        x2 = self.conv2(inputs[1])
        x = x1 + x2
        return x


def test_aimet_example_1_functional_relu():
    model = ModelWithFunctionalReLU().eval()
    input_tensor = torch.randn(1, 3, 32, 32)
    prepared_model = fxprep.prepare_model(model)
    assert torch.allclose(model(input_tensor), prepared_model(input_tensor))
    relus = [n for n, m in prepared_model.named_modules() if isinstance(m, nn.ReLU)]
    assert len(relus) == 4
    assert_clean(prepared_model, model)


def test_aimet_example_2_reused_relu():
    model = ModelWithReusedReLU().eval()
    input_tensor = torch.randn(1, 3, 32, 32)
    prepared_model = fxprep.prepare_model(model)
    assert torch.allclose(model(input_tensor), prepared_model(input_tensor))
    relu_calls = [n.target for n in prepared_model.graph.nodes if n.op == "call_module" and "relu" in n.target]
    assert relu_calls == ["relu", "relu_1", "relu_2", "relu_3"]
    assert len({id(prepared_model.get_submodule(t)) for t in relu_calls}) == 4
    assert prepared_model.relu is model.relu
    assert_clean(prepared_model, model)


def test_aimet_example_3_elementwise_add():
    model = ModelWithElementwiseAddOp().eval()
    input_tensor = [torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32)]
    prepared_model = fxprep.prepare_model(model)
    assert torch.allclose(model(*input_tensor), prepared_model(*input_tensor))
    assert isinstance(prepared_model.get_submodule("add"), ops.Add)
    gm = fxprep.prepare_model(model, example_inputs=tuple(input_tensor))
    assert gm.fxprep_report.verification.status == "passed"


def test_aimet_wrapped_len_sqrt_model():
    model = fx_docs.ModelWithNonTorchFunction().eval()
    model_transformed = fxprep.prepare_model(model)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(model_transformed(x), model(x))


def test_aimet_wrapped_function_stays_one_call():
    model = fx_docs.ModelWithWrappedFunction()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x, y), tracer="fx")
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [fx_docs.custom_function_not_to_be_traced]
    left = gm.fxprep_report.left
    assert len(left) == 1 and "torch.fx.wrap" in left[0].reason


class CustomModule(nn.Module):
    @staticmethod
    def forward(x):
        return x * torch.nn.functional.softplus(x).sigmoid()


class CustomModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=2)
        self.custom = CustomModule()

    def forward(self, inputs):
        x = self.conv1(inputs)
        x = self.custom(x)
        return x


def test_aimet_modules_to_exclude():
    model = CustomModel().eval()
    prepared_model = fxprep.prepare_model(model, modules_to_exclude=[model.custom])
    assert [n.target for n in prepared_model.graph.nodes if n.op == "call_module"] == ["conv1", "custom"]
    assert prepared_model.custom is model.custom
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(prepared_model(x), model(x))
    assert "modules_to_exclude" in prepared_model.fxprep_report.leaves["custom"]


def test_dynamo_default_states_its_static_shapes():
    gm = fxprep.prepare_model(fx_docs.ArangeWrapped(), example_inputs=(torch.randn(3, 3),))
    if gm.fxprep_report.tracer == "dynamo":
        assert any("static shapes" in n for n in gm.fxprep_report.notes)


def test_aimet_arange_wrapped_and_unwrapped():
    x = torch.randn(3, 3)
    gm = fxprep.prepare_model(fx_docs.ArangeWrapped(), example_inputs=(x,), tracer="fx")
    torch.testing.assert_close(gm(x), fx_docs.ArangeWrapped()(x))
    y = torch.randn(7, 7)
    torch.testing.assert_close(gm(y), y + torch.arange(7))


# --- seed 001: fine-grained control (allow_in_graph) ----------------------------------------------
@fxprep.opaque
def custom_hook_function(x):
    result = x * 2
    result += 10
    return result


class MyModel(nn.Module):
    def forward(self, x):
        x = torch.relu(x)
        x = custom_hook_function(x)
        return x


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_opaque_function_is_one_call(tracer):
    model = MyModel()
    x = torch.randn(5)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer=tracer)
    torch.testing.assert_close(gm(x), torch.relu(x) * 2 + 10)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1 and calls[0].target.__name__ == "custom_hook_function"
    assert any("fxprep.opaque" in x.reason for x in gm.fxprep_report.left)
