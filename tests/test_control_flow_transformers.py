"""control_flow="rewrite" on transformers models: the rewrite beside what fxprep already does to them.

A transformers model gets the shape-general capture (batch and sequence declared dynamic), and some
of its methods run a copy fxprep changed during capture (:mod:`fxprep.families.transformers.methods`); the
control-flow rewrite must keep both. The toy model is defined here because the rewrite reads its
source.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.utils.import_utils import torch_compilable_check

import fxprep
from fxprep.capture.rewrite.source import compile_function, install, method_at, uninstall
from fxprep.errors import TraceFailure
from fxprep.families.transformers import methods as hf_source

from .helpers import assert_unchanged, module_snapshot


# --- transformers: BART's fp16 overflow clamp -------------------------------------------------------
def test_transformers_bart_half_precision_clamp_is_rewritten():
    """BartEncoderLayer ends with ``if hidden_states.dtype == torch.float16 and not
    torch.isfinite(hidden_states).all(): <clamp>``: in half precision that is a data-dependent
    branch, and today no tracer captures the model at all."""
    from transformers import BartConfig, BartModel

    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    model = BartModel(config).eval().half()
    ids = torch.randint(3, 60, (1, 8))
    with pytest.raises(TraceFailure, match="Data-dependent branching"):
        fxprep.prepare_model(model, example_inputs={"input_ids": ids}, fallback="error")
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, control_flow="rewrite")
    report = gm.fxprep_report
    assert report.tracer == "dynamo" and report.verification.status == "passed" and not report.leaves
    (site,) = report.control_flow
    assert site.route == "torch.where" and "modeling_bart.py" in site.location
    assert site.modules == ["encoder.layers.0", "encoder.layers.1"]
    assert site.branches == {"true": [], "false": ["example"]}  # finite activations never take the clamp
    assert "true branch: NOT exercised by any input" in str(report)
    assert not report.left
    # the rewrite no longer costs the shape-general capture: batch and length are free
    assert "dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}}" in report.notes
    for shape in ((3, 7), (2, 20)):
        other = torch.randint(3, 60, shape)
        torch.testing.assert_close(gm(input_ids=other)[0], model(input_ids=other)[0], rtol=0, atol=0)


# --- a transformers method with a data-dependent if and a change of fxprep's own (hf_source) ------------
_TOY_MODULE = "transformers.models.fxprep_toy.modeling_fxprep_toy"
# transformers 5.0's PreTrainedModel reads sys.modules[cls.__module__].__file__ when it is built
sys.modules.setdefault(_TOY_MODULE, types.ModuleType(_TOY_MODULE)).__file__ = __file__


class _CheckedToy(PreTrainedModel):
    """A transformers-style model (its class claims transformers' namespace, as hf_source requires)
    whose ``forward`` has both a check with an f-string message, which hf_source makes lazy during
    capture (formatting a symbolic size specialises it), and a data-dependent ``if``, which the
    control-flow rewrite rewrites: one method, two copies of fxprep's wanting the same slot."""

    config_class = LlamaConfig
    __module__ = _TOY_MODULE

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, 4)
        self.post_init()

    def forward(self, input_ids):
        h = self.embed(input_ids)
        tokens = h.shape[0] * h.shape[1]
        torch_compilable_check(h.numel() == tokens * h.shape[2], f"{tokens} tokens in {h.shape[0]} rows")
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return self.proj(h)


def _checked_toy() -> _CheckedToy:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    return _CheckedToy(config).eval()


def test_the_rewrite_of_a_transformers_method_keeps_the_changes_capture_makes_to_it():
    """The control-flow rewrite's copy of ``forward`` replaces the copy hf_source would install, so
    it is made from hf_source's changed source: the check's message stays lazy and the batch and
    length stay free (a copy made from the file's source formats both sizes and specialises them)."""
    model = _checked_toy()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 50, (2, 5))}, control_flow="rewrite")
    assert_unchanged(model, before)
    (site,) = gm.fxprep_report.control_flow
    assert site.route == "torch.where"
    assert "dynamic dimensions: {'input_ids': {0: 'batch', 1: 'seq'}}" in gm.fxprep_report.notes, gm.fxprep_report.notes
    for shape in ((3, 7), (1, 2), (4, 16)):
        ids = torch.randint(0, 50, shape)
        torch.testing.assert_close(gm(input_ids=ids), model(ids), rtol=0, atol=0)
    assert "forward" not in model.__dict__


def test_copies_of_one_method_installed_on_one_instance_stack_the_newest_runs():
    """hf_source's copy and the control-flow rewrite's on one instance, in either order: the rewrite's
    runs while installed (it carries hf_source's changes); uninstalling it brings back what was
    there; an attribute the user set on the instance is never covered."""
    model = _checked_toy()
    method = method_at(model, __file__, inspect.getsourcelines(_CheckedToy.forward)[1] + 2)
    assert method is not None and method.instances == [model]
    tree, helpers = hf_source.source_tree(method)
    ours = compile_function(method, tree, helpers)

    def running():
        return model.forward.__func__ if "forward" in model.__dict__ else None

    with hf_source.rewritten_methods(model):  # hf_source first, the rewrite on top
        theirs = running()
        assert theirs is not None and theirs is not _CheckedToy.forward
        installed = install([(method, ours)])
        assert running() is ours
        uninstall(installed)
        assert running() is theirs
    assert running() is None
    installed = install([(method, ours)])  # the rewrite first: hf_source leaves its copy in place
    with hf_source.rewritten_methods(model):
        assert running() is ours
    assert running() is ours
    uninstall(installed)
    assert running() is None
    with hf_source.rewritten_methods(model):  # out of order: hf_source's goes first, the rewrite's stays
        installed = install([(method, ours)])
    assert running() is ours
    uninstall(installed)
    assert running() is None
    model.forward = mine = lambda input_ids: input_ids  # noqa: E731 - the user's own attribute
    assert install([(method, ours)]) == [] and model.forward is mine
