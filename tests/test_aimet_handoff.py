"""AIMET QuantSim end to end on fxprep's output: construct, compute_encodings, forward, export.

Every model is prepared by fxprep, handed to ``QuantizationSimModel`` as AIMET's documentation says
(prepare first, then every quantization feature), calibrated on fixed data, run, and exported; the
SQNR of the quantized output against the float model is measured. Where AIMET's own preparer also
works, the same QuantSim run on its output gives the comparison: fxprep must be within 1 dB. The
transformers models are the point: AIMET's preparer cannot trace them at all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import aimet_torch.model_preparer as aimet_preparer
import pytest
import timm
import torch
import torchvision
from aimet_torch.quantsim import QuantizationSimModel
from torch import nn

import fxprep
from fxprep.compat import aimet as compat

from .helpers import QUANT, _float, with_batchnorm_statistics

torch.set_num_threads(1)


def sqnr_db(reference: torch.Tensor, quantized: torch.Tensor) -> float:
    """10 log10(E[ref²] / E[(ref - q)²]), the measure AIMET's own tools use."""
    reference, quantized = reference.detach().double(), quantized.detach().double()
    noise = (reference - quantized).pow(2).mean()
    return math.inf if noise == 0 else float(10 * torch.log10(reference.pow(2).mean() / noise))


def run_quantsim(gm: nn.Module, reference: nn.Module, inputs: tuple, calibration: list[tuple], export_dir: Path,
                 onnx_api: bool = False, **export_kwargs) -> tuple[QuantizationSimModel, float]:
    """QuantSim on ``gm``: build, calibrate, run on ``inputs``, export; the SQNR against ``reference``."""
    sim = QuantizationSimModel(gm, dummy_input=inputs, **QUANT)

    def calibrate(model: nn.Module) -> None:
        with torch.no_grad():
            for batch in calibration:
                model(*batch)

    sim.compute_encodings(calibrate)
    with torch.no_grad():
        quantized = _float(sim.model(*inputs))
        expected = _float(reference(*inputs))
    export_dir.mkdir(parents=True, exist_ok=True)
    if onnx_api:
        sim.onnx.export(inputs, str(export_dir / "model.onnx"), **export_kwargs)
        encodings = json.loads((export_dir / "model.encodings").read_text())
    else:
        sim.export(str(export_dir), "model", inputs)
        encodings = json.loads((export_dir / "model.encodings").read_text())
    assert (export_dir / "model.onnx").exists()
    assert encodings["activation_encodings"], "no activation was quantized"
    return sim, sqnr_db(expected, quantized)


def _batches(shape: tuple[int, ...], n: int = 2, seed: int = 0) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen),) for _ in range(n)]


VISION = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (1, 3, 64, 64)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(weights=None), (1, 3, 64, 64)),
    "levit_128s": (lambda: timm.create_model("levit_128s", pretrained=False), (1, 3, 224, 224)),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", pretrained=False), (1, 3, 64, 64)),
}
VISION_FULL = {
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(weights=None), (1, 3, 64, 64)),
    "vit_b_16": (lambda: torchvision.models.vit_b_16(weights=None), (1, 3, 224, 224)),
    "swin_t": (lambda: torchvision.models.swin_t(weights=None), (1, 3, 224, 224)),
}


# AIMET's deprecated sim.export uses the TorchScript ONNX exporter, which has no
# aten::_native_multi_head_attention (nn.MultiheadAttention's eval fast path): those use sim.onnx.export.
ONNX_API = {"vit_b_16"}


