"""Shape-general by default (issue 27, item 3): a transformers model prepared on one example runs at
every batch size and sequence length, with block reuse kept under the dynamic shapes.

Each model is prepared at batch 1 / 8 tokens with no ``dynamic=`` option, then called at batch 3 /
13 tokens (a padded attention mask where the model takes one) and compared with the eager model on
that call. A model whose code really fixes a size still refuses other sizes, and the refusal names
the dimension and the line of code that fixed it.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import fxprep

TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _build(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    elif name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None))
    elif name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))
    elif name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64))
    else:
        raise AssertionError(name)
    return model.to(dtype).eval()


def _ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 101, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _main(out: Any) -> torch.Tensor:
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def _assert_same(prepared: Any, eager: Any, dtype: torch.dtype) -> None:
    a, b = _main(prepared), _main(eager)
    assert a.shape == b.shape
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # the same kernels on the same inputs: bf16 rounding can differ only where fusion differs
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


MODELS = ["llama", "qwen2", "mistral", "gpt2", "bert"]
SLOW_BF16 = {"qwen2", "mistral", "gpt2", "bert"}  # bf16 of these in the zoo: the default suite keeps llama


def _params() -> list[Any]:
    out = []
    for name in MODELS:
        for dtype in (torch.float32, torch.bfloat16):
            marks = [pytest.mark.zoo] if dtype == torch.bfloat16 and name in SLOW_BF16 else []
            out.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{str(dtype).removeprefix('torch.')}"))
    return out


@pytest.mark.parametrize(("name", "dtype"), _params())
def test_prepared_at_one_size_runs_at_another(name: str, dtype: torch.dtype) -> None:
    model = _build(name, dtype)
    example = {"input_ids": _ids(1, 8, 0), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed"
    assert any(v for v in report.reuse.get("captured", {}).values()), report.reuse  # block reuse was used
    text = report.to_text()
    assert "Shape-general" in text and "batch" in text and "seq" in text
    assert "specialised to batch" not in text  # no batch probe: the batch is declared and verified
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0  # a padded row
    for call in ({"input_ids": _ids(3, 13, 1), "attention_mask": mask}, {"input_ids": _ids(2, 5, 2)}):
        if "attention_mask" not in call:
            with pytest.raises(fxprep.InputMismatch):  # captured with a mask: None-ness is still checked
                gm(**call)
            continue
        with torch.no_grad():
            _assert_same(gm(**call), model(**call), dtype)


def test_without_attention_mask_and_input_given_positionally() -> None:
    model = _build("llama", torch.float32)
    gm = fxprep.prepare_model(model, example_inputs=(_ids(1, 8, 0),))
    for batch, seq in ((3, 13), (1, 2), (5, 40)):
        ids = _ids(batch, seq, batch)
        with torch.no_grad():
            _assert_same(gm(ids), model(ids), torch.float32)


def test_learned_position_table_bounds_the_sequence_and_the_report_says_why() -> None:
    """64 learned positions: Dynamo bounds seq to <= 64 when it slices the position table (a kernel's
    shape logic, no branch of the model); the report says so, and past it the graph fails where eager
    fails."""
    model = _build("bert", torch.float32)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    assert "Dynamo bounded 'seq' to <= 64 while capturing" in text and "input_ids.shape[1] <= 64" in text
    ids = _ids(4, 64, 3)
    with torch.no_grad():
        _assert_same(gm(input_ids=ids), model(input_ids=ids), torch.float32)
        with pytest.raises(RuntimeError):
            model(input_ids=_ids(1, 65, 3))
        with pytest.raises(RuntimeError):
            gm(input_ids=_ids(1, 65, 3))


class ShortOnly(transformers.LlamaForCausalLM):
    """A Python test of the length that the second size (8 + 3 tokens) does not cross: Dynamo bounds
    the length to <= 12 and the graph holds the short branch only."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        logits = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        return logits * 2 if input_ids.shape[1] <= 12 else logits  # THE LENGTH BRANCH


