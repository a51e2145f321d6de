"""The same ``x / sqrt(len(x))`` without any ``torch.fx.wrap``: fxprep's tracer records len itself."""

from math import sqrt

import torch


class PlainLen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=2, stride=2, padding=2, bias=False)

    def forward(self, x):
        x = self.conv(x)
        return x / sqrt(len(x))


class ZerosFromShape(torch.nn.Module):
    """torch.zeros sized from a traced shape (fails in plain torch.fx)."""

    def forward(self, x):
        return torch.cat([x, torch.zeros(x.size(0), 4, dtype=x.dtype)], dim=1)


class ArangeFromShape(torch.nn.Module):
    """The AIMET seed's non-traceable ``torch.arange(x.shape[0], device=x.device)``."""

    def forward(self, x):
        return x + torch.arange(x.shape[0], device=x.device)
