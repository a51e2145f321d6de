"""prepare_model's contract: bad input, never mutating the user's model, reports, verification."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep import ops
from fxprep.core.inputs import ExampleInputs
from fxprep.passes.state_dict import aliases
from fxprep.verify import verify

from .helpers import assert_clean, assert_unchanged, module_snapshot

pytestmark = pytest.mark.smoke  # run on the oldest supported versions too (make test-oldest)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


X = torch.randn(2, 3, 8, 8)


# --- bad input --------------------------------------------------------------------------------
def test_non_module_model():
    with pytest.raises(fxprep.InvalidInput, match="must be a torch.nn.Module"):
        fxprep.prepare_model(lambda x: x)


@pytest.mark.parametrize("bad", ["x", 3, {1: torch.ones(1)}, {torch.ones(1)}])
def test_example_inputs_of_wrong_type(bad):
    with pytest.raises(fxprep.InvalidInput, match="example_inputs"):
        fxprep.prepare_model(Small(), example_inputs=bad)


def test_inputs_the_model_rejects_quote_the_model_error():
    with pytest.raises(fxprep.ModelError) as info:
        fxprep.prepare_model(Small(), example_inputs=torch.randn(2, 5, 8, 8))
    assert "expected input[2, 5, 8, 8] to have 3 channels" in str(info.value)
    assert "Tensor[2x5x8x8, float32]" in str(info.value)


def test_forward_that_raises():
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("this model is broken")

    with pytest.raises(fxprep.ModelError, match="this model is broken"):
        fxprep.prepare_model(Raises(), example_inputs=X)


def test_unknown_option_lists_known_ones():
    with pytest.raises(fxprep.UnknownOption) as info:
        fxprep.prepare_model(Small(), example_inputs=X, verfy=False)
    assert "'verfy'" in str(info.value) and "verify" in str(info.value)


@pytest.mark.parametrize("kwargs", [{"tracer": "jit"}, {"verify": "yes"}, {"rtol": -1}, {"fallback": "ignore"}])
def test_invalid_option_values(kwargs):
    with pytest.raises(fxprep.InvalidInput):
        fxprep.prepare_model(Small(), example_inputs=X, **kwargs)


def test_excludes_are_checked():
    model, other = Small(), Small()
    with pytest.raises(fxprep.InvalidInput, match="not a submodule"):
        fxprep.prepare_model(model, modules_to_exclude=[other.conv])
    with pytest.raises(fxprep.InvalidInput, match="must hold classes"):
        fxprep.prepare_model(model, module_classes_to_exclude=[model.conv])
    with pytest.raises(fxprep.InvalidInput, match="concrete_args names"):
        fxprep.prepare_model(model, concrete_args={"nope": 1})
    with pytest.raises(fxprep.InvalidInput, match="dict"):
        fxprep.prepare_model(model, concrete_args=[1])


def test_errors_are_fxprep_errors():
    for cls in (fxprep.InvalidInput, fxprep.ModelError, fxprep.TraceFailure, fxprep.EquivalenceError):
        assert issubclass(cls, fxprep.FxprepError)


# --- example_inputs forms ---------------------------------------------------------------------
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, y=None):
        return self.a(x) + (0 if y is None else y)


@pytest.mark.parametrize("example", [torch.randn(2, 4), (torch.randn(2, 4),), [torch.randn(2, 4), torch.randn(2, 4)],
                                     {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}])
def test_example_input_forms(example):
    gm = fxprep.prepare_model(TwoInputs(), example_inputs=example)
    assert gm.fxprep_report.verification.status == "passed"


def test_without_example_inputs_report_says_so():
    gm = fxprep.prepare_model(Small().eval())
    report = gm.fxprep_report
    assert report.verification.status == "skipped" and "no example_inputs" in report.verification.detail
    assert report.tracer == "fx"
    assert any("only the fx tracer" in n for n in report.notes)
    text = str(report)
    assert "verification: skipped" in text and "modules added: 2" in text
    assert fxprep.get_report(gm) is report
    assert "relu" in report.to_markdown() and '"tracer": "fx"' in report.to_json()


# --- never mutate, never copy ---------------------------------------------------------------------
def test_model_untouched_in_train_mode_with_mixed_modes_and_hooks():
    model = Small().train()
    model.bn.eval()  # a frozen BatchNorm inside a training model
    seen = []
    model.conv.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    before = module_snapshot(model)
    running_mean = model.bn.running_mean.clone()
    gm = fxprep.prepare_model(model, example_inputs=X)
    assert_unchanged(model, before)
    assert torch.equal(model.bn.running_mean, running_mean)
    assert gm.training and not gm.bn.training  # the user's objects keep their own modes
    seen.clear()
    gm(X)
    assert len(seen) == 1, "the forward hook must still run in the prepared module"
    assert gm.conv is model.conv


def test_train_mode_batchnorm_stats_untouched_by_verification():
    model = Small().train()
    before = module_snapshot(model)
    fxprep.prepare_model(model, example_inputs=X, verify="grad")
    assert_unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_parameters_are_never_copied():
    model = Small()
    gm = fxprep.prepare_model(model, example_inputs=X)
    assert_clean(gm, model)
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}


def test_unused_parameters_and_nonpersistent_buffers_keep_state_dict_parity():
    class WithExtras(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))
            self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
            self.register_buffer("counter", torch.zeros(()))

        def forward(self, x):
            return self.lin(x) * self.scale + self.inv_freq

    model = WithExtras()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))
    assert list(gm.state_dict()) == list(model.state_dict()) or set(gm.state_dict()) == set(model.state_dict())
    assert "inv_freq" not in gm.state_dict()
    assert gm.unused.weight is model.unused.weight
    assert_clean(gm, model)



def test_garbage_collector_left_as_found():
    """prepare_model freezes the heap it finds for speed; it must thaw it again, and must not thaw
    what the caller had frozen itself (a pre-fork server's shared objects)."""
    import gc

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert gc.get_freeze_count() == 0
    fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4),))
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4),))
        assert fxprep.get_report(gm).tracer == "dynamo"  # Dynamo's export ran (fxprep.core.heap.freeze_more)
        # still frozen (the count only drops as frozen objects die), and nothing of prepare's added
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


