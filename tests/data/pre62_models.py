"""Models of the pre-issue-62 saves in ``tests/data/pre62_saves`` (written by ``make_pre62_saves.py``).

Why a file of its own: an opaque part and an excluded module are saved by the importable name of their
code (``tests.data.pre62_models.Gated.post``), so these classes must keep this module path for those
saves to load. Never move or rename this file or its classes; add new ones instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Plain(nn.Module):
    """Conv, linear and functional calls: the functional ones become ``fxprep.ops`` modules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        h = F.max_pool2d(h, 2) + 0.5 * torch.sigmoid(h[:, :, ::2, ::2])
        return F.softmax(self.fc(torch.flatten(h, 1)), dim=-1)


class Helper:
    """A plain object with a data-dependent method: an opaque part owned by a helper object."""

    def clip(self, x: torch.Tensor) -> torch.Tensor:
        if x.max() > 1:
            return x.clamp(max=1)
        return x


def shrink(x: torch.Tensor) -> torch.Tensor:
    """A free function with a data-dependent branch: an ``OpaqueFunction`` part."""
    if x.sum() > 0:
        return x * 0.5
    return x


class Excluded(nn.Module):
    """Kept whole by ``modules_to_exclude``: saved by its class name."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Gated(nn.Module):
    """Opaque parts (a method, a helper's method, a free function; ``fxprep.capture.sites``) and an
    excluded submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.keep = Excluded()
        self.helper = Helper()

    def post(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.min() > 0 else x.abs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.post(self.a(x))
        y = self.keep(self.helper.clip(y))
        return self.b(shrink(y))


class Branch(nn.Module):
    """A data-dependent branch whose untaken side gives NaN: ``control_flow="rewrite"`` makes it a
    ``torch.cond``, saved as ``fxprep.cond.cond``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.min() > 0:
            return self.fc(torch.log(x))
        return x


class Head(nn.Module):
    """Keeps the first ``n`` positions (an integer input's value) and branches on how many: captured
    by ``dynamo+values``, each decision a ``fxprep.decisions.check_decision`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = h[:, : int(n)]
        if h.shape[1] > 1:
            h = h - h.mean(1, keepdim=True)
        return self.proj(h)


class Decided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = Head()

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x), n)
