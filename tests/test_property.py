"""Property test: randomly composed models prepare, verify, and leave the original untouched.

Why random programs: the zoo covers architectures people ship, but the passes meet combinations no
zoo model happens to contain - a reused module feeding an in-place op feeding a concatenation, a
user attribute called ``add`` next to the ``Add`` module fxprep wants to create, a hooked module
called twice, a Parameter read by ``F.linear`` in a nested block. Hypothesis draws such combinations
(and shrinks a failure to the smallest program that still fails).

A model is an ``nn.Module`` whose ``forward`` interprets a static *program*: a tuple of :class:`Op`
records stored on the module. The program is plain Python data, so ``torch.fx`` unrolls the
interpreter loop while tracing and sees only the tensor operations.

In-place ops follow one rule that keeps every generated program well-defined under tracing: the
tensor an in-place op mutates, and every value that may alias it (an eval-mode Dropout returns its
input object), is never read again. A graph records values, not aliases, so a later read of an alias
sees the mutation only if the traced op really stays in place; that hazard has its own test below,
which demands that fxprep either gets it right or refuses the model, never returns a wrong one.

A quarter of the cases are prepared without example inputs (no verification inside fxprep); every
case is also checked by this file's own output comparison, so those are not taken on trust.
``FXPREP_PROPERTY_EXAMPLES=3000`` runs a longer search.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import fxprep
from fxprep.passes.functional_to_module import remaining_compute_ops

from .model_programs import (
    BINARY,
    MODULE_KINDS,
    UNARY,
    Op,
    Program,
    Snapshot,
    _double_output,
    _halve_input,
    assert_same_outputs,
    build,
    programs,
)

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


@st.composite
def cases(draw: Callable[..., Any]) -> tuple[Program, int, bool, tuple[str, str] | None, bool]:
    """(program, seed, training, hook (module name, kind) or None, prepare with example inputs)."""
    program = draw(programs())
    hookable = [op.name for op in program.ops if op.kind in MODULE_KINDS]
    hook = None
    if hookable and draw(st.booleans()):
        hook = (draw(st.sampled_from(hookable)), draw(st.sampled_from(("forward", "pre"))))
    return program, draw(st.integers(0, 2**16)), draw(st.booleans()), hook, draw(st.integers(0, 3)) > 0


@settings(max_examples=int(os.environ.get("FXPREP_PROPERTY_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_programs_prepare_verify_and_leave_original_untouched(
    case: tuple[Program, int, bool, tuple[str, str] | None, bool],
) -> None:
    program, seed, training, hook, with_example = case
    model, x = build(program, seed)
    model.train(training)
    if hook is not None:
        target = model.get_submodule(hook[0])
        if hook[1] == "forward":
            target.register_forward_hook(_double_output)
        else:
            target.register_forward_pre_hook(_halve_input)
    note(f"training={training} hook={hook} with_example={with_example}")
    before = Snapshot.of(model)

    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,) if with_example else None)

    before.assert_unchanged(model)
    report = fxprep.get_report(gm)
    note(report.to_text())
    assert report.verification.status == ("passed" if with_example else "skipped"), report.to_text()
    assert gm.training == model.training

    left = remaining_compute_ops(gm)
    assert not left, [(n.name, n.target) for n in left]
    calls = Counter(id(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module")
    assert all(c == 1 for c in calls.values()), gm.graph

    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            assert gm.get_parameter(name) is tensor, name
        else:
            assert gm.get_buffer(name) is tensor, name
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    gm.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(gm.state_dict(), strict=True)
    before.assert_unchanged(model)

    assert_same_outputs(model, gm, x)


class _AliasedInplace(nn.Module):
    """``y`` aliases ``x`` after ``relu_``; ``y += 1`` then changes what ``x`` holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.relu_()
        y += 1.0
        return x * 2


