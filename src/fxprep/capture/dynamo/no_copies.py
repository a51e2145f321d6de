"""Dynamo traces the user's parameters without copying them.

``torch._dynamo.export`` keeps a real value beside every tensor it finds on a module (its
``real_value_cache``) and made it by cloning: each parameter was copied twice per capture (the
Qwen2-VL-2B shape's prepare ran out of memory); on the ``dynamo+values`` route torch 2.14 also
clones the storages it gives fake tensors as their real values. A parameter is not written by a
forward, so an alias serves as well: :func:`parameters_aliased`. Buffers and inputs are still copied
(a forward may write them in place). The story and the numbers: docs/concepts/sharing.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...core.threads import confined


@contextlib.contextmanager
def parameters_aliased() -> Iterator[None]:
    """For the length of one capture on this thread: Dynamo's real-value cache and real-value
    propagation's storages alias each ``nn.Parameter`` instead of cloning it (module docstring).
    Where this torch has neither hook (it names them privately and may move them), nothing changes:
    the parameters are copied as before, the capture is the same."""
    from torch._dynamo.variables import builder
    from torch._subclasses import meta_utils

    patches: list[tuple[Any, str, Any, Any]] = []  # (owner, name, torch's function, this thread's)
    clone_input = getattr(builder, "_clone_input", None)
    if clone_input is not None:
        def cached(value: Any, fake_mode: Any) -> Any:
            if isinstance(value, nn.Parameter):
                # same storage and version counter; requires_grad as a clone of it would have
                return value.detach().requires_grad_(value.requires_grad)
            return clone_input(value, fake_mode)
        patches.append((builder, "_clone_input", clone_input, confined(cached, clone_input)))
    clone_storage = getattr(meta_utils, "_clone_real_storage_from_tensor", None)
    if clone_storage is not None:
        def storage(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter):
                return t.untyped_storage()
            return clone_storage(t)
        patches.append((meta_utils, "_clone_real_storage_from_tensor", clone_storage, confined(storage, clone_storage)))
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, original, _ in patches:
            setattr(owner, name, original)
