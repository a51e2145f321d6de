"""Block reuse checked against a whole-model capture, shared by tests/test_reuse*.py and test_user_hooks.py.

The contract (tests/test_reuse.py): ``prepare_model`` with reuse gives exactly the graph of a
whole-model capture, node by node, with bit-equal outputs.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

import fxprep

from .zoo_models import HF_ARCHS, tiny_config


def _shape(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Every node: op, target, arguments (nodes by position), module stack. Names are left out
    (placeholders are named after them): copies of one block graph get fresh node names. A
    ``get_attr`` is named by its target where it is used: Dynamo puts some at the top of the graph
    it traces, which for a block captured alone is the top of the block (their set is compared too)."""
    index: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            index[n] = len(index)

    def target(n: fx.Node) -> str:
        if n.op == "placeholder":
            return ""
        return str(n.target) if n.op in ("call_module", "get_attr", "call_method") else repr(n.target)

    def args(value: Any) -> str:
        text = str(fx.node.map_arg(value, lambda n: f"@{n.target}" if n.op == "get_attr" else f"%{index[n]}"))
        # a check's message (fxprep.decisions) names a value read from data by a symbol u<n> and the
        # check by its node in Dynamo's graph, both numbered per capture: a block captured alone counts afresh
        return re.sub(r"on node '\w+'", "on node ?", re.sub(r"\bu\d+\b", "u?", text))

    shape = [(n.op, target(n), args(n.args), args(n.kwargs),
              [(q, c.__qualname__) for q, c in (n.meta.get("nn_module_stack") or {}).values()])
             for n in gm.graph.nodes if n.op != "get_attr"]
    return shape + sorted(("get_attr", str(n.target)) for n in gm.graph.nodes if n.op == "get_attr")


def _call(gm: nn.Module, example: Any) -> Any:
    with torch.no_grad():
        if isinstance(example, dict):
            return gm(**example)
        return gm(*example) if isinstance(example, tuple) else gm(example)


def assert_reuse_exact(model: nn.Module, example: Any, **options: Any) -> dict[str, Any]:
    """Prepare with and without reuse; the two must be the same graph. Returns the reuse record.
    Static shapes unless ``dynamic`` is given: under dynamic shapes a block captured alone reads its
    own sizes (``x.size(0)``) where a whole-model capture reads them once, so the graphs differ in
    those nodes (tests/test_shape_general.py compares the two by their outputs)."""
    options.setdefault("dynamic", False)
    whole = fxprep.prepare_model(model, example_inputs=example, tracer="dynamo", reuse_blocks=False, **options)
    reused = fxprep.prepare_model(model, example_inputs=example, tracer="dynamo", **options)
    assert _shape(reused) == _shape(whole)
    assert [n.target for n in reused.graph.nodes if n.op == "call_module"] == \
        [n.target for n in whole.graph.nodes if n.op == "call_module"]
    assert list(reused.state_dict()) == list(whole.state_dict())
    assert list(reused.state_dict()) == list(model.state_dict())
    a, b = pytree.tree_leaves(_call(whole, example)), pytree.tree_leaves(_call(reused, example))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor))
    report = fxprep.get_report(reused)
    assert report.verification.status == "passed"
    assert fxprep.get_report(whole).reuse == {}
    return report.reuse


def _stamped(reuse: dict[str, Any]) -> dict[str, list[str]]:
    return {k: v for k, v in reuse.get("captured", {}).items() if v}


def hf(model_type: str, layers: int = 3, **extra: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny transformers model (the zoo's config) with ``layers`` layers in each stack."""
    import transformers

    from fxprep.families.transformers.model import example_inputs_for

    auto, arch_extra = HF_ARCHS[model_type]
    known = transformers.AutoConfig.for_model(model_type).to_dict()
    depth = {k: layers for k in ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers",
                                 "num_decoder_layers") if k in known}
    nested = {k: {**v, "num_hidden_layers": layers} for k, v in arch_extra.items() if isinstance(v, dict)}
    config = tiny_config(model_type, {**arch_extra, **depth, **nested, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config).eval()
    example = example_inputs_for(model, batch=1, seq_len=8)
    assert example is not None
    return model, example
