"""The compression-SDK seed's non-traceable model (shared/seeds/000) and its traceable rewrite.

    fxprep check examples/non_traceable.py:NonTraceableModel --input 1x10
    fxprep prepare examples/non_traceable.py:TraceableModel --input 1x10 -o out/traceable
"""

import torch
from torch import nn


class NonTraceableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        # use "if" statement which will NOT be traceable
        if x.sum() > 0:
            return self.linear(x)
        else:
            return torch.zeros(10)


class TraceableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        # use torch operations instead of "if" statement
        condition = x.sum() > 0
        linear_output = self.linear(x)
        linear_output = linear_output * condition
        return linear_output
