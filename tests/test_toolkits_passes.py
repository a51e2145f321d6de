"""The graph made for re-tracing toolkits (fxprep.compat.retrace) and the names of layers made for
raw parameters (fxprep.passes.owner_names), on real models (issue 29)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
import torchvision
import transformers
from torch import nn

import fxprep
from fxprep.compat import mct as fx_mct
from fxprep.compat.retrace import HOLDER, retraceable

from .toolkit_cases import COMMON, build, pt2e_fxprep, pt2e_quantizer, sqnr, x86


def _ids():
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))


def test_retraceable_llama_folds_masks_and_rotary_tables_and_keeps_the_network():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    ids = _ids()
    gm = fxprep.prepare_model(model, example_inputs=(ids,))
    ready = retraceable(gm, (ids,), specialize=True)  # a shape-general capture, made for the example's sizes
    nodes = list(ready.graph.nodes)
    assert all("val" in n.meta for n in nodes if n.op != "output")
    assert not [n for n in nodes if n.target is torch.arange or n.target in ("to", "float")]
    assert not [n for n in nodes if n.op == "call_function" and n.target is getattr]  # no x.device left
    folded = dict(ready.get_submodule(HOLDER).named_buffers())
    assert folded and all(name in ready.get_submodule(HOLDER)._non_persistent_buffers_set for name in folded)
    assert set(ready.state_dict()) == set(gm.state_dict())  # folded constants are not saved
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears <= {str(n.target) for n in nodes if n.op == "call_module"}
    other = _ids() % 7
    with torch.no_grad():
        assert torch.equal(ready(other), gm(other).logits)  # the one output tensor, alone
    fx.symbolic_trace(ready)  # a plain re-trace goes through


def test_retraceable_keeps_sizes_symbolic_where_the_graph_is_dynamic():
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 8)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            return self.emb(ids) + self.emb(pos)

    model = Positions().eval()
    ids = torch.randint(0, 64, (2, 8))
    gm = fxprep.prepare_model(model, example_inputs=(ids,), dynamic={"ids": {1: "seq"}})
    ready = retraceable(gm, (ids,))
    assert not hasattr(ready, HOLDER)  # arange over a dynamic length: not a constant
    longer = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert torch.equal(ready(longer), model(longer))


def test_retraceable_reads_every_element_of_multihead_attention_output():
    model = build("vit_b_16")
    x = torch.randn(1, 3, 32, 32)
    ready = retraceable(fxprep.prepare_model(model, example_inputs=(x,)), (x,))
    attention = [n for n in ready.graph.nodes if n.op == "call_module"
                 and isinstance(ready.get_submodule(str(n.target)), nn.MultiheadAttention)]
    assert attention
    for node in attention:
        assert sorted(u.args[1] for u in node.users if u.target is operator.getitem) == [0, 1]


def test_retraceable_drops_identity_casts_but_keeps_real_ones_in_bfloat16():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval().to(torch.bfloat16)
    ids = _ids()
    gm = fxprep.prepare_model(model, example_inputs=(ids,))
    ready = retraceable(gm, (ids,))
    casts = [n for n in ready.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert casts  # RMSNorm computes in float32 and casts back: needed conversions stay
    assert all(len(n.args) == 2 and isinstance(n.args[1], torch.dtype) and not n.kwargs for n in casts)
    with torch.no_grad():
        assert torch.equal(ready(ids), gm(ids).logits)


def test_router_linear_takes_the_routers_name_and_a_per_name_config_reaches_it():
    model = build("mixtral")
    ids = _ids()
    gm = fxprep.prepare_model(model, example_inputs=(ids,))
    gate = gm.get_submodule("model.layers.0.mlp.gate")
    assert isinstance(gate, nn.Linear) and gate.weight is model.model.layers[0].mlp.gate.weight
    assert not [n for n, _ in gm.named_modules() if n.startswith("model.layers.0.mlp.gate.")]  # a leaf layer
    assert isinstance(gm.get_submodule("model.layers.0.mlp.gate_softmax"), nn.Softmax)  # the router's softmax
    assert list(gm.state_dict()) == list(model.state_dict())
    assert "model.layers.0.mlp.gate" in {a.name for a in gm.fxprep_report.added}

    converted = pt2e_fxprep(gm, ids, [ids], pt2e_quantizer(
        lambda q: q.set_module_name_qconfig("model.layers.0.mlp.gate", x86.get_default_x86_inductor_quantization_config())))
    assert _quantized_linears(converted) == ["model.layers.0.mlp.gate"]  # exactly the named layer



class _ChannelsLastNorm(nn.LayerNorm):
    """torchvision ConvNeXt's LayerNorm2d: a user module calling ``F.layer_norm`` on its own parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def test_a_layer_moved_to_its_owners_path_loads_and_gives_its_state_dict_strictly():
    """The moved layer's parameters were aliases at the old path (``norm.layer_norm.weight``); after
    the move that path is gone, and ``load_state_dict`` must not fill it (it did: 'Unexpected key')."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _ChannelsLastNorm(4), nn.ReLU()).eval()
    x = torch.randn(1, 3, 5, 5)
    for tracer in ("fx", "dynamo"):
        gm = fxprep.prepare_model(model, tracer=tracer, example_inputs=(x,))
        assert isinstance(gm.get_submodule("1"), nn.LayerNorm) and gm.get_submodule("1").weight is model[1].weight
        assert list(gm.state_dict()) == list(model.state_dict())
        gm.load_state_dict(model.state_dict(), strict=True)
        model.load_state_dict(gm.state_dict(), strict=True)
        torch.testing.assert_close(gm(x), model(x))

    mixtral = build("mixtral")
    gm = fxprep.prepare_model(mixtral, example_inputs=(_ids(),))
    gm.load_state_dict(mixtral.state_dict(), strict=True)
    mixtral.load_state_dict(gm.state_dict(), strict=True)


class _OwnNamedParameter(nn.Module):
    """A block calling ``F.linear`` on its own Parameter named ``proj`` (not ``weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.proj)


