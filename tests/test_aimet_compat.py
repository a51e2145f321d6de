"""``fxprep.compat.aimet.prepare_model``: AIMET's names and classes on fxprep's graph.

Code written against AIMET's preparer looks modules up by AIMET's names (``module_relu_1``) and
classes (``aimet_torch...custom.Add``). These tests state AIMET's documented naming and class rules
on models of their own, check the graph still computes exactly what the model does, and check where
fxprep deliberately keeps its own behaviour.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import aimet_torch.nn.modules.custom as aimet_modules
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxprep
from fxprep import ops
from fxprep.compat import aimet as compat


def targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


def same_outputs(model, gm, *inputs):
    with torch.no_grad():
        expected, got = model(*inputs), gm(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)


class Functionals(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = torch.relu(x).mean((2, 3))
        return self.fc(x).relu()


def test_functionals_are_named_after_their_fx_node():
    model = Functionals().eval()
    gm = compat.prepare_model(model)
    assert targets(gm) == ["conv", "module_relu", "module_relu_1", "module_mean", "fc", "module_relu_2"]
    assert all(isinstance(gm.get_submodule(f"module_relu{s}"), nn.ReLU) for s in ("", "_1", "_2"))
    same_outputs(model, gm, torch.randn(1, 3, 8, 8))


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.relu(self.a(x))
        x = self.relu(self.b(x))
        x = F.relu(x)
        return self.relu(x)


def test_one_counter_per_name_over_the_whole_graph():
    """fx numbers 'relu' once for the module calls and the functional alike, in graph order."""
    model = Reused().eval()
    gm = compat.prepare_model(model)
    assert targets(gm) == ["a", "relu", "b", "module_relu_1", "module_relu_2", "module_relu_3"]
    assert isinstance(gm.module_relu_1, nn.ReLU) and gm.relu is model.relu
    same_outputs(model, gm, torch.randn(2, 4))


def test_resnet_names_and_classes_as_aimet_makes_them():
    model = torchvision.models.resnet18(weights=None).eval()
    gm = compat.prepare_model(model)
    adds = [t for t in targets(gm) if "add" in t]
    assert adds == [f"layer{i // 2 + 1}.{i % 2}.module_add" + (f"_{i}" if i else "") for i in range(8)]
    assert all(type(gm.get_submodule(t)) is aimet_modules.Add for t in adds)
    # the second call of each block's relu is an unrolled copy: module_<child>_<k>
    assert "layer3.1.module_relu_1" in targets(gm) and "layer3.1.relu_1" not in targets(gm)
    same_outputs(model, gm, torch.randn(1, 3, 64, 64))
    # parameters stay shared (AIMET deep-copies reused modules; fxprep does not)
    assert gm.get_submodule("layer1.0.conv1").weight is model.layer1[0].conv1.weight
    assert list(gm.state_dict()) == list(model.state_dict())


class Elementwise(nn.Module):
    def forward(self, x, y):
        a = torch.subtract(x, y) * 2.0
        b = torch.cat([a, x], dim=1) / y.abs().sum()
        return F.interpolate(b, scale_factor=2.0) + x.sum()


def test_elementwise_ops_become_aimet_classes_called_with_the_same_arguments():
    model = Elementwise().eval()
    x, y = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4) + 3
    gm = compat.prepare_model(model, example_inputs=(x, y))
    assert gm.fxprep_report.verification.status == "passed"
    classes = {t: type(gm.get_submodule(t)) for t in targets(gm)}
    assert classes["module_subtract"] is aimet_modules.Subtract
    assert classes["module_mul"] is aimet_modules.Multiply
    assert classes["module_cat"] is aimet_modules.Concat and gm.module_cat._axis == 1
    assert classes["module_truediv"] is aimet_modules.Divide
    assert classes["module_interpolate"] is aimet_modules.Interpolate
    assert classes["module_sum_1"] is aimet_modules.Sum  # `sum` shadows a builtin: fx calls the node sum_1
    mul = next(n for n in gm.graph.nodes if n.target == "module_mul")
    assert mul.args[1] == 2.0  # the constant is an argument, as AIMET's constant-rescale rule expects
    same_outputs(model, gm, x, y)


class FxprepKeepsItsOwn(nn.Module):
    """Forms AIMET's classes would compute differently."""

    def forward(self, x, mask):
        y = x.masked_fill(mask, 0.0)  # AIMET's MaskedFill is Tensor.masked_fill_ (in place)
        z = y.where(mask, x)  # Tensor.where(cond, other): another argument order than torch.where
        out = z * 2.0
        view = out[0]  # a view taken before the in-place add below, which it must see
        out += x
        return out, view * 1.0


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_forms_aimet_would_compute_differently_keep_fxprep_classes(tracer):
    model = FxprepKeepsItsOwn().eval()
    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    gm = compat.prepare_model(model, example_inputs=(x, mask), tracer=tracer)
    kinds = [type(gm.get_submodule(t)) for t in targets(gm)]
    assert ops.MaskedFill in kinds and ops.Where in kinds
    assert ops.Add in kinds and aimet_modules.Add not in kinds  # the in-place add stays in place
    assert aimet_modules.Multiply in kinds
    same_outputs(model, gm, x, mask)


class BufferConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kernel", torch.randn(4, 3, 3, 3))

    def forward(self, x):
        return F.conv2d(x, self.kernel, stride=2)


def test_functional_conv_on_a_buffer_is_an_nn_conv2d_reading_that_buffer():
    model = BufferConv().eval()
    gm = compat.prepare_model(model)
    conv = gm.module_conv2d
    assert isinstance(conv, nn.Conv2d) and conv.weight is model.kernel and conv.stride == (2, 2)
    assert list(gm.state_dict()) == ["kernel"]  # no new key: the conv reads the model's own buffer
    same_outputs(model, gm, torch.randn(1, 3, 9, 9))


class Excluded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.custom = nn.Module()

    def forward(self, x):
        return F.softplus(self.fc(x)) * torch.sigmoid(x)


def test_functionals_outside_any_used_module_go_to_the_root():
    model = Excluded().eval()
    gm = compat.prepare_model(model)
    assert targets(gm) == ["fc", "module_softplus", "module_sigmoid", "module_mul"]


def test_fxprep_keeps_its_own_names():
    gm = fxprep.prepare_model(Reused().eval())
    assert "module_relu_1" not in targets(gm) and "relu_1" in targets(gm)


def test_aimet_style_module_pickles_as_aimet_tests_do(tmp_path):
    model = torchvision.models.resnet18(weights=None).eval()
    gm = compat.prepare_model(model)
    again = pickle.loads(pickle.dumps(gm))
    same_outputs(again, gm, torch.randn(1, 3, 32, 32))
    torch.save(gm, tmp_path / "m.pth")
    same_outputs(torch.load(tmp_path / "m.pth", weights_only=False), gm, torch.randn(1, 3, 32, 32))


def test_without_aimet_installed_fxprep_and_the_drop_in_still_work():
    """aimet-torch is a test dependency only: without it, names still follow AIMET, classes stay fxprep's."""
    code = (
        "import sys; sys.modules['aimet_torch'] = None\n"
        "import importlib.util; importlib.util.find_spec = (lambda f: (lambda name, *a: None if name == 'aimet_torch' "
        "else f(name, *a)))(importlib.util.find_spec)\n"
        "import torch, fxprep\n"
        "from fxprep.compat import aimet\n"
        "from fxprep.cli.demo import ModelWithElementwiseAddOp as M\n"
        "gm = aimet.prepare_model(M().eval())\n"
        "print(type(gm.module_add).__module__, 'aimet_torch' in sys.modules and sys.modules['aimet_torch'] is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["fxprep.ops", "False"]


def test_import_fxprep_does_not_import_aimet():
    out = subprocess.run([sys.executable, "-c", "import sys, fxprep; print('aimet_torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=300)  # a hang guard, not a time limit
    assert out.stdout.strip() == "False", out.stderr


def test_style_option_is_validated():
    with pytest.raises(fxprep.InvalidInput, match="style"):
        fxprep.prepare_model(Reused(), style="nncf")
