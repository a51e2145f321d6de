"""Model fuzz suite (issue 10): hypothesis-generated models, each prepared, verified and checked.

``test_property.py`` generates the *body* of a model (layers, functional ops, reuse, in-place ops,
buffers, nested blocks, hooks; the generator is ``tests/model_programs.py``) and traces it with fx.
This suite wraps such a body in what real forwards add around their layers, and drives both tracers:

* branches on static attributes (``if self.flag``, ``if self.mode == "sum"``) - fixed at capture;
* keyword arguments: a Python float (Dynamo specialises it) and an optional tensor (None or not);
* containers as inputs: a list of tensors or a dict of tensors;
* a buffer and, in training mode, a running statistic updated in place (a state update the graph
  must reproduce, or fxprep must report by name);
* tracer ``"fx"`` or ``"dynamo"`` (Dynamo's share is smaller: each capture costs about a second).

Each model is prepared with example inputs, so fxprep verifies it; the test then checks, on its own,
that verification passed, the original is untouched (values, objects, attributes), outputs and the
state update match the original's, and the prepared module refuses a call structured unlike its
example (a longer list, another dict key) instead of computing something else.

``FXPREP_FUZZ_EXAMPLES`` (default 500) sets how many models one run generates; the default keeps
this file well under a minute of CPU. Hypothesis' own example database is not used
(``-p no:cacheprovider`` runs, CI), so each run draws fresh models.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import fxprep
from fxprep.core.inputs import ExampleInputs
from tests import model_programs as body

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

EXAMPLES = int(os.environ.get("FXPREP_FUZZ_EXAMPLES", "500"))
GENERATED = {"models": 0, "dynamo": 0}  # printed at the end of the run (see test_fuzz_count)


@dataclass(frozen=True)
class Wrapper:
    """What surrounds the generated body: static attributes, extra inputs and state."""

    flag: bool  # ``if self.flag``: scale the body's output
    mode: str  # "sum" | "max" | "none": how the container input is folded in
    container: str  # "list" | "dict" | "none": the form of the ``extra`` input
    items: int  # list length / number of dict keys
    scale: float  # keyword argument, a Python float
    gate: bool  # whether the optional ``gate`` tensor is given
    running: bool  # keep a running mean buffer, updated in place in training mode


class FuzzNet(nn.Module):
    def __init__(self, program: body.Program, wrapper: Wrapper):
        super().__init__()
        self.body = body.ProgramNet(program)
        self.flag = wrapper.flag
        self.mode = wrapper.mode
        self.running = wrapper.running
        self.register_buffer("offset", torch.randn(1))
        if wrapper.running:
            self.register_buffer("mean", torch.zeros(1))

    def forward(self, x: torch.Tensor, extra: Any = None, *, scale: float = 1.0,
                gate: torch.Tensor | None = None) -> Any:
        if extra is not None and self.mode != "none":
            parts = list(extra.values()) if isinstance(extra, dict) else list(extra)
            folded = parts[0]
            for p in parts[1:]:
                folded = folded + p if self.mode == "sum" else torch.maximum(folded, p)
            x = x + folded
        if gate is not None:
            x = x * torch.sigmoid(gate)
        out = self.body(x * scale + self.offset)
        if self.running and self.training:
            first = out if isinstance(out, torch.Tensor) else body._flat(out)[0][1]
            self.mean.mul_(0.9).add_(first.detach().mean() * 0.1)
        if self.flag:
            if self.body.program.output[0] == "with_size":  # (tensor, int): only the tensor scales
                return out[0] * 2.0, out[1]
            return _map(out, lambda t: t * 2.0)
        return out


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` on every leaf of a dict/tuple/list structure (no isinstance test on the leaves: under
    fx they are Proxies, and a forward that tests them would trace differently from how it runs)."""
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value)


