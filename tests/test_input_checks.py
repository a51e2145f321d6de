"""Input checks (an assert and the ops that feed it alone) are kept as calls on purpose: what is
left to convert (``remaining_compute_ops``, the zoos' contract) does not count them, and does count
any other call left (Whisper's packed-sequence test failed the transformers zoo before)."""

from __future__ import annotations

import torch
from torch import nn

import fxprep
from fxprep.passes.functional_to_module import remaining_compute_ops


class _ChecksThenComputes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        starts = (positions[:, 1:] - positions[:, :-1]) != 1  # transformers' packed-sequence test, in short
        torch._assert_async(~starts.any())
        return self.lin(x)


def test_an_input_check_is_not_left_to_convert() -> None:
    model = _ChecksThenComputes().eval()
    example = (torch.randn(2, 5, 4), torch.arange(5).repeat(2, 1))
    gm = fxprep.prepare_model(model, example_inputs=example, progress=False)
    checks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._assert_async]
    assert checks, gm.graph  # the check is kept, as a call
    assert remaining_compute_ops(gm) == []
    # a call left that is not a check still counts
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "lin")
    with gm.graph.inserting_after(node):
        extra = gm.graph.call_function(torch.special.erfcx, (node,))
    assert remaining_compute_ops(gm) == [extra]