def test_a_branch_of_the_model_on_the_length_is_a_limit_every_call_is_checked_against() -> None:
    """Before, the graph (verified at 8 and 11 tokens) took 13 tokens and silently returned the
    doubled logits; now a call past the branch raises InputMismatch naming the line, and the limit
    survives the spec's round trip as data (what save and load keep)."""
    torch.manual_seed(0)
    model = ShortOnly(transformers.LlamaConfig(**TINY)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    assert "'seq' is dynamic <= 12: the model's code branches on it" in text and "THE LENGTH BRANCH" in text
    for batch, seq in ((3, 12), (2, 2)):
        ids = _ids(batch, seq, 1)
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids, use_cache=False))
    with pytest.raises(fxprep.InputMismatch, match=r"input_ids: dim 1 is 13, the graph holds for <= 12 only"):
        gm(input_ids=_ids(2, 13, 1))
    from fxprep.runtime.guard import InputSpec, check
    from fxprep.runtime.prepared import INPUT_SPEC

    spec = InputSpec.from_dict(gm.__dict__[INPUT_SPEC].to_dict())
    with pytest.raises(fxprep.InputMismatch, match="THE LENGTH BRANCH"):
        check(gm, spec, (), {"input_ids": _ids(1, 40, 1)})
    broken = spec.to_dict()
    broken["params"]["input_ids"]["range"] = {"1": [None, "12", "why"]}
    with pytest.raises(ValueError, match="malformed"):
        InputSpec.from_dict(broken)


SQUEEZEBERT = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  embedding_size=32, max_position_embeddings=64, q_groups=1, k_groups=1, v_groups=1,
                  post_attention_groups=1, intermediate_groups=1, output_groups=1)


def test_a_convolution_bounds_no_batch() -> None:
    """SqueezeBERT's convolutions: the convolution backend's choice in torch's fake kernel reads the
    batch, and Dynamo bounded a symbolic batch to <= 15 (a second capture with the bound declared,
    then a note); the choice now leaves no guard: one capture, no bound, batch 20 runs."""
    torch.manual_seed(0)
    model = transformers.SqueezeBertModel(transformers.SqueezeBertConfig(**SQUEEZEBERT)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    assert "Dynamo bounded 'batch'" not in text and "the model's code requires" not in text
    assert "input_ids dim 0 (batch), input_ids dim 1 (seq) were found" in text
    ids = _ids(20, 7, 2)
    with torch.no_grad():
        _assert_same(gm(input_ids=ids), model(input_ids=ids), torch.float32)


def test_dynamic_false_keeps_static_shapes() -> None:
    model = _build("llama", torch.float32)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)}, dynamic=False)
    assert "Shape-general" not in fxprep.get_report(gm).to_text()
    with pytest.raises(fxprep.InputMismatch, match=r"input_ids: shape .*x8 at capture"):
        gm(input_ids=_ids(2, 13, 1))


class FixedLength(transformers.LlamaForCausalLM):
    """A model whose code really fixes the sequence length (a reshape to a constant)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return out.logits.reshape(input_ids.shape[0], 8 * out.logits.shape[-1])  # FIXED-LENGTH LINE


def test_a_dimension_the_model_fixes_stays_checked_and_the_refusal_says_why() -> None:
    torch.manual_seed(0)
    model = FixedLength(transformers.LlamaConfig(**TINY)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    assert "input_ids dim 1 stays at the example's size: the model's code specialises 'seq' to 8" in text
    assert "test_shape_general.py" in text
    ids = _ids(3, 8, 1)  # the batch stays dynamic
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids))
    with pytest.raises(fxprep.InputMismatch, match=r"dim 1: the model's code specialises 'seq' to 8 at \S*"
                                                   r"test_shape_general\.py:\d+"):
        gm(input_ids=_ids(3, 13, 2))


class PooledLength(transformers.LlamaForCausalLM):
    """A model whose length is specialised inside torch's own code (max_pool1d's output size, as
    CANINE's mask downsampling): the report names the model's line, then torch's."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        logits = super().forward(input_ids=input_ids, **kwargs).logits
        return nn.MaxPool1d(kernel_size=2, stride=2)(logits.transpose(1, 2))  # POOLING LINE