# --- unrolling, tied weights ---------------------------------------------------------------------
class ReusedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.alias = self.fc  # the same module under a second name
        self.relu_1 = nn.Identity()  # an attribute an unrolled name must not shadow

    def forward(self, x):
        x = self.fc(x).relu()
        x = self.alias(x).relu()
        return self.fc(x)


def test_reused_module_unrolled_with_shared_parameters():
    model = ReusedLinear()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)]
    assert len(targets) == 3 and len({id(gm.get_submodule(t)) for t in targets}) == 3
    for t in targets:
        assert gm.get_submodule(t).weight is model.fc.weight
    relus = [n.target for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.ReLU)]
    assert relus == ["relu", "relu_2"]  # relu_1 is the user's attribute: never shadowed
    assert_clean(gm, model)
    assert aliases(gm)  # the copies' keys are aliases, hidden from state_dict
    assert set(gm.state_dict()) == set(model.state_dict())


def test_tied_weights_survive_training():
    torch.manual_seed(0)
    model = ReusedLinear()
    reference = ReusedLinear()
    reference.load_state_dict(model.state_dict())
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4))
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    for net in (gm, reference):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(net(x), target).backward()
            opt.step()
    # gm trained the user's own parameters (shared by all call sites) exactly like eager training
    torch.testing.assert_close(model.fc.weight, reference.fc.weight)
    assert len(list(gm.parameters())) == 2


def test_independent_copies_on_request():
    model = ReusedLinear()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4), share_parameters=False)
    weights = {id(m.weight) for m in gm.modules() if isinstance(m, nn.Linear)}
    assert len(weights) == 3
    assert gm.fxprep_report.unrolled[0].shared_parameters is False


def test_names_are_deterministic_and_scoped():
    import torchvision

    model = torchvision.models.resnet18().eval()
    names1 = [n.target for n in fxprep.prepare_model(model).graph.nodes if n.op == "call_module"]
    names2 = [n.target for n in fxprep.prepare_model(model).graph.nodes if n.op == "call_module"]
    assert names1 == names2
    assert "layer1.0.add" in names1 and "layer1.0.relu_1" in names1


# --- training mode ------------------------------------------------------------------------------
class DropoutModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = F.dropout(self.fc(x), 0.5, training=self.training)
        if self.training:
            x = x * 2
        return x


def test_dropout_follows_mode_and_training_branch_is_reported():
    model = DropoutModel().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(4, 16))
    assert any(isinstance(m, nn.Dropout) for m in gm.modules())
    x = torch.randn(4, 16)
    torch.testing.assert_close(gm(x), model(x))
    gm.train()
    assert (gm(x) == 0).any(), "dropout must be active after .train()"
    assert not model.training, "gm.train() must not flip the user's model"
    notes = " ".join(gm.fxprep_report.notes)
    assert "self.training" in notes and "eval mode" in notes and "test_api.py" in notes


