"""Issue 27, item 2: verification honest in low precision.

A right bf16/fp16 graph 32 layers deep passes by default, while each deliberately broken graph
(tests/broken_graphs.py: a dropped residual, a swapped weight, a wrong mask, one extra bf16
rounding) fails; the localisation names the node that broke, not a later Linear.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import fxprep

from .broken_graphs import BREAKS, wrong_mask

LAYERS = 32


def _llama(dtype: torch.dtype, layers: int = LAYERS):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = tf.LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids}


@pytest.fixture(scope="module", params=[torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.zoo)],
                ids=["bf16", "fp16"])
def prepared(request):
    model, inputs = _llama(request.param)
    gm = fxprep.prepare_model(model, example_inputs=inputs)  # verified by default: a right graph passes
    return gm, inputs


def test_right_deep_graph_passes(prepared) -> None:
    gm, inputs = prepared
    v = fxprep.get_report(gm).verification
    assert v.status == "passed" and v.rtol == 0.0 and v.atol > 0
    again = fxprep.verify_prepared(gm, inputs)
    assert again.status == "passed"


def test_kernel_choice_does_not_decide(prepared) -> None:
    """A right graph whose attention takes another kernel than eager (the explicit causal mask the
    capture used to materialise) still passes: both sides are compared with the math kernel."""
    gm, inputs = prepared
    ops = [m for n, m in gm.named_modules() if n.endswith("scaled_dot_product_attention")]
    assert len(ops) == LAYERS
    seq = inputs["input_ids"].shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    before = [dict(op.kwargs) for op in ops]
    try:
        for op in ops:
            op.kwargs = {**op.kwargs, "is_causal": False, "attn_mask": causal}
        assert fxprep.verify_prepared(gm, inputs).status == "passed"
    finally:
        for op, kw in zip(ops, before):
            op.kwargs = kw


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_graph_fails(prepared, name: str) -> None:
    gm, inputs = prepared
    with BREAKS[name](gm, 5), pytest.raises(fxprep.EquivalenceError):
        fxprep.verify_prepared(gm, inputs)


def test_localisation_names_the_attention() -> None:
    """A broken attention in layer 1: the first node whose inputs agree and output differs is the
    SDPA op module, not the o_proj Linear after it (which the leaf-module comparison named)."""
    model, inputs = _llama(torch.float32, layers=2)
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    with wrong_mask(gm, 1), pytest.raises(fxprep.EquivalenceError) as err:
        fxprep.verify_prepared(gm, inputs)
    assert "First diverging node: 'model.layers.1.self_attn.sdpa_attention_forward.scaled_dot_product_attention'" in str(err.value)
    assert "is_causal=False" in str(err.value)
    assert err.value.module == "model.layers.1.self_attn.sdpa_attention_forward.scaled_dot_product_attention"