def _vision_case(name: str, build, shape, tmp_path: Path) -> None:
    from fxprep.cli.specs import revive_zero_weights

    torch.manual_seed(0)
    model = with_batchnorm_statistics(build(), shape)
    revive_zero_weights(model)  # a zero classifier head would make every SQNR meaningless
    x = _batches(shape, 1, seed=1)[0]
    calibration = _batches(shape, 2, seed=2)
    ours = fxprep.prepare_model(model, example_inputs=x)
    assert ours.fxprep_report.verification.status == "passed"
    sim, ours_db = run_quantsim(ours, model, x, calibration, tmp_path / "fxprep", onnx_api=name in ONNX_API)
    # every fxprep op module became a quantized module
    assert not [n for n, m in sim.model.named_modules() if type(m).__module__ == "fxprep.ops"]
    theirs = aimet_preparer.prepare_model(model)
    _, theirs_db = run_quantsim(theirs, model, x, calibration, tmp_path / "aimet", onnx_api=name in ONNX_API)
    print(f"{name}: SQNR fxprep {ours_db:.2f} dB, AIMET preparer {theirs_db:.2f} dB")
    assert ours_db > 5, ours_db  # 8-bit min-max on a random-weight ViT gives ~6.6 dB, AIMET's own graph too
    assert ours_db >= theirs_db - 1.0, (ours_db, theirs_db)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.smoke) if n in ("resnet18", "convnext_atto") else n
                                  for n in sorted(VISION)])
def test_quantsim_on_vision_models(name, tmp_path):
    build, shape = VISION[name]
    _vision_case(name, build, shape, tmp_path)


@pytest.mark.zoo
@pytest.mark.serial  # QuantSim keeps a quantized copy of every layer: ~4x the model in memory
@pytest.mark.parametrize("name", sorted(VISION_FULL))
def test_quantsim_on_larger_vision_models(name, tmp_path):
    build, shape = VISION_FULL[name]
    _vision_case(name, build, shape, tmp_path)


def _llm(kind: str) -> nn.Module:
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        return transformers.Qwen2ForCausalLM(config)
    config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.smoke), "qwen2", "mixtral"])
def test_quantsim_on_transformers_llms(kind, tmp_path):
    """The headline: fxprep prepares transformers LLMs for QuantSim; AIMET's preparer cannot."""
    torch.manual_seed(0)
    model = _llm(kind).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, 8), generator=gen)
    calibration = [(torch.randint(0, 64, (1, 8), generator=gen),) for _ in range(2)]
    with pytest.raises(Exception):  # noqa: B017 - whatever AIMET's fx-only tracer raises
        aimet_preparer.prepare_model(model)
    gm = compat.prepare_model(model, example_inputs={"input_ids": ids})
    assert gm.fxprep_report.verification.status == "passed"
    assert any("return_dict=False" in n for n in gm.fxprep_report.notes)

    def reference(input_ids):
        return model(input_ids, return_dict=False)

    # AIMET's deprecated sim.export goes through the TorchScript ONNX exporter, which has no
    # aten::diff (transformers' mask code uses it); sim.onnx.export is the supported way. Mixtral's
    # experts run transformers' own grouped-matmul op, which transformers' ONNX table translates.
    export_kwargs = {}
    if kind == "mixtral":
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE

        export_kwargs["custom_translation_table"] = _ONNX_TRANSLATION_TABLE
    sim, db = run_quantsim(gm, reference, (ids,), calibration, tmp_path, onnx_api=True, **export_kwargs)
    print(f"{kind}: SQNR fxprep {db:.2f} dB (AIMET's preparer: cannot trace)")
    assert db > 10, db
    layer = sim.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert type(layer).__name__.startswith("Quantized") and layer.param_quantizers["weight"] is not None


