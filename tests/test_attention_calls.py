"""Issue 27, item 1: the prepared graph calls attention the way eager does, kernel for kernel.

transformers builds no mask and calls SDPA with ``is_causal=True`` in eager where it can; under a
trace it used to materialise a 4D mask instead (another kernel on CUDA: bf16 results drift with
depth, 8k-token attention 1.3x slower). Each test records the attention calls of an eager run and
of the prepared run (``tests/attention_calls.py``, a TorchFunctionMode) and requires them equal:
mask (None, or shape/dtype/values), is_causal, dropout_p, scale, enable_gqa, q/k/v shapes.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import fxprep
from fxprep.families.transformers.attention import VALUE_DEPENDENT, WINDOW_LIMIT, WINDOWED

from . import vlm_models
from .attention_calls import differences, record

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)


def _build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    elif name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL))
    elif name == "mistral":  # a window past the examples' 12 tokens: eager's calls, the length limited to it
        model = tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=64))
    elif name == "gemma2":  # transformers runs Gemma2 with its eager attention (no SDPA support)
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16, sliding_window=8))
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa")
        model = tf.BertModel(cfg, add_pooling_layer=False)
    else:
        raise ValueError(name)
    return model.to(dtype).eval()


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def _padded(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in the first row
    return mask


def _check(model: torch.nn.Module, inputs: dict) -> fxprep.PreparedModule:
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    eager, prepared = record(model, inputs), record(gm, inputs)
    uses_sdpa = any(getattr(c, "_attn_implementation", None) == "sdpa" for c in _configs(model))
    assert bool(eager) == uses_sdpa, "an SDPA model made no attention call: the test would prove nothing"
    assert differences(eager, prepared) == []
    assert gm.fxprep_report.verification.attention == ""  # fxprep's own recording agrees: nothing to name
    return gm


def _configs(model: torch.nn.Module) -> list:
    config = model.config
    return [config] + [getattr(config, k) for k in ("text_config",) if getattr(config, k, None) is not None]


TEXT = ["llama", "qwen2", "mistral", "gemma2", "bert"]
ZOO = pytest.mark.zoo  # the default suite keeps one case per kind; `make test-zoo` runs them all
CASES = [pytest.param(n, d, id=f"{n}-{i}", marks=() if (n, i) in {
    ("llama", "fp32"), ("llama", "bf16"), ("qwen2", "bf16"), ("mistral", "fp32"), ("gemma2", "bf16"), ("bert", "fp32"),
    ("bert", "bf16")} else ZOO) for n in TEXT for d, i in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_no_attention_mask_same_calls(name: str, dtype: torch.dtype) -> None:
    """The issue's case: ids only. Eager calls SDPA with no mask (is_causal=True for decoders); so
    must the graph, and its output must match exactly (same kernels, same order)."""
    model = _build(name, dtype)
    gm = _check(model, {"input_ids": _ids()})
    calls = record(gm, {"input_ids": _ids()})
    assert all(c["mask"] is None for c in calls)
    assert gm.fxprep_report.verification.max_abs_diff == 0.0


@pytest.mark.parametrize("name", [n if n in ("llama", "bert") else pytest.param(n, marks=ZOO) for n in TEXT])
def test_padded_batch_same_calls(name: str) -> None:
    """A padded batch: eager materialises the mask (it reads the padding), the graph the same one."""
    model = _build(name, torch.float32)
    ids = _ids()
    calls = record(_check(model, {"input_ids": ids, "attention_mask": _padded(ids)}), {"input_ids": ids,
                                                                                      "attention_mask": _padded(ids)})
    assert all(c["mask"] is not None for c in calls)
    assert calls or name == "gemma2"


def test_padded_batch_bf16() -> None:
    ids = _ids()
    _check(_build("llama", torch.bfloat16), {"input_ids": ids, "attention_mask": _padded(ids)})


def test_all_ones_attention_mask_is_named() -> None:
    """The place the graph cannot follow eager: an attention_mask with no padding. Eager reads its
    values and drops it; a graph cannot read values, so it keeps the (all-true) mask. The calls then
    differ only by the mask, outputs agree, and the report says why."""
    model = _build("llama", torch.float32)
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    eager, prepared = record(model, inputs), record(gm, inputs)
    assert [c["mask"] for c in eager] == [None, None]
    assert all(c["mask"] is not None and not c["is_causal"] for c in prepared)
    assert any(VALUE_DEPENDENT in n for n in gm.fxprep_report.notes)
    named = gm.fxprep_report.verification.attention  # and the verification's own recording shows it
    assert "2 of 2 differ" in named and "eager attn_mask=None, is_causal=True" in named
    assert named in gm.fxprep_report.notes
    # with padding, the same graph makes eager's calls
    padded = {"input_ids": ids, "attention_mask": _padded(ids)}
    assert differences(record(model, padded), record(gm, padded)) == []


def _windowed() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=8)).eval()


def test_a_sliding_window_past_a_short_example_is_a_limit_not_a_silent_difference() -> None:
    """Eager skips the mask of a sliding-window layer only below the window: a decision on the length.
    Taken eagerly under a dynamic length, the graph computed full causal attention past the window
    without a word (max |diff| 0.1 at 20 tokens, window 8). An example shorter than the window keeps
    eager's calls, and a call past it is refused, saying how to prepare for longer ones."""
    model = _windowed()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 6)})
    assert any(WINDOW_LIMIT.split("{")[0] in n and "at least 8 tokens" in n for n in gm.fxprep_report.notes)
    for batch, seq in ((2, 6), (3, 2), (2, 7)):
        ids = _ids(batch, seq)
        eager, prepared = record(model, {"input_ids": ids, "use_cache": False}), record(gm, {"input_ids": ids})
        assert [c["mask"] for c in eager] == [None, None] and differences(eager, prepared) == []
    with pytest.raises(fxprep.InputMismatch, match="local_attention_size"):
        gm(input_ids=_ids(2, 20))


