"""Budgets that cannot be stepped around (issue 63): the self-check's forward budget counted what ops
*return*, so an op that grows a tensor it was given (``resize_``, an ``out=`` argument of another
shape) made storage no output showed (4x the budget, not refused); Python values the graph builds
with its own ``operator`` / ``builtins`` calls (big integers, repeated and concatenated lists) were
bounded by nothing (load still running after 45 s at 20 MB); an op whose cost is its arithmetic (a
matmul) was bounded only by its memory; and nothing bounded the whole load's time.

Each case is a hand-edited save with its checksums recomputed. Limits are lowered with monkeypatch
where the case would otherwise need gigabytes: the checks are the same."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from fxprep.io import format as io_format
from fxprep.io import pyvalues
from tests.helpers_io import _edit


def _fn(name: str, fn: str, args: list, kwargs: dict | None = None) -> dict:
    return {"name": name, "op": "call_function", "target": {"fn": fn}, "args": args, "kwargs": kwargs or {}}


def _method(name: str, method: str, args: list, kwargs: dict | None = None) -> dict:
    return {"name": name, "op": "call_method", "target": method, "args": args, "kwargs": kwargs or {}}


def _ref(name: str) -> dict:
    return {"$": "node", "v": name}


def _insert(directory: Path, nodes: list) -> None:
    """``nodes`` after the input placeholder ("$x" in their args stands for it)."""
    def change(data):
        x = {"$": "node", "v": data["nodes"][0]["name"]}
        data["nodes"][1:1] = json.loads(json.dumps(nodes).replace('"$x"', json.dumps(x)))
    _edit(directory, io.GRAPH, change)


def _timed_load(directory: Path, **kwargs: Any) -> tuple[float, SerializationError]:
    start = time.perf_counter()
    with pytest.raises(SerializationError) as info:
        io.load(directory, **kwargs)
    return time.perf_counter() - start, info.value


# --- storage grown in place ----------------------------------------------------------------------------------
def test_an_op_that_grows_its_input_in_place_is_counted_before_it_runs(seed_save, monkeypatch):
    """``x.resize_(n)`` returns ``x`` itself: the budget saw no new storage and let it grow past the
    limit. Now the fake run's growth of every tensor an op writes is its need (256 MiB here against a
    64 MiB budget), and the op does not run."""
    directory, _, _ = seed_save
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 64 * 2**20)
    _insert(directory, [_fn("n", "operator.mul", [_ref("size"), 2**26]),
                        _method("size", "numel", ["$x"]), _method("grown", "resize_", ["$x", _ref("n")])])

    def reorder(data):  # numel before the product that reads it
        nodes = data["nodes"]
        size = next(n for n in nodes if n["name"] == "size")
        nodes.remove(size)
        nodes.insert(1, size)
    _edit(directory, io.GRAPH, reorder)
    _, err = _timed_load(directory, allow=["Tensor.resize_", "Tensor.numel"])
    assert "node 'grown' would need" in str(err), err
    assert "forward budget" in str(err) and "It did not run" in str(err)


def test_an_out_argument_resized_by_its_op_is_counted(seed_save, monkeypatch):
    """``torch.add(big, 1, out=x)`` resizes ``x`` to ``big``'s size (a view of nothing: 0 bytes), the
    storage growing in place."""
    directory, _, _ = seed_save
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 64 * 2**20)
    _insert(directory, [
        _method("size", "numel", ["$x"]),
        _fn("n", "operator.mul", [_ref("size"), 2**14]),
        _method("flat", "reshape", ["$x", -1]),
        _method("big", "expand", [_ref("flat"), _ref("n"), -1]),
        _fn("grown", "torch.add", [_ref("big"), 1], {"out": "$x"}),
    ])
    _, err = _timed_load(directory, allow=["Tensor.numel", "torch.add"])
    assert "node 'grown' would need" in str(err) and "forward budget" in str(err), err


# --- Python values -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes, found", [
    ([_fn("big", "operator.pow", [10, 10**8])], "a power with the literal exponent 100,000,000"),  # read statically
    ([_fn("big", "operator.lshift", [1, 2**40])], "a shift by the literal 1,099,511,627,776"),
    ([_method("rows", "size", ["$x", 0]), _fn("e", "operator.add", [_ref("rows"), 10**8]),  # computed: at the run
      _fn("big", "operator.pow", [10, _ref("e")])], "an integer power of 400,000,004 bits"),
    ([_method("rows", "size", ["$x", 0]), _fn("e", "operator.mul", [_ref("rows"), 2**40]),
      _fn("big", "operator.lshift", [1, _ref("e")])], "a shifted integer of 1,099,511,627,777 bits"),
    ([_fn("big", "operator.mul", [[0], 2**32])], "a repeated sequence of 4,294,967,296 items"),
    ([_fn("l0", "operator.mul", [[0], 2**19])]
     + [_fn(f"l{i + 1}", "operator.add", [_ref(f"l{i}"), _ref(f"l{i}")]) for i in range(40)],
     "a concatenation of 2,097,152 items"),  # quadratic building: 40 doublings
    ([_fn(f"m{i}", "operator.mul", [[0], 2**20]) for i in range(40)], "Python values of 16,7"),  # many, each allowed
    ([_fn("big", "operator.mod", ["%0999999999d", 1])], "a string formatted with %"),
])
def test_python_values_the_graph_builds_are_bounded_before_they_are_built(seed_save, nodes, found):
    """Each of these ran for minutes (or took gigabytes) inside load's self-check; now each is refused
    within a second, naming its node and the bound, before the value is built."""
    directory, _, _ = seed_save
    _insert(directory, nodes)
    seconds, err = _timed_load(directory, allow=["operator.pow", "operator.lshift", "operator.mod"])
    assert found in str(err) and ("It did not run" in str(err) or "Nothing was run" in str(err)), err
    assert seconds < 10, seconds  # refused before it is built, not after


def test_the_python_bounds_let_real_graphs_through():
    """Shapes, sizes and indices of real graphs are far inside the bounds."""
    for fn, args in [(__import__("operator").mul, (4096, 128)), (__import__("operator").add, ((1, 8), (16,))),
                     (__import__("operator").pow, (2, 62)), (__import__("operator").getitem, (tuple(range(64)), 3))]:
        pyvalues.check(fn, args, {})


# --- cost and time ------------------------------------------------------------------------------------------
def test_an_op_past_the_flop_budget_does_not_run(seed_save, monkeypatch):
    """A matmul's cost is not its memory: counted on fake tensors before it runs."""
    directory, _, _ = seed_save
    monkeypatch.setitem(io_format.LIMITS, "op_flops", 10_000)
    _insert(directory, [_method("flat", "reshape", ["$x", -1, 32]), _method("flipped", "t", [_ref("flat")]),
                        _fn("product", "torch.matmul", [_ref("flat"), _ref("flipped")])])
    _, err = _timed_load(directory, allow=["torch.matmul"])
    assert "node 'product' would compute" in str(err) and "op_flops" in str(err), err