def test_a_dimension_specialised_inside_torch_is_placed_at_the_models_line_first() -> None:
    torch.manual_seed(0)
    model = PooledLength(transformers.LlamaConfig(**TINY)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    line = next(i for i, code in enumerate(inspect.getsourcelines(PooledLength.forward)[0]) if "POOLING LINE" in code)
    own = f"test_shape_general.py:{inspect.getsourcelines(PooledLength.forward)[1] + line} in forward"
    assert re.search(rf"specialises 'seq' to 8 at \S*{re.escape(own)} \(.*MaxPool1d.*\), inside torch at "
                     rf"\S*torch{re.escape(os.sep)}nn{re.escape(os.sep)}modules{re.escape(os.sep)}pooling\.py:\d+", text), text
    ids = _ids(3, 8, 1)  # the batch stays dynamic
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids))


class Chunked(transformers.LlamaForCausalLM):
    """A chunked scan as Qwen3.5's linear attention runs it: padded to whole chunks, one loop step
    per chunk. The loop's count specialises the padded length; export's solver cannot prove the
    guards (``(seq + (16 - seq % 16) % 16) // 16 == 1``) over any range and offers the example's size."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        logits = super().forward(input_ids=input_ids, **kwargs).logits
        n = logits.shape[1]
        x = nn.functional.pad(logits, (0, 0, 0, (16 - n % 16) % 16))
        total = 0
        for i in range(x.shape[1] // 16):
            total = total + x[:, i * 16:(i + 1) * 16].cumsum(1)
        return total


def test_guards_export_cannot_prove_over_a_range_give_the_range_they_hold_for_checked() -> None:
    torch.manual_seed(0)
    model = Chunked(transformers.LlamaConfig(**TINY)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    text = fxprep.get_report(gm).to_text()
    # the maybe-dynamic first try holds within that range: kept, never declared to export (which cannot
    # prove these guards over a range, and had the range declared maybe-dynamic, Dim.AUTO, before)
    assert "'seq' is dynamic <= 16: the guards Dynamo put on it hold for 2..16" in text, text
    assert "dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}}" in fxprep.get_report(gm).notes
    for batch, seq in ((3, 13), (2, 16), (1, 2)):  # one chunk: every length up to 16, exactly as eager
        ids = _ids(batch, seq, seq)
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids), rtol=0, atol=0)
    with pytest.raises(fxprep.InputMismatch, match="dim 1 is 17, the graph holds for <= 16"):
        gm(input_ids=_ids(2, 17, 3))  # two chunks: another graph


def test_a_model_fxprep_does_not_know_keeps_static_shapes_and_the_batch_probe() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8))
    text = fxprep.get_report(gm).to_text()
    assert "Shape-general" not in text and "Batch size: the prepared module matched" in text


def test_block_reuse_under_dynamic_shapes_computes_what_a_whole_model_capture_does() -> None:
    model = _build("qwen2", torch.float32)
    example = {"input_ids": _ids(1, 8, 0), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    reused = fxprep.prepare_model(model, example_inputs=example)
    whole = fxprep.prepare_model(model, example_inputs=example, reuse_blocks=False)
    assert fxprep.get_report(whole).reuse == {} and fxprep.get_report(reused).reuse["captured"]
    assert [n.target for n in reused.graph.nodes if n.op == "call_module"] == \
        [n.target for n in whole.graph.nodes if n.op == "call_module"]
    assert list(reused.state_dict()) == list(model.state_dict())
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        for call in ({"input_ids": _ids(2, 11, 4), "attention_mask": mask}, example):
            assert torch.equal(_main(reused(**call)), _main(whole(**call)))


class LengthBranch(transformers.LlamaForCausalLM):
    """A model whose output depends on a Python test of the length: the shape-general graph, made
    at another size, fails verification, and fxprep prepares again with static shapes."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        logits = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        return logits * 2 if input_ids.shape[1] > 8 else logits  # bounds the length at the example's