class ManyOps(nn.Module):
    """Functional ops of many kinds, each of which becomes a different fxprep.ops class."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.table = nn.Parameter(torch.randn(10, 8))
        self.register_buffer("kernel", torch.randn(4, 4, 3, 3) * 0.1)

    def forward(self, x, ids):
        h = self.proj(x)                                        # (2, 6, 8)
        h = torch.nn.functional.linear(h, self.w * 2.0)         # computed weight -> FunctionalLinear
        e = torch.nn.functional.embedding(ids, self.table + 0)  # computed table -> FunctionalEmbedding
        h = h - e / (e.abs() + 1.0)                             # Sub, Div, Abs, Add
        s = torch.softmax(h @ h.transpose(-1, -2) * 0.3, dim=-1, dtype=torch.float32)  # MatMul, Mul, Softmax
        a = torch.bmm(s, h) + torch.baddbmm(h, s, h, beta=0.5)  # Bmm, Baddbmm
        n = torch.nn.functional.layer_norm(a, (8,), self.w[0] + 1.0, None)  # FunctionalNorm
        m = torch.where(n > 0, n, n.exp() - 1) * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + 1e-5)
        c = torch.cat([m, m.cumsum(1)], dim=-1).amax(-1)        # Concat, CumSum, Amax
        img = c.reshape(2, 1, 3, 2).expand(2, 4, 3, 2)
        img = torch.nn.functional.conv2d(torch.nn.functional.pad(img, (1, 1, 1, 1)), self.kernel)  # Pad, FunctionalConv
        img = torch.nn.functional.interpolate(img, scale_factor=2.0)  # Interpolate
        img = torch.nn.functional.max_pool2d(img, 2)            # Pool
        att = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)  # SDPA
        return img.flatten(1).sum(-1) + att.mean((1, 2)) + m.masked_fill(m < 0, 0.0).sqrt().sum((1, 2))


@pytest.mark.smoke
def test_quantsim_accepts_every_kind_of_fxprep_op(tmp_path):
    torch.manual_seed(0)
    model = ManyOps().eval()
    x, ids = torch.randn(2, 6, 8), torch.randint(0, 10, (2, 6))
    gm = fxprep.prepare_model(model, example_inputs=(x, ids))
    op_classes = {type(m).__name__ for m in gm.modules() if type(m).__module__ == "fxprep.ops"}
    assert {"FunctionalLinear", "FunctionalEmbedding", "FunctionalNorm", "FunctionalConv", "Softmax", "Bmm", "Baddbmm",
            "Where", "MaskedFill", "Interpolate", "Pool", "ScaledDotProductAttention", "Concat", "CumSum"} <= op_classes
    calibration = [(torch.randn(2, 6, 8), torch.randint(0, 10, (2, 6))) for _ in range(2)]
    sim, db = run_quantsim(gm, model, (x, ids), calibration, tmp_path)
    quantized = {type(m).__name__ for m in sim.model.modules()}
    assert {f"Quantized{name}" for name in op_classes} <= quantized
    assert db > 10, db


def test_every_fxprep_op_class_is_registered():
    from aimet_torch.nn import QuantizationMixin

    from fxprep import ops

    registered = compat.register_quantsim()
    classes = [c for c in vars(ops).values() if isinstance(c, type) and issubclass(c, ops.BoundOp)]
    assert len(classes) > 40
    assert all(QuantizationMixin.cls_to_qcls.get(c) is registered[c] for c in classes)


def test_quantsim_on_a_vlm_captured_deciding_values(tmp_path):
    """Llava with a Pixtral tower: fxprep captures it only by deciding image sizes from the example
    (dynamo+values), so its graph holds the checks of those decisions and transformers' own
    ``torch._check_tensor_all``. QuantSim traces the model with torch.jit, under which ``.item()``
    gives tensors that ``aten._assert_scalar`` refused, and ONNX has no ``_is_all_true``: both made
    the hand-off fail. The user's wrapper returning the logits (QuantSim takes tensor outputs only)
    is a plain module around a transformers model, which fxprep must treat as one."""
    from . import vlm_models

    torch.manual_seed(0)
    vlm, inputs = vlm_models.llava_pixtral()
    keys = list(inputs)

    class Logits(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.model(**dict(zip(keys, args)), use_cache=False).logits

    model = Logits(vlm).eval()
    args = tuple(inputs[k] for k in keys)
    with pytest.raises(Exception):  # noqa: B017 - whatever AIMET's fx-only tracer raises
        aimet_preparer.prepare_model(model)
    gm = compat.prepare_model(model, example_inputs=args)
    report = gm.fxprep_report
    assert report.tracer == "dynamo+values" and report.verification.status == "passed"
    assert any("checked on every call" in n for n in report.notes)  # the decisions' checks are in the graph
    sim, db = run_quantsim(gm, model, args, [args], tmp_path, onnx_api=True)
    print(f"llava_pixtral: SQNR fxprep {db:.2f} dB (AIMET's preparer: cannot trace)")
    assert db > 10, db
    for path in ("model.model.vision_tower.transformer.layers.0.attention.q_proj",
                 "model.model.multi_modal_projector.linear_1", "model.model.language_model.layers.0.self_attn.q_proj"):
        layer = sim.model.get_submodule(path)
        assert type(layer).__name__.startswith("Quantized") and layer.param_quantizers["weight"] is not None
