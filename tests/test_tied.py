"""Tied outputs (:mod:`fxprep.capture.dynamo.tied`): under dynamic shapes a block stand-in's output is
taken from a static run and tied to an input's symbolic sizes; the block's own capture must then
prove the tie and every shape guard the block made, or the capture is redone with the block run on
the symbols. A graph built on an unproven guess would run at other sizes and compute something else.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import fxprep
from fxprep.capture.dynamo import reuse, tied


class _Branchy(nn.Module):
    """Takes another path above 20 tokens: Dynamo guards the block's capture on ``seq <= 20``,
    which a guess from the static run at 16 tokens never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 20:
            return self.lin(x) * 2
        return self.lin(x)


class _Fixed(nn.Module):
    """Always 16 positions out: shaped like its input at the example's 16 tokens only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], 16, x.shape[2]) + self.lin(x).mean(1, keepdim=True)


class _Doubling(nn.Module):
    """Twice as many positions out as in: shaped like no input, so nothing is guessed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.lin(x), x], dim=1)


class _Net(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.mean(dim=1) * x.shape[1]


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """What :func:`tied.guess` and :func:`tied.disproof` returned (both run as they are)."""
    seen: dict[str, list] = {"guess": [], "disproof": []}
    guess, disproof = tied.guess, tied.disproof

    def spy_guess(*args, **kwargs):
        out = guess(*args, **kwargs)
        seen["guess"].append(out)
        return out

    def spy_disproof(*args, **kwargs):
        out = disproof(*args, **kwargs)
        seen["disproof"].append(out)
        return out

    monkeypatch.setattr(tied, "guess", spy_guess)
    monkeypatch.setattr(reuse, "disproof", spy_disproof)
    return seen


@pytest.mark.parametrize("block", [_Branchy, _Fixed])
def test_an_unproven_guess_is_not_kept(block: type[nn.Module], spied: dict[str, list]) -> None:
    torch.manual_seed(0)
    net = _Net(block).eval()
    gm = fxprep.prepare_model(net, example_inputs={"x": torch.randn(2, 16, 8)}, dynamic={"x": {1: "seq"}})
    assert any(g is not None for g in spied["guess"])  # the static run tied the output to the input
    for seq in (16, 24, 40):
        x = torch.randn(2, seq, 8)
        torch.testing.assert_close(gm(x), net(x))


def test_an_output_shaped_like_no_input_is_computed_on_the_symbols(spied: dict[str, list]) -> None:
    torch.manual_seed(0)
    net = _Net(_Doubling).eval()
    gm = fxprep.prepare_model(net, example_inputs={"x": torch.randn(2, 16, 8)}, dynamic={"x": {1: "seq"}})
    assert spied["guess"] and all(g is None for g in spied["guess"])
    for seq in (5, 16, 24):
        x = torch.randn(2, seq, 8)
        torch.testing.assert_close(gm(x), net(x))


def test_a_guard_the_call_does_not_prove_is_found(spied: dict[str, list]) -> None:
    net = _Net(_Branchy).eval()
    fxprep.prepare_model(net, example_inputs={"x": torch.randn(2, 16, 8)}, dynamic={"x": {1: "seq"}}, verify=False)
    found = [d for d in spied["disproof"] if d is not None]
    assert found and "guards on" in found[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_decoder_layers_are_tied_and_proven(name: str, dtype: torch.dtype, spied: dict[str, list]) -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        name, vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    example = {"input_ids": torch.randint(3, 101, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    assert spied["guess"] and all(g is not None and g[1][0][0] == "tie" for g in spied["guess"])
    assert spied["disproof"] and all(d is None for d in spied["disproof"])  # every call proven
    assert any(fxprep.get_report(gm).reuse["captured"].values())  # block reuse kept
    ids = torch.randint(3, 101, (3, 13))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[0, :4] = 0  # a padded row
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = gm(input_ids=ids, attention_mask=mask)["logits"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_two_sizes_alike_in_the_example_are_not_guessed() -> None:
    # Llava-NeXT's merged text length and its mask's are two symbols at one size in the outer capture; its
    # decoder layer's own capture finds them equal, which no guessed output can be proven against, so the
    # outer capture was made a second time: the block is run on the symbols from the start instead
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    a, b = (mode.from_tensor(torch.zeros(2, 8), symbolic_context=context) for _ in range(2))
    c = mode.from_tensor(torch.zeros(2, 9), symbolic_context=context)
    assert a.shape[1] is not b.shape[1] and str(a.shape[1]) != str(b.shape[1])
    assert tied.alike([a, b]) and tied.alike([a, 3, b])
    assert not tied.alike([a, a]) and not tied.alike([a, c[:, :5]]) and not tied.alike([a, torch.zeros(2, 8)])
