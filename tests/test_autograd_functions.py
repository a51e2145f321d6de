"""A custom ``autograd.Function`` in a Dynamo capture is called with the user's own arguments.

Dynamo records ``Fn.apply(...)`` as a higher-order op over its traced bodies, holding the tensors
the forward body reads in the order it first reads them, with non-tensor arguments folded into the
body. Restored as ``Fn.apply(*those tensors)``, a Function that reads its second argument first
(transformers' ``XSoftmax(scores, mask, dim)`` in SEW-D) got its tensors swapped and lost ``dim``:
"XSoftmax.forward() missing 1 required positional argument: 'dim'", so SEW-D could not be prepared.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

import fxprep


class MaskedSoftmax(torch.autograd.Function):
    """``softmax(x)`` where ``mask`` is set, 0 elsewhere; reads ``mask`` before ``x`` (as XSoftmax)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
        hidden = ~mask.to(torch.bool)
        out = torch.softmax(x.masked_fill(hidden, -1e4), dim).masked_fill(hidden, 0.0)
        ctx.dim = dim
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(ctx.dim, keepdim=True)), None, None


class Attention(nn.Module):
    def __init__(self, expression: bool = False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.expression = expression

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        if self.expression:  # arguments the source line cannot name: Dynamo's own form is kept
            return MaskedSoftmax.apply(scores * 1.0, mask[:, None, :] * 1, -1) @ x
        keep = mask[:, None, :]
        return MaskedSoftmax.apply(scores, keep, -1) @ x


def _inputs(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq // 2:] = 0
    return torch.randn(batch, seq, 8, generator=g), mask


def test_a_function_reading_its_arguments_out_of_order_gets_them_in_order_with_its_constants() -> None:
    torch.manual_seed(0)
    model = Attention().eval()
    gm = fxprep.prepare_model(model, example_inputs=_inputs(2, 6, 0), tracer="dynamo", fallback="error")
    assert gm.fxprep_report.tracer == "dynamo"
    assert gm.fxprep_report.verification.status == "passed"
    calls = [m for m in gm.modules() if type(m).__name__ == "AutogradFunction"]
    assert len(calls) == 1 and calls[0].fn.autograd_function is MaskedSoftmax  # the user's class, not Dynamo's bodies
    assert calls[0].args[2] == -1  # the constant the user passed, which Dynamo folded into its body
    x, mask = _inputs(2, 6, 1)
    x.requires_grad_(True)
    torch.testing.assert_close(gm(x, mask), model(x, mask))
    gm(x, mask).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_arguments_the_source_line_does_not_name_keep_dynamos_form_and_verify() -> None:
    torch.manual_seed(0)
    model = Attention(expression=True).eval()
    gm = fxprep.prepare_model(model, example_inputs=_inputs(2, 6, 0), tracer="dynamo", fallback="error")
    assert gm.fxprep_report.verification.status == "passed"
    x, mask = _inputs(2, 6, 1)
    torch.testing.assert_close(gm(x, mask), model(x, mask))


def test_transformers_sew_d_with_its_xsoftmax_prepares_and_runs_like_eager() -> None:
    config = transformers.SEWDConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=32,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, squeeze_factor=2, max_position_embeddings=64, position_buckets=16)
    torch.manual_seed(0)
    model = transformers.SEWDForCTC(config).eval()
    g = torch.Generator().manual_seed(0)
    gm = fxprep.prepare_model(model, example_inputs={"input_values": torch.randn(1, 800, generator=g)})
    assert gm.fxprep_report.verification.status == "passed"
    assert any(type(m).__name__ == "AutogradFunction" and m.fn.autograd_function.__name__ == "XSoftmax"
               for m in gm.modules())
    later = {"input_values": torch.randn(2, 800, generator=g)}
    with torch.no_grad():
        torch.testing.assert_close(gm(**later)["logits"], model(**later).logits)
