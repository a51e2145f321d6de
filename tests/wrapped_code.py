"""Functions replaced, at their module-level names, by wrapper objects that call them (what the
``kernels`` package does to transformers' scan functions): the saved name of the function inside
must still load, by identity, from a trusted package (tests/test_io_wrapped_code.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _wrapped(func: Any) -> nn.Module:
    class Func(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

    return Func()


def scan(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1)


SCAN = scan  # the function itself, kept before its name is taken by the wrapper
scan = _wrapped(scan)  # type: ignore[assignment]  # noqa: F811 - the name now holds the wrapper, as kernels does


def other(x: torch.Tensor) -> torch.Tensor:
    return x * 2


# a wrapper whose function names itself elsewhere: its name must not load that function
elsewhere = _wrapped(SCAN)
