"""Preparing a model never copies its parameters (issue 60; the brief: models are big).

Dynamo's export keeps a real value beside each tensor it wraps, and it made them by cloning: each
parameter a forward reads outside a leaf module was copied twice per capture, on both Dynamo routes
(torch 2.8, 2.13 and 2.14 alike). The Qwen2-VL-2B shape's default prepare peaked at about three
bytes per parameter byte beyond the model, and a second prepare ran out of memory.

Measured as the process's peak resident memory (in a child process of its own, after a warm-up
prepare of the same model at a small width): what ``prepare_model`` adds to the peak that building
the model reached, for a parameter of 128-256 MB and activations of a few kilobytes. (Counting
allocations is not the measure: torch allocates a real tensor's storage before aliasing it, an
allocation no page of which is ever written.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import fxprep


class Projected(nn.Module):
    """A parameter read by the model's own code (``x @ self.weight``), so Dynamo wraps it."""

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, dtype=dtype) / width ** 0.5)
        self.norm = nn.LayerNorm(width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.weight)


class Head(nn.Module):
    """Keeps the first ``n`` positions, ``n`` read from data: Dynamo alone makes this opaque."""

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 8, dtype=dtype)

    def forward(self, h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = h[:, : int(n)]
        if h.shape[1] > 1:
            h = h - h.mean(1, keepdim=True)
        return self.proj(h)


class ReadsValues(nn.Module):
    """Prepared on the ``dynamo+values`` route (tests/test_values.py's model, with a big parameter)."""

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        super().__init__()
        self.stem = Projected(dtype, width)
        self.head = Head(dtype, width)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x), n)


def _built(name: str, dtype: torch.dtype, width: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model, its example, and one eager run of it."""
    torch.manual_seed(0)
    if name == "projected":
        model: nn.Module = Projected(dtype, width).eval()
        example: tuple[torch.Tensor, ...] = (torch.randn(2, 3, width, dtype=dtype),)
    else:
        model = ReadsValues(dtype, width).eval()
        example = (torch.randn(2, 6, width, dtype=dtype), torch.tensor(4))
    with torch.no_grad():
        model(*example)
    return model, example


def _peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _child(name: str, dtype_name: str) -> None:
    """Run in a process of its own: the peak resident memory a prepare adds, as JSON."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    small, small_example = _built(name, dtype, 64)
    fxprep.prepare_model(small, example_inputs=small_example)  # imports and Dynamo's first-use costs
    model, example = _built(name, dtype, 8192)
    built = _peak()
    gm = fxprep.prepare_model(model, example_inputs=example)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"added": _peak() - built, "params": params, "tracer": gm.fxprep_report.tracer,
                      "verification": gm.fxprep_report.verification.status,
                      "own": all(any(p is q for q in model.parameters()) for p in gm.parameters())}))


@pytest.mark.smoke  # torch 2.8 too (make test-oldest): the hook differs by version
@pytest.mark.parametrize(("name", "dtype", "tracer"), [
    ("projected", "float32", "dynamo"),
    ("projected", "bfloat16", "dynamo"),
    ("values", "float32", "dynamo+values"),
    ("values", "bfloat16", "dynamo+values"),
])
def test_a_prepare_adds_no_copy_of_a_parameter_to_the_peak(name: str, dtype: str, tracer: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "src")])}
    code = f"from tests.test_no_copies import _child; _child({name!r}, {dtype!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tracer"] == tracer and got["verification"] == "passed" and got["own"]
    # Before: +2x the parameters on both routes (Dynamo's real-value cache cloned each one, twice).
    assert got["added"] < got["params"] // 4, got


@pytest.mark.parametrize("name", ["projected", "values"])
def test_the_prepared_module_reads_the_users_parameters(name: str) -> None:
    model, example = _built(name, torch.float32, 256)
    gm = fxprep.prepare_model(model, example_inputs=example)
    assert all(any(p is q for q in model.parameters()) for p in gm.parameters())
    torch.testing.assert_close(gm(*example), model(*example))
