"""Running the user's model without changing it.

Capture (Dynamo's recording run, the hybrid tracer's structure run) and verification all run the
user's own model eagerly. Each run must leave the model exactly as it was: a train-mode BatchNorm
would otherwise update its running statistics, and a forward that counts calls would count fxprep's
runs. Every run also uses fresh copies of the inputs (a model may write into them) and the same RNG
seed, so dropout in train mode draws the same masks in the original and in the prepared module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .inputs import ExampleInputs

SEED = 20260611


@contextlib.contextmanager
def preserved_state(*modules: nn.Module) -> Iterator[None]:
    """Restore every buffer (and the RNG) of ``modules`` on exit: running a model must not change it."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for module in modules:
        for buf in module.buffers():
            if id(buf) not in seen:
                seen.add(id(buf))
                saved.append((buf, buf.detach().clone()))
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, value in saved:
                    if buf.shape == value.shape:
                        buf.copy_(value)


def run_model(model: nn.Module, example: ExampleInputs, *, grad: bool = False, what: str = "the model") -> Any:
    """Run ``model`` on a fresh copy of ``example`` with the fixed seed."""
    fresh = example.fresh_copy()
    torch.manual_seed(SEED)
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx:
        return model(*fresh.args, **fresh.kwargs)