def test_preparing_again_with_static_shapes_reuses_the_reference_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The original is run on the example once, not once per attempt (a 7B forward is not free)."""
    import fxprep.api

    runs = []
    real = fxprep.api.run_original
    monkeypatch.setattr(fxprep.api, "run_original", lambda *a, **k: (runs.append(1), real(*a, **k))[1])
    torch.manual_seed(0)
    model = LengthBranch(transformers.LlamaConfig(**TINY)).eval()
    ids = _ids(1, 8, 0)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
    assert "was tried and not kept" in fxprep.get_report(gm).to_text()
    assert len(runs) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids))


@pytest.mark.parametrize("name", ["gpt2", "falcon"])
def test_a_shape_general_graph_saves_and_loads(name: str, tmp_path: Any) -> None:
    """Under dynamic shapes Dynamo writes ``torch.Size(...)`` (GPT-2 adds a tuple to a symbolic
    shape) and ``aten.numpy_T`` (Falcon's ``.T``) into the graph; ``load`` must trust both, and the
    loaded module must run at another size like the model."""
    torch.manual_seed(0)
    if name == "falcon":
        model = transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
            bos_token_id=0, eos_token_id=0)).eval()
    else:
        model = _build(name, torch.float32)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)})
    assert "Shape-general" in fxprep.get_report(gm).to_text()
    fxprep.save(gm, tmp_path / "saved")
    loaded = fxprep.load(tmp_path / "saved")
    ids = _ids(3, 13, 1)
    with torch.no_grad():
        _assert_same(loaded(input_ids=ids), model(input_ids=ids), torch.float32)


def test_dynamic_batch_on_a_cnn_is_captured_by_dynamo() -> None:
    """``dynamic="batch"`` on a CNN: Dynamo bounded the batch to <= 15 (the convolution backend's
    choice) and used to fail, fx taking over; then the bound was read like a found one (a second
    capture); now the choice leaves no guard: Dynamo's graph, no bound, every batch accepted. A
    batch-1 example is captured at batch 2 (it used to be refused)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32), dynamic="batch")  # grown to 2
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo" and all(a.ok for a in report.attempts), report.attempts
    assert "Dynamo bounded 'batch'" not in report.to_text() and "verified on a second input size" in report.to_text()
    x = torch.randn(20, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))




def test_a_size_export_solves_to_one_value_stays_free_where_its_guards_hold() -> None:
    # Pegasus-X pads the sequence to its block size (512) and branches on `seq % block_size`: export
    # says "solving the guards generated for seq ... resulted in a specialized value of 8", since its
    # solver cannot prove `seq % 512 != 0` over a range. The guard holds for 2..511: the sequence is
    # declared maybe-dynamic and free there, checked by the prepared module (before: static at 8)
    from fxprep.cli.tiny import tiny_config

    config = tiny_config("pegasus_x")
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    g = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(3, 99, (1, 8), generator=g), "decoder_input_ids": torch.randint(3, 99, (1, 4), generator=g)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    text = fxprep.get_report(gm).to_text()
    assert "decoder_input_ids dim 1 (decoder_seq)" in text and "input_ids dim 0 (batch)" in text
    assert "'seq' is dynamic <= 511: the guards Dynamo put on it hold for 2..511" in text, text
    for batch, seq, decoder in ((3, 8, 6), (3, 13, 6), (2, 300, 5)):
        later = {"input_ids": torch.randint(3, 99, (batch, seq), generator=g),
                 "decoder_input_ids": torch.randint(3, 99, (batch, decoder), generator=g)}
        with torch.no_grad():
            torch.testing.assert_close(gm(**later)[0], model(**later, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(fxprep.InputMismatch, match="dim 1 is 512, the graph holds for <= 511"):
        gm(input_ids=torch.randint(3, 99, (1, 512), generator=g), decoder_input_ids=example["decoder_input_ids"])


def _tiny_causal_lm(model_type: str, cls: type) -> tuple[Any, Any, torch.Generator]:
    """``cls`` built from the CLI's tiny config of ``model_type`` (no cache), prepared by default on
    1x8 ids; with the generator the test draws further ids from."""
    from fxprep.cli.tiny import tiny_config

    config = tiny_config(model_type)
    config.use_cache = False
    torch.manual_seed(0)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(0)
    return model, fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(3, 99, (1, 8), generator=g)}), g


