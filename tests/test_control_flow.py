"""control_flow="rewrite": data-dependent ifs captured whole (torch.where / torch.cond), site by site.

Every model here has a Python ``if`` (or conditional expression) on a tensor that stops every
tracer; without the option fxprep makes the module opaque (or fails at the root). The models are
defined in this file because the rewrite reads their source.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import onnx
import onnxruntime
import pytest
import torch
import torch.fx as fx
from torch import nn

import fxprep
from fxprep.cond import cond as fxprep_cond
from fxprep.errors import InvalidInput, TraceFailure

from .helpers import assert_unchanged, module_snapshot
from .seed_models import fx_docs


# --- the seed document's model (shared/seeds/000), as written ---------------------------------------
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


def _site(gm: fx.GraphModule, index: int = 0):
    return gm.fxprep_report.control_flow[index]


def _calls(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(str(n.target), gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"]


def _branches(gm: fx.GraphModule) -> list[fx.GraphModule]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fxprep_cond]
    return [gm.get_submodule(str(a.target)) for n in nodes for a in n.args[1:3]]


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_seed_model_prepares_whole_and_is_verified_on_both_branches(tracer):
    model = NonTraceableModel()
    before = module_snapshot(model)
    forward = NonTraceableModel.__dict__["forward"]
    source = inspect.getsource(NonTraceableModel)
    positive, negative = torch.rand(1, 10), -torch.rand(1, 10)

    gm = fxprep.prepare_model(model, example_inputs=positive, control_flow="rewrite", tracer=tracer,
                              verify_inputs=[negative])

    report = gm.fxprep_report
    assert report.tracer == ("dynamo" if tracer == "auto" else "fx")
    assert ("linear", model.linear) in _calls(gm)  # the user's own nn.Linear, module-level
    site = _site(gm)
    assert site.route == "torch.where"
    assert site.location.endswith(f"test_control_flow.py:{inspect.getsourcelines(forward)[1] + 2}")
    assert site.code.splitlines()[0] == "if x.sum() > 0:"
    assert site.became == "return torch.where(x.sum() > 0, self.linear(x), torch.zeros(10))"
    assert site.branches == {"true": ["example"], "false": ["verify_inputs[0]"]}
    # the else branch returns (10,), the if branch (1, 10): fxprep broadcasts and says so, in the
    # site and in the verification of the input that took the else branch
    assert any("(1, 10) (true) vs (10,) (false)" in n for n in site.notes)
    assert report.verification.status == "passed" and report.verification.detail == ""
    negative_check = report.extra_verifications[0]
    assert negative_check.status == "passed"
    assert "original shape (10,), prepared (1, 10)" in negative_check.detail
    torch.testing.assert_close(gm(positive), model(positive))
    assert gm(negative).shape == (1, 10) and model(negative).shape == (10,)
    torch.testing.assert_close(gm(negative), model(negative).expand(1, 10))
    assert "TORCH.WHERE at" in str(report) and "became: return torch.where(" in str(report)

    # the user's class, instances and file are as they were
    assert NonTraceableModel.__dict__["forward"] is forward
    assert "forward" not in model.__dict__
    assert inspect.getsource(NonTraceableModel) == source
    assert_unchanged(model, before)
    with pytest.raises(fx.proxy.TraceError):
        fx.symbolic_trace(model)


def test_seed_model_other_branch_is_verified_on_a_constructed_input():
    model = NonTraceableModel()
    x = torch.rand(1, 10)
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", tracer="fx")
    label = "the example negated (built by fxprep)"
    assert _site(gm).branches == {"true": ["example"], "false": [label]}
    (check,) = gm.fxprep_report.extra_verifications
    assert check.label == label and check.status == "passed"
    assert label in str(gm.fxprep_report)


def test_default_is_unchanged_and_option_is_validated():
    with pytest.raises(TraceFailure):
        fxprep.prepare_model(NonTraceableModel(), example_inputs=torch.rand(1, 10), tracer="fx")
    with pytest.raises(InvalidInput, match="control_flow must be one of None, 'rewrite'"):
        fxprep.prepare_model(NonTraceableModel(), example_inputs=torch.rand(1, 10), control_flow="yes")


# --- forms -----------------------------------------------------------------------------------------
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        if x.mean() > 0:
            return self.fc(x)
        return x * 0.5


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.gate = Gate()
        self.post = nn.Linear(6, 6)

    def forward(self, x):
        return self.post(self.gate(self.pre(x)))


def test_branch_in_a_submodule_is_captured_module_level():
    model = GatedNet()
    # inputs along the direction the gate's mean grows fastest: +x opens it, -x closes it
    x = 100 * model.pre.weight.detach().sum(0).expand(3, 6).clone()
    other = -x
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", verify_inputs=[other, -other])
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and not report.leaves  # nothing opaque
    assert {name: m for name, m in _calls(gm)}["gate.fc"] is model.gate.fc
    site = _site(gm)
    assert site.route == "torch.where" and site.modules == ["gate"]
    assert site.code.splitlines() == ["if x.mean() > 0:", "    return self.fc(x)", "return x * 0.5"]
    assert site.branches == {"true": ["example", "verify_inputs[1]"], "false": ["verify_inputs[0]"]}
    for inp in (x, other, -other):
        torch.testing.assert_close(gm(inp), model(inp))


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        s = x.sum()
        if s > 1:
            return self.a(x)
        elif s < -1:
            return self.b(x)
        else:
            return x


def test_if_elif_else_chain_becomes_nested_where_verified_on_each_arm():
    model = Chain()
    up, down, flat = torch.ones(1, 6), -torch.ones(1, 6), torch.zeros(1, 6)
    gm = fxprep.prepare_model(model, example_inputs=up, control_flow="rewrite", verify_inputs=[down, flat])
    outer, inner = gm.fxprep_report.control_flow
    assert outer.became == "return torch.where(s > 1, self.a(x), torch.where(s < -1, self.b(x), x))"
    assert inner.code.startswith("elif s < -1:")
    assert outer.branches == {"true": ["example"], "false": ["verify_inputs[0]", "verify_inputs[1]"]}
    assert inner.branches == {"true": ["verify_inputs[0]"], "false": ["verify_inputs[1]"]}
    assert [name for name, _ in _calls(gm) if name in ("a", "b")] == ["a", "b"]
    for inp in (up, down, flat):
        torch.testing.assert_close(gm(inp), model(inp))


class Ternary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = self.fc(x)
        z = y if y.max() > 0.5 else -y
        return z * 2


def test_conditional_expression():
    model = Ternary()
    x = torch.randn(2, 6)
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", verify_inputs=[x * 50, x * 0])
    site = _site(gm)
    assert site.route == "torch.where" and site.became == "torch.where(y.max() > 0.5, y, -y)"
    assert site.branches["true"] and site.branches["false"]
    for inp in (x, x * 50, x * 0):
        torch.testing.assert_close(gm(inp), model(inp))


class Renorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        if h.norm() > 2:
            h = h / 2
            g = h + 1
        else:
            g = h - 1
        return h * g


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_branches_assigning_locals_then_falling_through(tracer):
    model = Renorm()
    big, small = torch.randn(4, 6) * 10, torch.randn(4, 6) * 1e-3
    gm = fxprep.prepare_model(model, example_inputs=big, control_flow="rewrite", tracer=tracer, verify_inputs=[small])
    site = _site(gm)
    assert site.route == "torch.where"
    assert site.became == "h, g = torch.where(h.norm() > 2, h / 2, h), torch.where(h.norm() > 2, h + 1, h - 1)"
    assert site.branches == {"true": ["example"], "false": ["verify_inputs[0]"]}
    for inp in (big, small):
        torch.testing.assert_close(gm(inp), model(inp))


# --- methods of every shape: super(), decorators, private names, other methods, loops, and/or/not ----
class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class WithSuper(Base):
    def forward(self, x, scale=2.0, *, shift=0.0):
        y = super().forward(x)
        if y.sum() > 0:
            y = y * scale
        return y + shift


class Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.__secret = 3.0

    @torch.no_grad()
    def forward(self, x):
        y = self.fc(x)
        return y * self.__secret if y.mean() > 0 else y


class OtherMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def pick(self, y):
        if y.max() > 1:
            return y / 2
        return y

    def forward(self, x):
        return self.pick(self.fc(x)) + 1


class InLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        acc = torch.zeros_like(x)
        for i, fc in enumerate(self.fcs):
            h = fc(x)
            if h.sum() > i:
                acc = acc + h
            else:
                acc = acc - h
        return acc


class BoolOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0 and y.max() < 10:
            out = y.relu()
        else:
            out = y.sigmoid()
        if not (out > 0.5).any():
            out = out * 0
        return out


@pytest.mark.parametrize("tracer", ["auto", "fx"])
@pytest.mark.parametrize("cls", [WithSuper, Decorated, OtherMethod, InLoop, BoolOps])
def test_methods_of_every_shape(cls, tracer):
    model = cls()
    x = torch.randn(2, 4)
    inputs = [-x, 5 * x, x * 0]
    before = dict(vars(cls))
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", tracer=tracer, verify_inputs=inputs)
    report = gm.fxprep_report
    assert report.tracer in ("dynamo", "fx") and not report.leaves
    assert report.control_flow and all(c.route == "torch.where" for c in report.control_flow)
    for inp in [x, *inputs, 3 * x]:
        torch.testing.assert_close(gm(inp), model(inp))
    assert dict(vars(cls)) == before and not {"forward", "pick"} & set(model.__dict__)


# --- torch.cond: leaves inside the branches stay the user's modules -----------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()


class Routed(nn.Module):
    """A user block in one branch (its forward is not known to be pure) and a conv + BatchNorm in
    training mode (statistics updated) in the other: torch.where is ruled out, torch.cond is not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.block = Block()
        self.alt = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        if x.mean() > 0:
            y = self.bn(self.conv(x)).mean((2, 3))
            y = self.block(y)
        else:
            y = self.alt(x).mean((2, 3))
        return y * 2


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_cond_route_keeps_leaf_modules_inside_branches(tracer):
    model = Routed().train()
    pos, neg = torch.rand(2, 3, 6, 6), -torch.rand(2, 3, 6, 6)
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=pos, control_flow="rewrite", tracer=tracer, verify_inputs=[neg],
                              verify="grad")
    site = _site(gm)
    assert site.route == "torch.cond"
    assert any("self.block" in r and "BatchNorm2d in training mode" in r for r in site.reasons)
    assert site.branches == {"true": ["example"], "false": ["verify_inputs[0]"]}
    true_branch, false_branch = _branches(gm)
    in_true, in_false = dict(_calls(true_branch)), dict(_calls(false_branch))
    assert (in_true["conv"], in_true["bn"], in_true["block.fc"]) == (model.conv, model.bn, model.block.fc)
    assert in_false["alt"] is model.alt
    assert not {"conv", "bn", "block.fc"} & set(in_false) and "alt" not in in_true
    assert gm.get_submodule("cond_true_0.conv") is model.conv  # found by its branch's path
    # functional ops inside the branches became modules too, and the report counts them
    report = gm.fxprep_report
    assert any(a.name.startswith(("cond_true", "cond_false")) for a in report.added)
    assert [x.target for x in report.left] == ["fxprep.cond.cond"]
    assert "data-dependent branch" in report.left[0].reason
    assert list(gm.state_dict()) == list(model.state_dict())
    gm.load_state_dict(model.state_dict(), strict=True)
    for inp in (pos, neg):  # gradients flow into the user's parameters through the taken branch
        model.zero_grad()
        ref = model(inp.clone())
        ref.sum().backward()
        ref_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        gm(inp.clone()).sum().backward()
        got = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref_grads.keys()
        for k in got:
            torch.testing.assert_close(got[k], ref_grads[k])
    model.zero_grad(set_to_none=True)
    after = module_snapshot(model)
    assert after["tree"] == before["tree"] and after["attrs"] == before["attrs"]
    # a torch.fx re-trace (what AIMET or torch.ao do with a prepared model) keeps the cond one call
    retraced = fx.symbolic_trace(gm)
    assert [n.target for n in retraced.graph.nodes if n.op == "call_function"].count(fxprep_cond) == 1