def test_an_example_as_long_as_the_window_masks_it_at_every_length() -> None:
    """An example at least as long as the window: the graph builds the windowed mask at every length,
    exact on both sides of the window; eager's calls above it, and below it the difference (the
    mask) named in the report. dynamic=False keeps eager's calls at the example's length."""
    model = _windowed()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 10)})
    assert any(WINDOWED.split("{")[0] in n and "(8 tokens here)" in n for n in gm.fxprep_report.notes)
    for batch, seq in ((2, 5), (3, 8), (2, 9), (2, 20), (1, 33)):
        ids = _ids(batch, seq)
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids).logits, model(input_ids=ids, use_cache=False).logits,
                                       rtol=0, atol=0)
        eager, prepared = record(model, {"input_ids": ids, "use_cache": False}), record(gm, {"input_ids": ids})
        if seq >= 8:
            assert differences(eager, prepared) == []
        else:
            assert [c["mask"] for c in eager] == [None, None] and all(c["mask"] is not None for c in prepared)
    static = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 6)}, dynamic=False)
    ids = _ids(1, 6)
    assert differences(record(model, {"input_ids": ids, "use_cache": False}), record(static, {"input_ids": ids})) == []


def test_packed_positions_check() -> None:
    """Without position_ids the graph takes eager's 'one sequence per row' answer for the positions the
    model computes (arange); passing position_ids keeps them data, and packed ones are masked as in eager."""
    model = _build("llama", torch.float32)
    ids = _ids(1, 12)
    pos = torch.cat([torch.arange(6), torch.arange(6)]).unsqueeze(0)  # two packed sequences
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids, "position_ids": torch.arange(12)[None]})
    packed = {"input_ids": ids, "position_ids": pos}
    eager, prepared = record(model, {**packed, "use_cache": False}), record(gm, packed)
    assert eager[0]["mask"] is not None and differences(eager, prepared) == []
    torch.testing.assert_close(gm(**packed).logits, model(**packed, use_cache=False).logits, rtol=0, atol=0)
    plain = fxprep.prepare_model(model, example_inputs={"input_ids": ids})  # positions computed: arange
    assert differences(record(model, {"input_ids": ids, "use_cache": False}), record(plain, {"input_ids": ids})) == []


def _vlm(builder, dtype: torch.dtype, mask: str):
    model, inputs = builder()
    model = model.to(dtype)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    if mask == "none":
        inputs.pop("attention_mask")
    return model, inputs


@pytest.mark.parametrize(("builder", "dtype"), [
    pytest.param(vlm_models.qwen2_vl, torch.float32, id="qwen2_vl-fp32", marks=ZOO),
    pytest.param(vlm_models.qwen2_vl, torch.bfloat16, id="qwen2_vl-bf16", marks=ZOO),
    pytest.param(vlm_models.llava_pixtral, torch.float32, id="llava-fp32", marks=ZOO),
    pytest.param(vlm_models.llava_pixtral, torch.bfloat16, id="llava-bf16", marks=ZOO),
])
def test_vlm_same_calls(builder, dtype: torch.dtype) -> None:
    """VLMs (zoo: 45-110 s each on the shared 2-core machine): vision tower and language model alike."""
    model, inputs = _vlm(builder, dtype, "none")
    _check(model, inputs)