def test_a_guard_that_leaves_out_the_end_of_a_range_moves_that_end_the_dimension_stays_free() -> None:
    # GPT-1 slices its position table (64 here) to the length: Dynamo guards `seq <= 64` and, where
    # the slice would be the whole table, `seq != 64`, with no fix suggested for the second. Read as
    # the range's end moved in by one, batch and length stay free (before: the length static at 8)
    model, gm, g = _tiny_causal_lm("openai-gpt", transformers.OpenAIGPTLMHeadModel)
    assert model.config.n_positions == 64
    text = fxprep.get_report(gm).to_text()
    assert "input_ids dim 0 (batch), input_ids dim 1 (seq)" in text and "input_ids.shape[1] != 64" in text
    for batch, length in ((3, 13), (2, 64), (1, 2)):  # the table's whole length too: the graph's slice holds there
        ids = torch.randint(3, 99, (batch, length), generator=g)
        with torch.no_grad():
            assert torch.equal(gm(input_ids=ids).logits, model(input_ids=ids).logits)


def test_the_sizes_a_guard_holds_for_are_read_from_its_text() -> None:
    from fxprep.capture.shapes.guard_range import interval

    src = "L['kwargs']['input_ids'].size()[1]"
    mpt = f"{src} == (2048 + ((-1)*torch.sym_max(0, 2048 + ((-1)*{src}))))."
    assert interval([mpt], src, 8) == (2, 2048)
    assert interval([mpt, f"(2048 + ((-1)*torch.sym_max(0, 2048 + ((-1)*{src})))) != 2048"], src, 8) == (2, 2047)
    assert interval([f"({src} % 64) == 8"], src, 8) is None  # 8 alone around the example: a specialisation
    assert interval([f"({src} // 64) != 1"], src, 8) == (2, 63)  # and 128 on: the interval around the example
    assert interval([f"{src} >= 5 and {src} <= 40"], src, 8) == (5, 40)
    assert interval([f"{src} >= 5"], src, 8) == (5, None)
    assert interval([f"{src} <= 40"], src, 50) is None  # the example's own size fails
    assert interval([f"L['kwargs']['attention_mask'].size()[1] <= {src}"], src, 8) is None  # another size
    assert interval([f"__import__('os').system('true') or {src} > 1"], src, 8) is None  # only arithmetic is read


def test_the_guard_shown_for_a_range_is_the_one_that_ends_it() -> None:
    # Qwen3.5's chunked scan: export prints first a guard that holds at every length (the chunk
    # count is never the padded length), then the one the loop over chunks set; the report quoted
    # the first, which said nothing of why the graph holds for one chunk only
    from fxprep.capture.shapes import violation
    from fxprep.capture.shapes.autodims import Proposal
    from fxprep.capture.shapes.guard_range import failing
    from fxprep.core.inputs import ExampleInputs

    src = "L['input_ids'].size()[1]"
    padded = f"({src} + ((64 + (-1)*({src} % 64)) % 64))"
    everywhere, one_chunk = f"({padded} // 64) != {padded}", f"({padded} // 64) == 1"
    assert failing([everywhere, one_chunk], src, 65) == one_chunk
    assert failing([everywhere, one_chunk], src, 64) is None
    assert failing([everywhere, "math.sqrt(2) > 1"], src, 65) is None  # one it cannot read: none named
    text = ("Constraints violated (seq)! ... "
            + "".join(f"  - Not all values of seq = {src} in the specified range satisfy the generated guard {g}.\n"
                      for g in (everywhere, one_chunk))
            + "Suggested fixes:\n  seq = 8\n")
    err = RuntimeError(text.replace("Suggested fixes:\n  seq = 8", "solving the guards generated for seq = "
                                    f"{src} resulted in a specialized value of 8"))
    proposal = Proposal({"input_ids": {1: "seq"}}, ExampleInputs((), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}))
    found, ranges = violation.findings(err, proposal)
    assert not found and (ranges["seq"].low, ranges["seq"].high) == (None, 64)
    assert "hold for 2..64 (((input_ids.shape[1] + ((64 + (-1)*(input_ids.shape[1] % 64)) % 64)) // 64) == 1)" \
        in ranges["seq"].why, ranges["seq"].why