# --- verification -------------------------------------------------------------------------------
def test_nan_outputs_compared_position_by_position():
    class Nan(nn.Module):
        def forward(self, x):
            return torch.log(x)  # NaN where x < 0

    x = torch.tensor([-1.0, 1.0, 2.0, -3.0])
    gm = fxprep.prepare_model(Nan(), example_inputs=x)
    assert gm.fxprep_report.verification.status == "passed"
    assert gm.fxprep_report.verification.max_abs_diff == 0.0


def test_mismatch_names_first_diverging_module():
    class Baked(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)

        def forward(self, x):
            x = self.first(x)
            return self.second(x * random.random())  # a Python value baked in at trace time

    with pytest.raises(fxprep.EquivalenceError) as info:
        fxprep.prepare_model(Baked(), example_inputs=torch.randn(2, 4), tracer="fx")
    # the multiplication's op module: its input agrees with eager's, its output does not (issue 27);
    # the first leaf module whose output differs is still named in the message
    assert info.value.module == "mul"
    assert info.value.max_abs_diff > 0
    assert "First diverging module: 'second'" in str(info.value)


def test_verify_detects_a_broken_graph():
    model = Small().eval()
    gm = fxprep.prepare_model(model, example_inputs=X)
    gm.fc = nn.Linear(4, 2)  # not the user's layer any more
    with pytest.raises(fxprep.EquivalenceError) as info:
        verify(model, gm, ExampleInputs((X,)))
    assert info.value.module == "fc"


def test_tolerances_are_options_and_report_shows_difference():
    class Reassoc(nn.Module):
        def forward(self, x):
            return x + 1e-3

    gm = fxprep.prepare_model(Reassoc(), example_inputs=torch.randn(3), rtol=0.0, atol=0.0)
    assert gm.fxprep_report.verification.rtol == 0.0
    assert "max |diff| = 0" in str(gm.fxprep_report)


def test_gradient_verification():
    gm = fxprep.prepare_model(Small(), example_inputs=X, verify="grad")
    v = gm.fxprep_report.verification
    assert v.grad and v.grad_max_abs_diff is not None and v.status == "passed"


def test_structured_outputs_are_compared():
    class Structured(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            y = self.a(x)
            return {"logits": y, "extra": (y.sigmoid(), [y * 2])}

    gm = fxprep.prepare_model(Structured(), example_inputs=torch.randn(2, 3))
    assert gm.fxprep_report.verification.outputs_compared == 3
    out = gm(torch.randn(2, 3))
    assert set(out) == {"logits", "extra"}
    assert isinstance(gm.get_submodule("sigmoid"), nn.Sigmoid)
    assert isinstance(gm.get_submodule("mul"), ops.Mul)


def test_fx_path_keeps_ordereddict_output():
    import collections

    import torchvision

    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=x)
    assert type(gm(x)) is collections.OrderedDict
    assert gm.fxprep_report.verification.status == "passed"


class _ReturnsModelOutput(nn.Module):
    """A model whose output is a transformers ModelOutput with None fields, traced by torch.fx."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.lin(x), hidden_states=None, attentions=None)


def test_a_model_output_traced_by_fx_comes_back_as_the_model_returns_it() -> None:
    """fx builds the ModelOutput from proxies and returns the dict it traced, None fields included;
    eager's ModelOutput drops them from its keys (MRA, captured by fx, failed verification so)."""
    from transformers.modeling_outputs import BaseModelOutput

    model = _ReturnsModelOutput().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="fx")
    out = gm(x)
    assert type(out) is BaseModelOutput and list(out.keys()) == ["last_hidden_state"]
    torch.testing.assert_close(out.last_hidden_state, model(x).last_hidden_state)


class _Counted(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.fc(x)


class _AddsAndActs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Counted()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x) + y) * x.shape[-1]


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_convert_functionals_false_leaves_functions_and_runs_nothing_to_classify_them(tracer):
    """Without the conversion, what each node carries (tensor or Python value) only labels the
    report: it is inferred from the ops, not found by running the graph once more."""
    model = _AddsAndActs().eval()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    runs = {}
    for convert in (True, False):
        _Counted.calls = 0
        gm = fxprep.prepare_model(model, [model.inner], example_inputs=(x, y), tracer=tracer,
                                  convert_functionals=convert, progress=False)  # inner: one call, counted
        runs[convert] = _Counted.calls
        added = [m for m in gm.modules() if type(m).__module__.startswith("fxprep")]
        assert bool(added) is convert  # Add, ReLU and Mul modules only with the conversion
        torch.testing.assert_close(gm(x, y), model(x, y), rtol=0, atol=0)
    if tracer == "fx":  # the fx graph carries no values: the conversion ran it once to find them
        assert runs[False] == runs[True] - 1, runs
    else:  # Dynamo's nodes carry example values: nothing is run for them either way
        assert runs[False] == runs[True], runs