class _DropoutAlias(nn.Module):
    """An eval-mode Dropout returns its input object, so ``+=`` on ``h`` shows through ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 1.0
        y = self.drop(h)
        h += 1.0
        return y, h


@pytest.mark.parametrize("cls", [_AliasedInplace, _DropoutAlias])
def test_aliased_inplace_is_refused_or_right(cls: type[nn.Module]) -> None:
    """A graph records values, not aliases; with example inputs fxprep must either keep the in-place
    semantics or raise EquivalenceError, never return a module that computes something else."""
    model = cls().eval()
    x = torch.randn(2, 3)
    try:
        gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
    except fxprep.EquivalenceError:
        return
    torch.testing.assert_close(gm(x.clone()), model(x.clone()))


@pytest.mark.parametrize("form", ["tensor", "tuple", "dict", "nested", "list", "with_size"])
def test_fixed_program_each_output_form(form: str) -> None:
    """A hand-written program touching every op kind, so a broken op shows up without Hypothesis."""
    block = Program((Op("conv", (0,), "add", (2, 3, True)), Op("relu_", (1,)), Op("linear", (2,), "relu_1", True)), 2, 2)
    ops = (
        Op("conv", (0,), "conv2d", (2, 3, False)), Op("bn", (1,), "relu"), Op("relu_mod", (2,), "mul", True),
        Op("reuse", (3,), "mul"), Op("f_relu", (4,)), Op("block", (5,), "block", block), Op("reuse", (6,), "block"),
        Op("add", (7, 6)), Op("iadd", (8, 7)), Op("cat", (9, 6)), Op("sigmoid", (10,)), Op("tanh", (11,)),
        Op("gelu", (12,)), Op("softmax", (13,)), Op("scalar", (14,)), Op("param_mul", (15,), "scale"),
        Op("flinear", (16,), "linear", True), Op("buffer_add", (17,), "weight", False), Op("dropout", (18,), "cat"),
        Op("mul", (19, 19)), Op("add_alpha", (20, 10)), Op("transpose", (21,)), Op("pad", (22,)),
        Op("scale_by_size", (23,)), Op("zeros_add", (24,)), Op("rsub", (25,)), Op("se", (26,)),
        Op("f_dropout", (27,)), Op("f_dropout_fixed", (28,)), Op("masked_fill", (29,)), Op("chunk_swap", (30,)),
        Op("len_mul", (31,)), Op("reshape", (32,)), Op("where", (33, 10)), Op("matmul", (34, 33)),
    )
    program = Program(ops, 2, 4, (form, 6))
    covered = {op.kind for op in ops} | {op.kind for op in block.ops}
    assert covered == set(UNARY + BINARY), set(UNARY + BINARY) - covered  # a new op kind gets a fixed case too
    for training in (False, True):
        model, x = build(program, 0)
        model.train(training)
        model.get_submodule("block").register_forward_hook(_double_output)
        before = Snapshot.of(model)
        gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x,))
        before.assert_unchanged(model)
        assert fxprep.get_report(gm).verification.status == "passed"
        assert not remaining_compute_ops(gm)
        assert sorted(gm.state_dict()) == sorted(model.state_dict())
        assert_same_outputs(model, gm, x)


class _IaddOnInput(nn.Module):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x += pos  # mutates the caller's tensor in eager mode
        return x.relu()


def test_iadd_on_input_mutates_it_like_the_original() -> None:
    """Plain fx records ``x += y`` as ``operator.add`` (a Proxy has no ``__iadd__``); an out-of-place
    Add would leave the caller's tensor unmutated, and output-only verification would not notice."""
    model = _IaddOnInput()
    x, pos = torch.randn(2, 3), torch.randn(2, 3)
    gm = fxprep.prepare_model(model, tracer="fx", example_inputs=(x, pos))
    x_ref, x_got = x.clone(), x.clone()
    torch.testing.assert_close(gm(x_got, pos), model(x_ref, pos))
    torch.testing.assert_close(x_got, x_ref)