def test_a_range_export_suggests_no_fix_for_is_read_off_its_guards_and_checked() -> None:
    # MPT slices its ALiBi table (2048 here) to the length through sym_max: export's guard says
    # `seq <= 2048` without a suggested Dim, and the length was static at the example's; now it is
    # free below the table's length, checked by the prepared module (a limit, not a silent bound)
    model, gm, g = _tiny_causal_lm("mpt", transformers.MptForCausalLM)
    assert model.config.max_seq_len == 2048
    text = fxprep.get_report(gm).to_text()
    assert "'seq' is dynamic <= 2047: the guards Dynamo put on it hold for 2..2047" in text
    for batch, length in ((3, 13), (2, 100)):
        ids = torch.randint(3, 99, (batch, length), generator=g)
        with torch.no_grad():
            assert torch.equal(gm(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(fxprep.InputMismatch, match="2047"):
        gm(input_ids=torch.randint(3, 99, (1, 2049), generator=g))


class _Branch:
    """A branch of a model's code on a size, as shape_general reads it: which way it goes at given sizes."""

    def __init__(self, holds: Any) -> None:
        self.holds = holds

    def holds_with(self, sizes: dict[str, int]) -> bool:
        return bool(self.holds(sizes["seq"]))


def test_an_unproven_range_is_narrowed_to_where_the_branches_hold() -> None:
    from fxprep.capture.shape_general import _where_branches_hold
    from fxprep.capture.shapes.autodims import SizeRange

    bound = SizeRange(None, 64, "the guards hold", from_guards=True, unproven=True)
    narrowed = _where_branches_hold("seq", bound, [_Branch(lambda n: n <= 20)], {"seq": 8, "batch": 3})
    assert (narrowed.low, narrowed.high) == (None, 20) and "outside 2..20" in narrowed.why
    wider = _where_branches_hold("seq", bound, [_Branch(lambda n: n <= 100)], {"seq": 8})
    assert wider == bound  # every branch holds over the whole range: nothing to narrow
    # a branch that goes another way at every size next to the example's (an odd/even pooling,
    # SEW-D's): no interval holds, the example's size alone
    alone = _where_branches_hold("seq", bound, [_Branch(lambda n: n % 2 == 0)], {"seq": 8})
    assert (alone.low, alone.high) == (8, 8) and "at the sizes around the example's" in alone.why
    # a branch that goes another way at one size above: the range ends below it
    below = _where_branches_hold("seq", bound, [_Branch(lambda n: n != 40)], {"seq": 8})
    assert (below.low, below.high) == (None, 39)


@pytest.mark.smoke
def test_guards_through_a_float_round_trip_are_read() -> None:
    """XLNet's relative positions (``torch.arange(2 * seq, -seq, -1.0)``) put guards on the length
    through ``math.ceil`` of a float; export cannot prove them over a range and refuses even the
    range it suggests. Read exactly (as fractions), they hold everywhere in it."""
    from fxprep.capture.shapes.guard_range import interval

    src = "L['input_ids'].size()[1]"
    ceil = f"math.ceil(((torch.sym_float((-2)*{src})) / (-1.0)))"
    guards = [f"(1 % ({ceil})) != 0", f"{ceil} != {src}", f"({src} % ({ceil})) != 0",
              f"1 < ((-1)*{src}) + {src}*{ceil}", f"2 <= {src} and {src} <= 511"]
    assert interval(guards, src, 8) == (2, 511)
    # exact, not floating point: a tenth of the length, floored, is at least 2 from 20 on
    assert interval([f"math.floor(torch.sym_float({src}) / 10.0) >= 2"], src, 25) == (20, None)
    # a mask's length through three convolutions (Moonshine): trunc of a float each time, and the
    # identity it is guarded against holds for every length from the first full window on
    x = f"((-127) + {src})"
    frames = f"math.trunc(1.0 + (((-3) + math.trunc(1.0 + (((-7) + math.trunc(1.0 + ({x} / 64))) / 3))) / 2))"
    assert interval([f"{frames} == ((-1) + ({x} // 384))", f"1279 <= {src}"], src, 1600) == (1279, None)
    assert interval([f"math.ceil({src} / 0.0) > 1"], src, 8) is None  # no value: no interval
    assert interval([f"math.sqrt(torch.sym_float({src})) > 1"], src, 8) is None  # not evaluated


@pytest.mark.smoke
def test_xlnet_runs_at_other_lengths() -> None:
    """XLNet: export refused the range it suggested for the length (``max=511``) on every round, so
    the length stayed at the example's; it is now declared maybe-dynamic where its guards hold."""
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=101, d_model=32, n_layer=2, n_head=4, d_inner=37)
    model = transformers.XLNetForSequenceClassification(config).eval()
    example = {"input_ids": torch.randint(3, 101, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo" and report.verification.status == "passed"
    assert any("dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}" in note for note in report.notes)
    for batch, length in ((3, 13), (2, 2), (1, 120)):
        ids = torch.randint(3, 101, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[-1, length // 2:] = 0
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids, attention_mask=mask)["logits"],
                                       model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_a_model_with_opaque_parts_is_captured_again_with_its_dimensions_declared() -> None:
    """YOSO: its attention calls an autograd Function with one tensor twice, which Dynamo refuses, so
    that attention stays an opaque part (dynamo+leaves). The same capture with batch and length
    declared makes nothing else opaque and is kept: before, the graph stayed at the example's size."""
    torch.manual_seed(0)
    config = transformers.YosoConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=64)
    model = transformers.YosoForSequenceClassification(config).eval()
    example = {"input_ids": torch.randint(3, 101, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    gm = fxprep.prepare_model(model, example_inputs=example)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo+leaves" and report.verification.status == "passed"
    assert set(report.leaves) == {"yoso.encoder.layer.0.attention.self", "yoso.encoder.layer.1.attention.self"}
    text = report.to_text()
    assert "Captured with parts opaque (tracer dynamo+leaves), a second time with the found dimensions" in text
    assert "was tried and not kept" not in text
    for batch, length in ((3, 13), (2, 5), (1, 40)):
        ids = torch.randint(3, 101, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.long)
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids, attention_mask=mask)["logits"],
                                       model(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


class _CompressedConfig(transformers.PretrainedConfig):
    model_type = "fxprep_test_compressed"


class _Compressed(transformers.PreTrainedModel):
    """Tokens in groups of 4 (``seq // 4``, as DeepSeek-V4's compressed attention) and a branch on the
    length: torch writes the suggested fix as ``seq = 4*_seq`` with ``_seq`` of one value, and fails
    to (``Cannot create Dim with inconsistent min=2, max=2``)."""

    config_class = _CompressedConfig

    def __init__(self, config: _CompressedConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(101, 3)
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        s = x.shape[1]
        y = x.reshape(x.shape[0], s // 4, 4 * x.shape[2])
        return y * 2 if 8 <= s <= 11 else y


def test_a_violation_torch_fails_to_write_still_says_which_dimension() -> None:
    """The violation was lost in torch's own formatting of it (an ``AssertionError``), and every
    declared dimension was given up for static shapes (the batch then freed by a third capture).
    Now the length is named as specialised, with its guard, and the batch stays free."""
    torch.manual_seed(0)
    model = _Compressed(_CompressedConfig()).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": _ids(1, 8, 0)}, progress=False)
    text = fxprep.get_report(gm).to_text()
    assert "AssertionError" not in text and "the model's code specialises 'seq' to 8" in text
    assert "input_ids dim 0 (batch) were found from the model's input names" in text
    for batch in (3, 17):
        ids = _ids(batch, 8, batch)
        with torch.no_grad():
            torch.testing.assert_close(gm(input_ids=ids), model(input_ids=ids))
    with pytest.raises(fxprep.InputMismatch):
        gm(input_ids=_ids(1, 12, 1))
