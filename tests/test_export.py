"""fxprep.io.export: ONNX (checked in onnxruntime) and torch.export delivery of prepared modules."""

from __future__ import annotations

import onnx
import onnxruntime  # noqa: F401  # a test dependency: missing, it must fail, not skip
import pytest
import torch
import torchvision
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import ExportError
from fxprep.io import export


def _onnx_nodes(path):
    model = onnx.load(str(path))
    return [(n.name, n.op_type, {p.key: p.value for p in n.metadata_props}.get(export.MODULE_KEY)) for n in model.graph.node]


@pytest.fixture(scope="module")
def resnet18():
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    return fxprep.prepare_model(model, example_inputs=x), x


def test_resnet18_onnx_matches_and_names_follow_modules(resnet18, tmp_path):
    gm, x = resnet18
    diff = export.export_onnx(gm, x, tmp_path / "r18.onnx")
    assert diff < 1e-4
    nodes = _onnx_nodes(tmp_path / "r18.onnx")
    call_modules = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    # constant folding only: one ONNX node per module, named after it, in graph order (the flatten
    # left functional at the root keeps the exporter's name)
    assert [m for _, _, m in nodes if m] == call_modules
    assert [op for _, op, m in nodes if not m] == ["Reshape"]
    names = {name for name, _, _ in nodes}
    assert {"layer1.0.add/Add", "layer1.0.relu_1/Relu", "layer1.0.bn1/BatchNormalization", "fc/Gemm"} <= names


def test_resnet18_full_optimisation_still_matches(resnet18, tmp_path):
    gm, x = resnet18
    diff = export.export_onnx(gm, x, tmp_path / "r18.onnx", optimize="full")
    assert diff < 1e-4
    ops = {op for _, op, _ in _onnx_nodes(tmp_path / "r18.onnx")}
    assert "BatchNormalization" not in ops  # folded into the convolutions


def test_resnet18_exported_program_uses_prepared_names(resnet18):
    gm, x = resnet18
    program = export.export_program(gm, x)
    scopes = {list(n.meta["nn_module_stack"].values())[-1][0] for n in program.graph.nodes if n.meta.get("nn_module_stack")}
    assert {"layer1.0.relu_1", "layer1.0.add", "fc"} <= scopes
    assert torch.allclose(program.module()(x), gm(x), atol=1e-5)


def test_small_vit_exports(tmp_path):
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision zero-initialises the head: outputs would be all 0
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    assert export.export_onnx(gm, x, tmp_path / "vit.onnx") < 1e-4
    modules = {m for _, _, m in _onnx_nodes(tmp_path / "vit.onnx") if m}
    assert "encoder.layers.encoder_layer_0.self_attention" in modules
    assert "encoder.layers.encoder_layer_1.mlp.0" in modules
    export.export_program(gm, x)


def _tiny_hf(kind: str):
    import transformers

    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                  max_position_embeddings=64)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, num_key_value_heads=1))
        model.config.use_cache = False
    inputs = {"input_ids": torch.randint(0, 99, (1, 8))}
    gm = fxprep.prepare_model(model.eval(), example_inputs=inputs, tracer="auto")
    return gm, inputs


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_tiny_transformers_export(tmp_path, kind):
    gm, inputs = _tiny_hf(kind)
    assert export.export_onnx(gm, inputs, tmp_path / f"{kind}.onnx") < 1e-4
    export.export_program(gm, inputs)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependent()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.inner(x)).relu()


def test_export_program_failure_is_an_export_error():
    model = Outer().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, [model.inner], example_inputs=x)
    with pytest.raises(ExportError, match="(?s)torch.export could not export.*draft_export"):
        export.export_program(gm, x)


def test_onnx_falls_back_to_torchscript_with_a_warning(tmp_path):
    model = Outer().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, [model.inner], example_inputs=x)
    with pytest.warns(fxprep.FxprepWarning, match="TorchScript exporter"):
        assert export.export_onnx(gm, x, tmp_path / "dd.onnx") < 1e-5


def test_onnx_argument_errors(tmp_path):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval())
    with pytest.raises(ExportError, match="example_inputs"):
        export.export_onnx(gm, None, tmp_path / "x.onnx")
    with pytest.raises(ExportError, match="optimize"):
        export.export_onnx(gm, torch.randn(1, 3, 32, 32), tmp_path / "x.onnx", optimize="max")


def test_mismatch_is_reported():
    with pytest.raises(ExportError, match="differs from the prepared module on output 0"):
        export._compare([torch.zeros(3)], [torch.ones(3)], 1e-4, 1e-4, "the thing")
    # the default atol follows the outputs' magnitude: 5e-4 off a logit of 100 is float noise
    assert export._compare([torch.full((3,), 100.0)], [torch.full((3,), 100.0005)], 1e-6, None, "x") < 1e-3
    with pytest.raises(ExportError):
        export._compare([torch.full((3,), 1.0)], [torch.full((3,), 1.0005)], 1e-6, None, "x")
    with pytest.raises(ExportError, match="returns 2 tensors"):
        export._compare([torch.zeros(3)], [torch.ones(3)] * 2, 1e-4, 1e-4, "the thing")


@pytest.mark.zoo
def test_full_size_vit_b_16_exports(tmp_path):
    model = torchvision.models.vit_b_16(weights=None).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision zero-initialises the head: outputs would be all 0
    x = torch.randn(1, 3, 224, 224)
    gm = fxprep.prepare_model(model, example_inputs=x)
    assert export.export_onnx(gm, x, tmp_path / "vit_b_16.onnx") < 1e-3
    export.export_program(gm, x)


@pytest.mark.smoke
def test_grouped_query_attention_exports_to_onnx_with_the_torchscript_exporter(tmp_path):
    """The graph calls SDPA as eager does (enable_gqa=True for a GQA model); torch's TorchScript
    exporter, which AIMET QuantSim's export uses, refused that flag on torch 2.8. Under export the
    op writes the same attention with key/value heads repeated: the file runs and gives the same
    values."""
    import torch.nn.functional as F

    from fxprep import ops

    op = ops.ScaledDotProductAttention(F.scaled_dot_product_attention, (ops.Slot(0), ops.Slot(1), ops.Slot(2)),
                                       {"is_causal": True, "enable_gqa": True})
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    path = tmp_path / "gqa.onnx"
    torch.onnx.export(op, (q, k, v), str(path), dynamo=False, opset_version=17)
    got = onnxruntime.InferenceSession(str(path)).run(None, {i.name: t.numpy() for i, t in zip(
        onnxruntime.InferenceSession(str(path)).get_inputs(), (q, k, v))})[0]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(torch.from_numpy(got), expected, atol=1e-5)
