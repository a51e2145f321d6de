"""Forwards behind a ``(*args, **kwargs)`` decorator, and outputs whose keys were set out of order.

transformers 5.24 wraps every Llama-family ``forward`` in ``deprecate_kwarg``, whose wrapper takes
``(*args, **kwargs)``: Dynamo then traces the wrapper's frame, where the module is ``args[0]``, and
names it ``L['args'][0]`` in module stacks and guards instead of ``L['self']``. The same release has
Llava set ``image_outputs.pooler_output`` after building the output, so the original's keys are in
another order than a ``ModelOutput`` rebuilt from its pytree. These tests build both situations
without depending on which transformers version is installed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

import fxprep
from fxprep.capture.dynamo.names import canonical_source, self_alias


def passes_through(fn: Any) -> Any:
    """A decorator like transformers' ``deprecate_kwarg``: the wrapper names no parameter."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapped


class Block(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = scale  # a Python attribute the forward reads: Dynamo guards on it

    @passes_through
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.fc(x)) * self.scale)


class Net(nn.Module):
    def __init__(self, scales: list[float]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block(s) for s in scales)
        self.head = nn.Linear(8, 2)

    @passes_through
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Plain(nn.Module):
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return args[0]


def test_alias_only_for_a_wrapper_that_names_no_parameter() -> None:
    alias = self_alias(Net([1.0]))
    assert alias is not None
    assert canonical_source("getattr(L['args'][0].layers, '0').fc", alias) == "getattr(L['self'].layers, '0').fc"
    assert canonical_source('type(L["args"][0].layers)', alias) == "type(L['self'].layers)"
    assert self_alias(nn.Linear(2, 2)) is None
    assert self_alias(Plain()) is None  # forward(self, *args): args[0] is an input, not the module


def test_wrapped_forwards_prepare_module_level_on_dynamo() -> None:
    torch.manual_seed(0)
    model = Net([1.0, 1.0, 1.0]).eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="dynamo")
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    for name in ("embed", "layers.0.fc", "layers.1.norm", "layers.2.fc", "head"):
        assert name in called
        assert gm.get_submodule(name) is model.get_submodule(name)
    assert report.reuse["captured"] == {"layers.0": ["layers.1", "layers.2"]}
    torch.testing.assert_close(gm(x * 3), model(x * 3))


def test_a_guarded_attribute_behind_a_wrapper_keeps_blocks_apart() -> None:
    """The guards on ``scale`` name the block ``L['args'][0]``: they must still be read as the
    block's own, or the third block would be stamped from the first and compute with its scale."""
    torch.manual_seed(0)
    model = Net([1.0, 1.0, 3.0]).eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="dynamo")
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed"
    assert report.reuse["captured"].get("layers.0") == ["layers.1"]
    assert "scale" in report.reuse["why"]["layers.2"]
    torch.testing.assert_close(gm(x), model(x))


def test_output_keys_set_out_of_order_are_compared_key_by_key_and_stated() -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.pool = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Any:
            h = self.fc(x)
            out = BaseModelOutputWithPooling(last_hidden_state=h, hidden_states=(x, h))
            out.pooler_output = self.pool(h.mean(0))  # set last: after hidden_states
            return out

    model = Encoder().eval()
    x = torch.randn(3, 8)
    assert list(model(x)) == ["last_hidden_state", "hidden_states", "pooler_output"]
    gm = fxprep.prepare_model(model, example_inputs=(x,), tracer="dynamo")
    verification = fxprep.get_report(gm).verification
    assert verification.status == "passed"
    assert "the same keys in another order" in verification.detail and "pooler_output" in verification.detail
    got = gm(x)
    for key in ("last_hidden_state", "pooler_output"):
        torch.testing.assert_close(got[key], model(x)[key])


def test_a_missing_key_is_still_a_structure_difference() -> None:
    """Only a reordering is accepted: an output the prepared module lacks still fails."""
    from fxprep.verify.compare import compare as _compare

    a, b = torch.ones(2), torch.zeros(2)
    assert _compare({"x": a, "y": b}, {"y": b, "x": a}, 1e-4, 1e-5).problem is None
    assert "structure differs" in (_compare({"x": a, "y": b}, {"x": a}, 1e-4, 1e-5).problem or "")
    swapped = _compare({"x": a, "y": b}, {"y": a, "x": b}, 1e-4, 1e-5)  # reordered, and x/y swapped
    assert swapped.worst == 1.0 and swapped.accepted


class ModeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @deprecate_kwarg("y", "99.0.0", new_name="x")  # transformers' own: its wrapper lives in another file
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # the line the note must name
            x = x * 2
        return self.fc(x)


def test_a_training_read_behind_a_decorator_is_named_at_its_own_line() -> None:
    import inspect

    gm = fxprep.prepare_model(nn.Sequential(ModeBlock()).eval(), example_inputs=(torch.randn(2, 4),), progress=False)
    notes = [n for n in fxprep.get_report(gm).notes if "reads self.training" in n]
    file = inspect.getsourcefile(ModeBlock)
    line = next(i for i, text in enumerate(open(file).read().splitlines(), 1) if "the line the note must name" in text)
    assert len(notes) == 1 and f"{file}:{line}" in notes[0], notes


def test_a_training_read_inside_a_module_called_whole_is_not_named() -> None:
    """A module the graph calls (``modules_to_exclude``) runs its own code, children included, and
    reads its mode at every call: nothing in it was fixed by the capture, so no note names it."""
    inner = ModeBlock()
    outer = nn.Sequential(nn.Sequential(inner), ModeBlock()).eval()
    for tracer in ("fx", "dynamo"):
        gm = fxprep.prepare_model(outer, [outer[0]], example_inputs=(torch.randn(2, 4),), progress=False, tracer=tracer)
        notes = [n for n in fxprep.get_report(gm).notes if "reads self.training" in n]
        assert len(notes) == 1 and "(1)" in notes[0], (tracer, notes)  # the traced ModeBlock only


def test_fx_on_a_wrapped_forward_is_explained() -> None:
    """torch.fx's own words on a forward behind a ``(*args, **kwargs)`` wrapper are "code: co_varnames
    is too small". fxprep's tracer now traces through such a wrapper (tests/test_fx_decorated.py), so
    on a Llama of transformers >= 5.24 fx stops later, at its next real obstacle, never at the
    decorator; the explanation stays for a wrapper it cannot see through."""
    from fxprep.capture.fx import _explained
    from fxprep.reporting.diagnose import DECORATED_FORWARD

    from .helpers_models import llama_inputs, tiny_llama

    model = tiny_llama()
    report = fxprep.check_traceability(model, example_inputs=llama_inputs())
    fx_issues = [i for i in report.issues if i.tracer == "fx"]
    assert all(i.category != DECORATED_FORWARD for i in fx_issues), fx_issues
    # the same explanation, independent of the installed transformers
    explained = _explained(ValueError("code: co_varnames is too small"), Net([1.0]))
    assert type(explained).__name__ == "DecoratedForward" and explained.__cause__ is not None
    plain = ValueError("code: co_varnames is too small")
    assert _explained(plain, nn.Linear(2, 2)) is plain  # no wrapper: fx's own error stands