def test_a_layer_for_a_parameter_not_named_weight_keeps_the_users_parameter_path():
    """Moving the Linear made for ``blk.proj`` to ``blk`` would rename the Parameter ``blk.weight``
    (found by tests/test_property.py: 'Linear has no attribute `add`'): it stays ``blk.linear``."""
    model = nn.Sequential(nn.Linear(4, 4), _OwnNamedParameter()).eval()
    x = torch.randn(2, 4)
    for tracer in ("fx", "dynamo"):
        gm = fxprep.prepare_model(model, tracer=tracer, example_inputs=(x,))
        assert gm.get_parameter("1.proj") is model[1].proj
        assert list(gm.state_dict()) == list(model.state_dict())
        gm.load_state_dict(model.state_dict(), strict=True)
        torch.testing.assert_close(gm(x), model(x))


def _quantized_linears(gm: fx.GraphModule) -> list[str]:
    """Module paths of the linear layers that read a dequantized input."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "linear" in str(node.target):
            source = node.args[0]
            if isinstance(source, fx.Node) and "dequantize" in str(source.target):
                stack = node.meta.get("nn_module_stack") or {}
                out.append(list(stack.values())[-1][0] if stack else "?")
    return out


def _calls(gm: fx.GraphModule, kind: type) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), kind)]


def _mct_ptq_sqnr(model: nn.Module, gm: fx.GraphModule, shape: tuple[int, ...]) -> float:
    gen = torch.Generator().manual_seed(2)

    def representative_data_gen():
        for _ in range(2):
            yield [torch.randn(shape, generator=gen)]

    x = torch.randn(shape, generator=gen)
    quantized = fx_mct.post_training_quantization(gm, (x,), representative_data_gen)[0]
    with torch.no_grad():
        return sqnr(model(x), quantized(x))


def test_mct_hand_off_writes_vit_self_attention_as_linear_and_sdpa_and_quantizes_it():
    """MCT cannot read torchvision's ``MultiheadAttention(x, x, x, need_weights=False)`` call (its
    ``(out, None)`` output); the MCT graph computes it with F.linear and SDPA on the same weights."""
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64).eval()
    nn.init.normal_(model.heads.head.weight)  # torchvision's head starts at zero
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    ready = fx_mct.prepare(gm, (x,))
    assert not _calls(ready, nn.MultiheadAttention) and len(_calls(gm, nn.MultiheadAttention)) == 2
    assert sum(n.target is F.scaled_dot_product_attention for n in ready.graph.nodes) == 2
    with torch.no_grad():
        torch.testing.assert_close(ready(x), model(x))
    assert _mct_ptq_sqnr(model, gm, (1, 3, 32, 32)) > 5.0


class _IndexedBias(nn.Module):
    """timm EfficientFormer's attention bias: a Parameter indexed by a buffer of indices."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.biases = nn.Parameter(torch.randn(2, 5))
        self.register_buffer("idxs", torch.randint(0, 5, (4, 4)))

    def forward(self, x):
        return self.linear(x) + self.biases[:, self.idxs]


def test_mct_hand_off_reads_a_weight_indexed_by_a_buffer_as_a_constant():
    """MCT's model builder passes an fx Node nested in getitem's index to ``getitem`` itself; the
    MCT graph reads the indexed weight as a constant, the prepared graph keeps the indexing."""
    torch.manual_seed(0)
    model = _IndexedBias().eval()
    x = torch.randn(1, 2, 4, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    ready = fx_mct.prepare(gm, (x,))
    assert not [n for n in ready.graph.nodes if n.target is operator.getitem]
    assert [n for n in gm.graph.nodes if n.target is operator.getitem]
    with torch.no_grad():
        torch.testing.assert_close(ready(x), model(x))
    assert _mct_ptq_sqnr(model, gm, (1, 2, 4, 4)) > 5.0
