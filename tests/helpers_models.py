"""Small models shared by several test files.

``Tower`` (tests/test_dynamo_opaque.py, test_values.py): blocks whose control flow depends on values,
each made an opaque part. ``selective_scan`` and ``Recurrent`` (tests/test_scans.py,
test_reuse_opaque.py): per-step loops as transformers' torch fallbacks write them. ``tiny_llama``
(tests/test_verify_meaning.py, test_wrapped_forward.py): a two-layer Llama with random weights.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """A block whose data-dependent part is one helper function: only it must be opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for k, c in enumerate((h > 0).sum(-1).tolist()):  # control flow on data-dependent values
            if c % 2:
                h = h + k
        return self.down(h)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def kernel_fallback(fn: Any) -> Any:
    """A decorator like transformers' hub-kernel fallback: the module binds the wrapper."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapped


@kernel_fallback
def selective_scan(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """One step per position; ``decay`` is a parameter the caller passes in."""
    state = torch.zeros_like(x[:, 0])
    out = []
    for t in range(x.shape[1]):
        state = state * torch.sigmoid(decay) + x[:, t]
        out.append(state)
    return torch.stack(out, dim=1)


class Recurrent(nn.Module):
    """A helper method runs the loop, as RecurrentGemma's ``_rnn_scan``; ``reads_weight``: the
    method reads a parameter of its module itself (then it must stay traced)."""

    def __init__(self, reads_weight: bool):
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.decay = nn.Parameter(torch.linspace(-1, 1, 8))
        self.reads_weight = reads_weight

    def _scan(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            decay = torch.sigmoid(self.decay) if self.reads_weight else gate[:, t]
            state = state * decay + x[:, t]
            out.append(state)
        return torch.stack(out, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scan(x, torch.sigmoid(self.gate(x)))


def tiny_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def llama_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(2, 5, dtype=torch.long)}


def chunked_scan(x: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Padded to whole chunks, one step per chunk, the padding cut off again: a branch on the
    length inside a scan that returns a tensor either way (Mamba2's ``if pad_size > 0``)."""
    length = x.shape[1]
    pad = (chunk - length % chunk) % chunk
    x = nn.functional.pad(x, (0, 0, 0, pad))
    state = torch.zeros_like(x[:, :chunk])
    out = []
    for i in range(x.shape[1] // chunk):
        state = 0.5 * state + x[:, i * chunk:(i + 1) * chunk].cumsum(1)
        out.append(state)
    y = torch.cat(out, dim=1)
    if pad > 0:
        y = y[:, :length]
    return y
