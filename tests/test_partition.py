"""``fxprep.partition``: a prepared graph cut into ordered stages at its repeated blocks.

On real models (a tiny Llama, a Mixtral MoE, a Qwen2-VL, a torchvision ViT and ResNet-18): the stages
are the blocks in order, every node of the graph is in exactly one stage, each stage calls the
user's own module objects, the values a stage frees are read by no later stage, and running the
stages in order gives exactly what the prepared graph gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision
import transformers as tf
from torch import fx

import fxprep
from fxprep.errors import InvalidInput

from . import vlm_models


def _llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    cfg = tf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    ids = [torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return tf.LlamaForCausalLM(cfg).eval(), {"input_ids": ids[0]}, [{"input_ids": i} for i in ids[1:]]


def _mixtral() -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    cfg = tf.MixtralConfig(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ids = [torch.randint(0, 99, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return tf.MixtralForCausalLM(cfg).eval(), {"input_ids": ids[0]}, [{"input_ids": i} for i in ids[1:]]


def _qwen2_vl() -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model, inputs = vlm_models.qwen2_vl()
    return model, inputs, [inputs]


def _vit() -> tuple[torch.nn.Module, tuple[torch.Tensor], list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10).eval()
    return model, (torch.randn(2, 3, 32, 32),), [(torch.randn(2, 3, 32, 32),)]


def _resnet() -> tuple[torch.nn.Module, tuple[torch.Tensor], list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), [(torch.randn(1, 3, 64, 64),)]


# model, the stage names partition must find (by default)
CASES = {
    "llama": (_llama, ["head", "model.layers.0", "model.layers.1", "model.layers.2", "tail"]),
    "mixtral": (_mixtral, ["head", "model.layers.0", "model.layers.1", "tail"]),
    "qwen2_vl": (_qwen2_vl, ["head", "model.visual.blocks.0", "model.visual.blocks.1",
                             "after model.visual.blocks.1", "model.language_model.layers.0",
                             "model.language_model.layers.1", "tail"]),
    "vit": (_vit, ["head", "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1",
                   "encoder.layers.encoder_layer_2", "tail"]),
    "resnet18": (_resnet, ["head"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["tail"]),
}


def _call(f: Any, inputs: Any) -> Any:
    return f(**inputs) if isinstance(inputs, dict) else f(*inputs)


def _tensors(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def prepared() -> dict[str, tuple[torch.nn.Module, Any, list[Any], fx.GraphModule]]:
    """Each case's model, example, more batches and prepared graph, prepared once for the module
    (filled as tests ask: partition changes nothing in ``gm``)."""
    return {}


def _prepared(cache: dict[str, Any], name: str) -> tuple[torch.nn.Module, Any, list[Any], fx.GraphModule]:
    if name not in cache:
        model, example, more = CASES[name][0]()
        cache[name] = model, example, more, fxprep.prepare_model(model, example_inputs=example)
    return cache[name]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, prepared: dict[str, Any]
         ) -> tuple[str, fx.GraphModule, Any, list[Any], list[str]]:
    _, example, more, gm = _prepared(prepared, request.param)
    return request.param, gm, example, [example] + more, CASES[request.param][1]


def test_stages_are_the_blocks_in_order(case: Any) -> None:
    _, gm, _, _, names = case
    stages = fxprep.partition(gm)
    assert [s.name for s in stages] == names
    assert all(isinstance(s, fx.GraphModule) for s in stages)


def test_every_node_in_exactly_one_stage(case: Any) -> None:
    _, gm, _, _, _ = case
    stages = fxprep.partition(gm)
    computing = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    got = [n.name for s in stages for n in s.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    # in graph order: stages are contiguous pieces of gm's topological order
    assert got == computing
    # a read of a weight (get_attr: Dynamo hoists them to the top) is in each stage that uses it, and only there
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            holding = [s.name for s in stages if any(n.op == "get_attr" and n.target == node.target for n in s.graph.nodes)]
            using = [s.name for s in stages if any(n.name in {u.name for u in node.users} and n.op != "placeholder"
                                                   for n in s.graph.nodes)]
            assert holding == using and holding


def test_stages_call_the_users_own_modules(case: Any) -> None:
    _, gm, _, _, _ = case
    for stage in fxprep.partition(gm):
        for node in stage.graph.nodes:
            if node.op == "call_module":
                assert stage.get_submodule(node.target) is gm.get_submodule(node.target)
            if node.op == "get_attr":
                path, _, name = node.target.rpartition(".")
                owner = gm.get_submodule(path) if path else gm
                assert getattr(stage, node.target.split(".")[0]) is not None
                assert stage.get_parameter(node.target) is getattr(owner, name) if name in owner._parameters \
                    else stage.get_buffer(node.target) is getattr(owner, name)


def test_frees_name_values_no_later_stage_reads(case: Any) -> None:
    _, gm, example, _, _ = case
    stages = fxprep.partition(gm)
    values = stages.bind(*example) if isinstance(example, tuple) else stages.bind(**example)
    assert set(values) == set(stages.placeholders)
    for k, stage in enumerate(stages):
        assert set(stage.inputs) <= set(values)
        values.update(stage(**{n: values[n] for n in stage.inputs}))
        for name in stage.frees:
            assert all(name not in later.inputs for later in stages[k + 1:])
            del values[name]
    assert set(values) == set(stages.result_reads)  # all that is left is what the output reads


def test_running_the_stages_in_order_is_running_gm(case: Any) -> None:
    _, gm, _, batches, _ = case
    stages = fxprep.partition(gm)
    with torch.no_grad():
        for inputs in batches:
            want, got = _call(gm, inputs), _call(stages, inputs)
            assert type(got) is type(want)
            pairs = list(zip(_tensors(want), _tensors(got), strict=True))
            assert pairs and all(torch.equal(a, b) for a, b in pairs)


def test_targets_by_class_name_and_glob(prepared: dict[str, Any]) -> None:
    model, example, _, gm = _prepared(prepared, "llama")
    by_class = fxprep.partition(gm, targets=tf.models.llama.modeling_llama.LlamaDecoderLayer)
    by_glob = fxprep.partition(gm, targets="model.layers.*")
    assert [s.name for s in by_class] == [s.name for s in by_glob] == [s.name for s in fxprep.partition(gm)]
    mlps = fxprep.partition(gm, targets=["model.layers.*.mlp"])
    assert [s.blocks for s in mlps if s.blocks] == [(f"model.layers.{i}.mlp",) for i in range(3)]
    with torch.no_grad():
        assert torch.equal(mlps(**example).logits, gm(**example).logits)
    with pytest.raises(InvalidInput, match="matches the partition targets"):
        fxprep.partition(gm, targets="decoder.*")
    with pytest.raises(InvalidInput, match="GraphModule"):
        fxprep.partition(model)


@pytest.mark.parametrize("name", ["llama", "qwen2_vl"])
def test_blocks_per_stage_and_the_code_between_with_the_block_before(name: str, prepared: dict[str, Any]) -> None:
    """llm-compressor's cut: two blocks a stage, the code after a block in its stage (the tail with the
    last one); every node still in one stage, and the stages still compute what gm computes."""
    _, example, more, gm = _prepared(prepared, name)
    default = fxprep.partition(gm)
    paired = fxprep.partition(gm, blocks_per_stage=2, between="previous")
    blocks = [b for s in default for b in s.blocks]
    assert [b for s in paired for b in s.blocks] == blocks
    assert [s.blocks for s in paired if s.blocks] == [tuple(blocks[i:i + 2]) for i in range(0, len(blocks), 2)]
    assert paired[0].name == "head" and not paired[0].blocks and all(s.blocks for s in list(paired)[1:])
    counted = [n for s in paired for n in s.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert len(counted) == len([n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")])
    with torch.no_grad():
        for inputs in [example] + more:
            pairs = list(zip(_tensors(_call(gm, inputs)), _tensors(_call(paired, inputs)), strict=True))
            assert pairs and all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(InvalidInput, match="blocks_per_stage"):
        fxprep.partition(gm, blocks_per_stage=0)
    with pytest.raises(InvalidInput, match="between"):
        fxprep.partition(gm, between="after")