class Reused(nn.Module):
    """``self.fc`` runs before the branch and again inside it; the user block keeps torch.where out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.block = Block()

    def forward(self, x):
        h = self.fc(x)
        if h.mean() > 0:
            h = self.block(self.fc(h))
        return h


class Recording(nn.Module):
    """What a module-swapping toolkit (AIMET's QuantSim, NNCF) puts in place of each layer it finds."""

    def __init__(self, layer: nn.Module, name: str, seen: list[str]):
        super().__init__()
        self.layer, self.name, self.seen = layer, name, seen

    def forward(self, x):
        self.seen.append(self.name)
        return self.layer(x)


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_a_toolkit_swapping_layers_by_name_reaches_inside_the_branches(tracer):
    model = Reused().eval()
    x = torch.ones(2, 8) * 10 * model.fc.weight.detach().sum(0)  # opens the branch: h.mean() > 0
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", tracer=tracer, verify_inputs=[-x])
    assert _site(gm).route == "torch.cond" and _site(gm).branches == {"true": ["example"], "false": ["verify_inputs[0]"]}
    # fc has two call sites (before the branch, inside it): two module objects sharing the weights
    (unrolled,) = gm.fxprep_report.unrolled
    assert unrolled.original == "fc" and unrolled.copies == ["cond_true_0.fc"]
    assert gm.get_submodule("cond_true_0.fc").weight is model.fc.weight
    seen: list[str] = []
    for name, layer in list(gm.named_modules()):
        if isinstance(layer, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(gm.get_submodule(parent), leaf, Recording(layer, name, seen))
    torch.testing.assert_close(gm(x), model(x))
    assert seen == ["fc", "cond_true_0.fc", "cond_true_0.block.fc"]
    seen.clear()
    torch.testing.assert_close(gm(-x), model(-x))
    assert seen == ["fc"]


# --- refused or reported ----------------------------------------------------------------------------
class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.count = 0

    def forward(self, x):
        if x.sum() > 0:
            self.count += 1
            return self.fc(x)
        return x


class CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.inner = Counting()

    def forward(self, x):
        return self.inner(self.fc(x)) + 1


def test_side_effect_in_a_branch_is_not_rewritten_and_diagnosed():
    model = CountingNet()
    x = torch.rand(2, 6)
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite")
    report = gm.fxprep_report
    site = _site(gm)
    assert site.route == "not rewritten" and site.became == ""
    assert "writes the attribute `self.count` (a Python side effect)" in site.reasons[0]
    assert report.leaves == {"inner": report.leaves["inner"]} and "opaque" in report.leaves["inner"]
    with pytest.raises(TraceFailure, match=r"refused \(a branch cannot be made a pure function"):
        fxprep.prepare_model(Counting(), example_inputs=x, control_flow="rewrite")


class LogIfPositive(nn.Module):
    def forward(self, x):
        if x.min() > 0:
            return torch.log(x)
        return x


class ExpIfNegative(nn.Module):
    def forward(self, x):
        if x.max() < 0:
            return (x * 100).exp()
        return x


def test_branch_giving_nan_or_inf_on_the_untaken_side_is_not_where():
    x = torch.rand(2, 6) + 0.1
    gm = fxprep.prepare_model(LogIfPositive(), example_inputs=x, control_flow="rewrite", verify_inputs=[-x],
                              verify="grad")
    site = _site(gm)
    assert site.route == "torch.cond"
    assert "`torch.log(...)` can raise or give NaN/inf outside its domain" in site.reasons[0]
    # nothing in the source says so, but computed on the side on the example the untaken branch is inf
    x = torch.rand(2, 6) * 10
    model = ExpIfNegative()
    gm = fxprep.prepare_model(model, example_inputs=x, control_flow="rewrite", verify_inputs=[-x], verify="grad")
    site = _site(gm)
    assert site.route == "torch.cond"
    assert "the true branch gives NaN/inf on these inputs" in site.reasons[0]
    inp = x.clone().requires_grad_(True)
    gm(inp).sum().backward()
    assert torch.isfinite(inp.grad).all()  # torch.where would have made it NaN
    where = x.clone().requires_grad_(True)
    torch.where(where.max() < 0, (where * 100).exp(), where).sum().backward()
    assert torch.isnan(where.grad).any()


class Doubling(nn.Module):
    def forward(self, x):
        while x.abs().sum() < 100:
            x = x * 2
        return x


class DoublingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.loop = Doubling()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(self.loop(x))


def test_aimet_wrapped_loop_stays_one_call_and_data_dependent_loops_stay_opaque():
    # AIMET's documented answer to "truly dynamic control flow": a torch.fx.wrap-ped function
    model = fx_docs.ModelWithWrappedFunction()
    gm = fxprep.prepare_model(model, example_inputs=(torch.randn(2, 4), torch.randn(2, 4)), tracer="fx",
                              control_flow="rewrite")
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [fx_docs.custom_function_not_to_be_traced]
    assert "torch.fx.wrap" in gm.fxprep_report.left[0].reason and not gm.fxprep_report.control_flow
    # the same loop with a trip count that depends on the tensor: opaque, and said why
    net = DoublingNet()
    x = torch.rand(2, 6)
    gm = fxprep.prepare_model(net, example_inputs=x, control_flow="rewrite", verify_inputs=[x * 1000])
    report = gm.fxprep_report
    site = _site(gm)
    assert site.route == "not rewritten" and site.code == "while x.abs().sum() < 100:"
    assert "loop whose trip count depends on a tensor" in site.reasons[0]
    assert "loop" in report.leaves and report.issues[0].category == "data-dependent loop"


# --- check -----------------------------------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.inner = Counting()
        self.loop = Doubling()

    def forward(self, x):
        return self.loop(self.inner(self.gate(x)))


def test_check_names_each_data_dependent_site_and_whether_the_rewrite_applies():
    report = fxprep.check_traceability(Mixed(), torch.rand(2, 6))
    sites = {c.location.rsplit(":", 1)[1]: c for c in report.control_flow}
    lines = {name: inspect.getsourcelines(cls.forward)[1] for name, cls in
             (("gate", Gate), ("inner", Counting), ("loop", Doubling))}
    assert sites[str(lines["gate"] + 1)].route == "torch.where"
    assert sites[str(lines["inner"] + 1)].route == "not rewritten"
    assert "self.count" in sites[str(lines["inner"] + 1)].reasons[0]
    assert sites[str(lines["loop"] + 1)].route == "not rewritten"
    assert report.rewrite_tracer is None  # two of the three sites stay: not whole even so
    text = report.to_text()
    assert "with control_flow='rewrite': 1 of 3 data-dependent site(s) rewritten; still not traceable whole" in text
    assert "TORCH.WHERE at" in text and "NOT REWRITTEN at" in text
    assert "| site | code | rewrite | why |" in report.to_markdown()
    assert report.to_dict()["control_flow"][0]["route"]
    whole = fxprep.check_traceability(NonTraceableModel(), torch.rand(1, 10))
    assert whole.rewrite_tracer == "dynamo" and whole.control_flow[0].route == "torch.where"


# --- delivery ---------------------------------------------------------------------------------------
def _onnx_outputs(path: str, x: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def test_where_result_saves_loads_and_exports(tmp_path):
    model = Chain()
    up, down, flat = torch.ones(1, 6), -torch.ones(1, 6), torch.zeros(1, 6)
    gm = fxprep.prepare_model(model, example_inputs=up, control_flow="rewrite", verify_inputs=[down, flat])
    fxprep.save(gm, tmp_path / "chain", example_inputs=up)
    loaded = fxprep.load(tmp_path / "chain")
    fxprep.export_onnx(gm, up, tmp_path / "chain.onnx")
    program = fxprep.export_program(gm, up)
    for inp in (up, down, flat):
        torch.testing.assert_close(loaded(inp), model(inp))
        torch.testing.assert_close(_onnx_outputs(str(tmp_path / "chain.onnx"), inp), model(inp))
        torch.testing.assert_close(program.module()(inp), model(inp))


def test_cond_result_saves_loads_pickles_and_exports_both_branches(tmp_path):
    model = Routed().eval()  # the user block in one branch keeps torch.where out
    pos, neg = torch.rand(2, 3, 6, 6), -torch.rand(2, 3, 6, 6)
    gm = fxprep.prepare_model(model, example_inputs=pos, control_flow="rewrite", verify_inputs=[neg])
    assert _site(gm).route == "torch.cond" and gm.fxprep_report.tracer == "dynamo"
    fxprep.save(gm, tmp_path / "routed", example_inputs=pos)
    loaded = fxprep.load(tmp_path / "routed")
    assert isinstance(_branches(loaded)[0].get_submodule("conv"), nn.Conv2d)
    loaded.load_state_dict(model.state_dict(), strict=True)
    fxprep.export_onnx(gm, pos, tmp_path / "routed.onnx")
    assert "If" in {n.op_type for n in onnx.load(str(tmp_path / "routed.onnx")).graph.node}
    program = fxprep.export_program(gm, pos)
    assert any(n.target is torch.ops.higher_order.cond for n in program.graph.nodes)
    unpickled, copied = pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)
    for inp in (pos, neg):
        expected = model(inp)
        torch.testing.assert_close(unpickled(inp), expected)
        torch.testing.assert_close(copied(inp), expected)
        torch.testing.assert_close(loaded(inp), expected)
        torch.testing.assert_close(_onnx_outputs(str(tmp_path / "routed.onnx"), inp), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(program.module()(inp), expected)


# --- a torch.cond the user wrote: Dynamo's branch subgraphs re-lifted --------------------------------
class UserCond(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)

    def forward(self, x):
        def true_fn(x):
            return self.a(x).relu()

        def false_fn(x):
            return self.b(x) * 2

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


def test_user_torch_cond_branches_call_the_users_modules():
    model = UserCond()
    x = torch.rand(1, 10)
    gm = fxprep.prepare_model(model, example_inputs=x, verify_inputs=[-x])
    true_branch, false_branch = _branches(gm)
    assert dict(_calls(true_branch))["a"] is model.a and dict(_calls(false_branch))["b"] is model.b
    assert not any(n.op == "placeholder" and "weight" in n.name for b in (true_branch, false_branch)
                   for n in b.graph.nodes)  # no raw weights passed in
    assert any(a.name.startswith("cond_true_0.") for a in gm.fxprep_report.added)  # its relu: counted
    assert [x.target for x in gm.fxprep_report.left] == ["fxprep.cond.cond"]
    for inp in (x, -x):
        torch.testing.assert_close(gm(inp), model(inp))


class _Comprehends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [row * 2 for row in self.fc(x)]  # iterates a traced tensor: fx stops here
        return torch.stack(parts)


def test_a_comprehension_over_a_tensor_is_named_not_rewritable() -> None:
    """The rewrite learns from fx's failure inside a comprehension (its ``ast.comprehension`` has no
    line of its own; fxprep's lookup crashed on it): the site is named, with why it stays."""
    line = inspect.getsourcelines(_Comprehends.forward)[1] + 1
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(_Comprehends().eval(), example_inputs=(torch.randn(3, 4),), tracer="fx",
                             control_flow="rewrite", progress=False)
    assert f"{__file__}:{line}: not rewritable (a loop whose trip count depends on a tensor" in str(info.value)