@st.composite
def wrappers(draw: Callable[..., Any]) -> Wrapper:
    return Wrapper(
        flag=draw(st.booleans()),
        mode=draw(st.sampled_from(("sum", "max", "none"))),
        container=draw(st.sampled_from(("list", "dict", "none"))),
        items=draw(st.integers(1, 3)),
        scale=draw(st.sampled_from((1.0, 0.5, 2.0))),
        gate=draw(st.booleans()),
        running=draw(st.booleans()),
    )


def _inputs(wrapper: Wrapper, x: torch.Tensor, items: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = wrapper.items if items is None else items
    extra: Any = None
    if wrapper.container == "list":
        extra = [torch.randn_like(x) for _ in range(n)]
    elif wrapper.container == "dict":
        extra = {f"k{i}": torch.randn_like(x) for i in range(n)}
    kwargs: dict[str, Any] = {"scale": wrapper.scale}
    if wrapper.gate:
        kwargs["gate"] = torch.randn_like(x)
    return (x, extra), kwargs


def _clone(value: Any) -> Any:
    return _map(value, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


@st.composite
def fuzz_cases(draw: Callable[..., Any]) -> tuple[body.Program, Wrapper, int, bool, str]:
    program = draw(body.programs())
    tracer = draw(st.sampled_from(("fx",) * 7 + ("dynamo",)))
    return program, draw(wrappers()), draw(st.integers(0, 2**16)), draw(st.booleans()), tracer


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzz_cases())
def test_generated_models_prepare_and_verify(case: tuple[body.Program, Wrapper, int, bool, str]) -> None:
    program, wrapper, seed, training, tracer = case
    torch.manual_seed(seed)
    model = FuzzNet(program, wrapper).train(training)
    x = torch.randn(body.BATCH, program.in_channels, body.SIZE, body.SIZE)
    args, kwargs = _inputs(wrapper, x)
    note(f"wrapper={wrapper} training={training} tracer={tracer}")
    before = body.Snapshot.of(model)

    gm = fxprep.prepare_model(model, example_inputs=ExampleInputs(args, kwargs), tracer=tracer,
                              progress=False)
    GENERATED["models"] += 1
    GENERATED["dynamo"] += tracer == "dynamo"

    before.assert_unchanged(model)  # capture and verification left every value and object in place
    report = fxprep.get_report(gm)
    note(report.to_text())
    assert report.verification.status == "passed", report.to_text()
    assert report.tracer.split("+")[0] == tracer, report.to_text()  # a forced tracer is never replaced

    # Our own comparison: outputs (same RNG draws) and the state update, on the original and the
    # prepared module from the same starting state.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        ref = model(*_clone(args), **_clone(kwargs))
    after_original = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    torch.manual_seed(1)
    with torch.no_grad():
        got = gm(*_clone(args), **_clone(kwargs))
    ref_flat, got_flat = body._flat(ref), body._flat(got)
    assert [p for p, _ in ref_flat] == [p for p, _ in got_flat]
    for (path, r), (_, g) in zip(ref_flat, got_flat):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, p=path: f"{p}: {m}")
    if not report.verification.state_not_reproduced:
        for key, value in gm.state_dict().items():
            torch.testing.assert_close(value, after_original[key], msg=lambda m, k=key: f"state {k}: {m}")
    model.load_state_dict(state)

    # Called with a structure it was not captured for, the prepared module refuses.
    if wrapper.container != "none":
        other_args, other_kwargs = _inputs(wrapper, x, items=wrapper.items + 1)
        try:
            gm(*other_args, **other_kwargs)
        except fxprep.InputMismatch as err:
            assert "extra" in str(err)
        else:
            raise AssertionError("a container with one more item than at capture was accepted")


def test_fuzz_count(record_property: Any) -> None:
    """Runs after the fuzz test in this file (pytest keeps file order): says how many models the
    run generated, prepared and verified (in the run's "fuzz counts" section, tests/conftest.py)."""
    if GENERATED["models"]:
        assert GENERATED["models"] >= min(EXAMPLES, 500) * 0.9, GENERATED
    record_property("summary", f"fuzz: {GENERATED['models']} generated models prepared and verified ({GENERATED['dynamo']} by Dynamo)")
