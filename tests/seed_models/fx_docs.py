"""The code examples of the torch.fx documentation seed (shared/seeds/002), kept as written.

``torch.fx.wrap('len')`` / ``torch.fx.wrap('sqrt')`` must run at module scope, so these live in
their own module rather than inside a test function.
"""

from math import sqrt

import torch
import torch.fx

torch.fx.wrap("len")
torch.fx.wrap("sqrt")


def normalize(x):
    """Normalize `x` by the size of the batch dimension"""
    return x / sqrt(len(x))


class NormalizeModel(torch.nn.Module):
    def forward(self, x):
        return normalize(x)


class ModelWithNonTorchFunction(torch.nn.Module):
    """AIMET seed: ``x / sqrt(len(x))`` with wrap('len')/wrap('sqrt') at module scope."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=2, stride=2, padding=2, bias=False)

    def forward(self, *inputs):
        x = self.conv(inputs[0])
        return x / sqrt(len(x))


@torch.fx.wrap
def custom_function_not_to_be_traced(x, y):
    """Function which we do not want to be traced (AIMET seed)."""
    for _ in range(2):
        x += x
        y += y
    return x * x + y * y


class ModelWithWrappedFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return custom_function_not_to_be_traced(self.lin(x), y)


@torch.fx.wrap
def do_not_trace_me(x):
    return torch.arange(x.shape[0], device=x.device)


class ArangeWrapped(torch.nn.Module):
    def forward(self, x):
        return x + do_not_trace_me(x)