class _CausalUnlessCompiling(torch.nn.Module):
    """A library that takes another attention path under a trace (as transformers' mask code
    did): eager passes is_causal=True, a trace builds the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        if torch.compiler.is_compiling():
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_called_otherwise_is_named_in_the_report() -> None:
    """Where the capture cannot take eager's attention path, the report says so, from the attention
    calls of verification's two runs (fxprep.verify.attention_calls): a toy library that branches on
    compiling."""
    torch.manual_seed(0)
    toy = _CausalUnlessCompiling().eval()
    gm = fxprep.prepare_model(toy, example_inputs={"x": torch.randn(2, 5, 16)})
    named = gm.fxprep_report.verification.attention
    assert gm.fxprep_report.verification.status == "passed"
    assert "1 of 1 differ" in named and "eager attn_mask=None, is_causal=True" in named
    assert "attn_mask=Tensor[5x5, bool], is_causal=False" in named and named in gm.fxprep_report.notes


def _biogpt(dtype: torch.dtype) -> torch.nn.Module:
    config = tf.BioGptConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return tf.BioGptForCausalLM(config).to(dtype).eval()


def _pix2struct_text(dtype: torch.dtype) -> torch.nn.Module:
    config = tf.Pix2StructTextConfig(vocab_size=128, hidden_size=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                     attn_implementation="sdpa")
    config.initializer_range = 0.02  # read by its weight init, missing from the text config alone
    torch.manual_seed(0)
    return tf.Pix2StructTextModel(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [_biogpt, _pix2struct_text], ids=["biogpt", "pix2struct_text"])
def test_a_padding_mask_the_model_fills_with_ones_is_skipped_as_eager_skips_it(build, dtype) -> None:
    """BioGPT and Pix2Struct fill an all-ones padding mask themselves when none is given; eager reads
    it, finds no padding and calls SDPA without one. The graph does too (the mask builder gets none,
    fxprep.families.transformers.unpadded), at the example's size and at others, exactly; a padding mask the
    user gives is still applied."""
    model = build(dtype)
    forward = type(model.base_model if hasattr(model, "base_model") else model).forward
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8)})
    assert gm.fxprep_report.verification.status == "passed" and not gm.fxprep_report.verification.attention
    for ids in (_ids(1, 8), _ids(3, 13)):
        eager, prepared = record(model, {"input_ids": ids}), record(gm, {"input_ids": ids})
        assert eager and differences(eager, prepared) == []
        with torch.no_grad():
            assert torch.equal(_first(gm(input_ids=ids)), _first(model(input_ids=ids)))
    # the class keeps its own method, and no copy is left on the instances
    assert type(model.base_model if hasattr(model, "base_model") else model).forward is forward
    assert all("forward" not in m.__dict__ for m in model.modules())
    # a mask the user gives is the user's data: applied as given (a materialised mask, as eager's)
    ids = _ids(2, 12)
    inputs = {"input_ids": ids, "attention_mask": _padded(ids)}
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    eager, prepared = record(model, inputs), record(gm, inputs)
    assert differences(eager, prepared) == [] and any(c["mask"] is not None for c in prepared)
    with torch.no_grad():
        assert torch.equal(_first(gm(**inputs)), _first(model(**inputs)))


def _first(output) -> torch.Tensor:
    """The logits (or last hidden state) of a model's or a prepared module's output."""
    return output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))


def test_the_ones_mask_is_dropped_only_where_the_builder_makes_the_same_mask_without_it() -> None:
    """fxprep.families.transformers.unpadded: the source rewrite applies only where the mask's one assignment
    is the ``torch.ones`` of an ``if mask is None``, and the builder is given none only where that
    is the same mask (2D, as long as the keys, no cache, no positions to look for packing in)."""
    import ast

    from transformers import masking_utils

    from fxprep.families.transformers import unpadded as hf_unpadded

    namespace = {"create_causal_mask": masking_utils.create_causal_mask, "torch": torch}
    filled = ast.parse("def f(x, attention_mask=None):\n    if attention_mask is None:\n"
                       "        attention_mask = torch.ones(2, 3)\n"
                       "    return create_causal_mask(config=1, inputs_embeds=x, attention_mask=attention_mask)\n").body[0]
    assert hf_unpadded.rewrite(filled, namespace) == {hf_unpadded.HELPER: hf_unpadded.unpadded}
    text = ast.unparse(filled)
    assert "_fxprep_unpadded(create_causal_mask, _fxprep_ones_attention_mask)(" in text
    assert text.index("_fxprep_ones_attention_mask = False") < text.index("if attention_mask is None")
    reassigned = ast.parse(ast.unparse(ast.parse("def f(x, attention_mask=None):\n    if attention_mask is None:\n"
                                                 "        attention_mask = torch.ones(2, 3)\n"
                                                 "    attention_mask = attention_mask.view(-1, 3)\n"
                                                 "    return create_causal_mask(1, x, attention_mask)\n"))).body[0]
    assert hf_unpadded.rewrite(reassigned, namespace) is None
    another = ast.parse("def f(x, attention_mask=None):\n    if attention_mask is None:\n"
                        "        attention_mask = torch.ones(2, 3)\n"
                        "    return create_causal_mask(1, x, attention_mask)\n").body[0]
    assert hf_unpadded.rewrite(another, {"create_causal_mask": lambda *a: None, "torch": torch}) is None

    # `and not is_torchdynamo_compiling()` (transformers' own) is cut where the branch computes sizes only
    from transformers.utils import is_torchdynamo_compiling

    guarded = ("def f(x, seq, attention_mask=None):\n    if attention_mask is None and not is_torchdynamo_compiling():\n"
               "        n = seq + 0\n        attention_mask = torch.ones(2, n)\n"
               "    return attention_mask[:, None]\n")
    tree = ast.parse(guarded).body[0]
    assert hf_unpadded.rewrite(tree, {**namespace, "is_torchdynamo_compiling": is_torchdynamo_compiling}) == {}
    assert "if attention_mask is None:" in ast.unparse(tree)
    tree = ast.parse(guarded).body[0]  # another function of that name: left as it is
    assert hf_unpadded.rewrite(tree, {**namespace, "is_torchdynamo_compiling": lambda: False}) is None
    tree = ast.parse(guarded).body[0].body[0]  # type: ignore[attr-defined]
    tree.body.insert(0, ast.parse("print(attention_mask)").body[0])  # more than sizes in the branch
    function = ast.parse(guarded).body[0]
    function.body[0] = tree  # type: ignore[attr-defined]
    assert hf_unpadded.rewrite(function, {**namespace, "is_torchdynamo_compiling": is_torchdynamo_compiling}) is None

    seen: list = []

    def builder(config, inputs_embeds, attention_mask, cache=None, position_ids=None):
        seen.append(attention_mask)

    embeds, ones = torch.zeros(2, 5, 8), torch.ones(2, 5)
    hf_unpadded.unpadded(builder, True)(1, embeds, ones)
    hf_unpadded.unpadded(builder, False)(1, embeds, ones)
    hf_unpadded.unpadded(builder, True)(1, embeds, ones, position_ids=torch.arange(5)[None])
    hf_unpadded.unpadded(builder, True)(1, embeds, torch.ones(2, 7))  # longer than the keys
    hf_unpadded.unpadded(builder, True)(1, embeds, ones, cache=object())
    hf_unpadded.unpadded(builder, True)(config=1, inputs_embeds=embeds, attention_mask=torch.ones(2, 1, 5, 5))
    assert seen[0] is None and all(isinstance(m, torch.Tensor) for m in seen[1:])


def test_a_mask_eager_fills_with_ones_but_a_trace_leaves_as_none_is_filled_as_in_eager() -> None:
    """LongT5 fills its encoder's padding mask with ones only ``if attention_mask is None and not
    is_torchdynamo_compiling()``, then indexes it: under a trace it indexes None and Dynamo fails
    (before, the encoder was made opaque and every size static). The branch computes only sizes
    and the ones, so the capture takes it as eager does: one Dynamo graph, exact, the batch and the
    decoder's length free (the encoder's length stays: its local attention pads it to blocks)."""
    from fxprep.cli.tiny import tiny_config

    config = tiny_config("longt5")
    config.use_cache = False
    torch.manual_seed(0)
    model = tf.LongT5ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(3, 99, (1, 8), generator=g), "decoder_input_ids": torch.randint(3, 99, (1, 4), generator=g)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    later = {"input_ids": torch.randint(3, 99, (3, 8), generator=g), "decoder_input_ids": torch.randint(3, 99, (3, 6), generator=g)}
    eager, prepared = record(model, later), record(gm, later)
    assert differences(eager, prepared) == []
    with torch.no_grad():
        assert torch.equal(_first(gm(**later)), model(**later).logits)