def test_a_load_past_its_time_limit_stops_with_a_serialization_error(seed_save, monkeypatch):
    """The whole load has LIMITS["load_seconds"]; past it, the self-check stops between two ops with a
    SerializationError naming the node, instead of running on."""
    directory, _, _ = seed_save
    monkeypatch.setitem(io_format.LIMITS, "load_seconds", 0)
    seconds, err = _timed_load(directory)
    assert "LIMITS['load_seconds']" in str(err) and "stopped at node" in str(err), err
    assert seconds < 30


def test_save_refuses_what_every_load_would_stop(tmp_path, monkeypatch):
    """save runs the same self-check with the same limits: a module whose probe run takes longer than
    any load may is not written."""
    model = ModelWithReusedReLU().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32), progress=False)
    monkeypatch.setitem(io_format.LIMITS, "load_seconds", 0)
    with pytest.raises(SerializationError, match=r"cannot save to .*stopped at node .*too slow for its example"):
        io.save(gm, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_literal_exponent_no_input_makes_small_is_refused_before_anything_runs(seed_save):
    """``x.size(0) ** 10**9`` is 1 on the self-check's probe of one row, and a gigabit integer on an
    input of two: the probe run alone would let it through, so literal exponents and shifts are read
    from the graph before anything runs (in every branch)."""
    directory, _, _ = seed_save
    _insert(directory, [_method("rows", "size", ["$x", 0]), _fn("big", "operator.pow", [_ref("rows"), 10**9])])
    _, err = _timed_load(directory, allow=["operator.pow"])
    assert "node 'big' calls a power with the literal exponent 1,000,000,000" in str(err) and "Nothing was run" in str(err)
