"""The models and toolkit runs of the hand-off table (issue 29), shared by tests/test_toolkits_*.py.

Each toolkit is used as its documentation says, on the original model and, through fxprep's
adapter, on the prepared graph of a twin of it (same seed: toolkits write into the modules they
are given, BatchNorm merges for instance, and a prepared graph shares the user's modules). The
measure is SQNR of the quantized model's first output against the float model's.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")  # NNCF compiles its CPU kernels once (minutes on 2 cores)

import aimet_torch.model_preparer as aimet_preparer  # noqa: E402
import nncf  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
import transformers  # noqa: E402
from aimet_torch.quantsim import QuantizationSimModel  # noqa: E402
from brevitas.graph.calibrate import calibration_mode  # noqa: E402
from brevitas.graph.quantize import preprocess_for_quantize, quantize  # noqa: E402
from torch import nn  # noqa: E402
from torch.ao.quantization import get_default_qconfig_mapping  # noqa: E402
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx  # noqa: E402
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: E402
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86  # noqa: E402

import fxprep  # noqa: E402
from fxprep.cli.specs import revive_zero_weights  # noqa: E402
from fxprep.compat import aimet as fx_aimet  # noqa: E402
from fxprep.compat import brevitas as fx_brevitas  # noqa: E402
from fxprep.compat import mct as fx_mct  # noqa: E402
from fxprep.compat import nncf as fx_nncf  # noqa: E402
from fxprep.compat.retrace import retraceable  # noqa: E402

from .helpers import ENGINE, with_batchnorm_statistics  # noqa: E402
from .helpers import QUANT as AIMET_QUANT  # noqa: E402
from .helpers import _float as aimet_float  # noqa: E402

torch.set_num_threads(1)  # as importing tests/test_aimet_handoff.py (which this file did until issue 62) set it

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)

TEXT: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                         n_positions=32)),
    "bert": lambda: transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                                   num_attention_heads=4, intermediate_size=48,
                                                                   max_position_embeddings=32)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, pad_token_id=0)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                                                  num_experts_per_tok=2)),
}
VISION: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (1, 3, 64, 64)),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(weights=None), (1, 3, 64, 64)),
    "vit_b_16": (lambda: torchvision.models.vit_b_16(weights=None, image_size=32), (1, 3, 32, 32)),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", pretrained=False), (1, 3, 64, 64)),
    # its attention biases are for a 7x7 last stage: 224 x 224 inputs only (img_size=64 still builds 7x7 biases)
    "efficientformer_l1": (lambda: timm.create_model("efficientformer_l1", pretrained=False), (1, 3, 224, 224)),
}
MODELS = [*TEXT, *VISION]


def build(name: str) -> nn.Module:
    """A fresh model, the same weights on every call."""
    torch.manual_seed(0)
    if name in TEXT:
        return TEXT[name]().eval()
    make, shape = VISION[name]
    model = make()
    revive_zero_weights(model)  # torchvision's ViT head starts at zero: every output 0, any SQNR meaningless
    return with_batchnorm_statistics(model, shape)


def inputs(name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The example input and four calibration inputs."""
    gen = torch.Generator().manual_seed(1)
    if name in TEXT:
        return torch.randint(0, 64, (1, 8), generator=gen), [torch.randint(0, 64, (1, 8), generator=gen) for _ in range(4)]
    shape = VISION[name][1]
    return torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(4)]


def first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return first_tensor(next(iter(output.values())))
    return first_tensor(output[0])


def sqnr(reference: torch.Tensor, quantized: torch.Tensor) -> float:
    reference, quantized = reference.detach().float(), quantized.detach().float()
    noise = float(((reference - quantized) ** 2).mean())
    assert math.isfinite(noise), "the quantized model's output is not finite"
    return 10 * math.log10(float((reference ** 2).mean()) / max(noise, 1e-30))


# --- each toolkit as its documentation says: (model or prepared graph, example, calibration) -> quantized


def nncf_original(model, x, calibration):
    return nncf.quantize(model, nncf.Dataset(calibration), subset_size=len(calibration))


def nncf_fxprep(gm, x, calibration):
    return fx_nncf.quantize(gm, nncf.Dataset(calibration), subset_size=len(calibration))


def _calibrated(q, calibration):
    with torch.no_grad(), calibration_mode(q):
        for c in calibration:
            q(c)
    return q


def brevitas_original(model, x, calibration):
    return _calibrated(quantize(preprocess_for_quantize(model)), calibration)


def brevitas_fxprep(gm, x, calibration):
    return _calibrated(fx_brevitas.quantize(fx_brevitas.preprocess_for_quantize(gm, (x,))), calibration)


def _representative(calibration):
    def gen():
        for c in calibration:
            yield [c]
    return gen


def mct_original(model, x, calibration):
    import model_compression_toolkit as mct

    return mct.ptq.pytorch_post_training_quantization(model, _representative(calibration))[0]


def mct_fxprep(gm, x, calibration):
    return fx_mct.post_training_quantization(gm, (x,), _representative(calibration))[0]


def pt2e_quantizer(configure: Callable[[x86.X86InductorQuantizer], None] | None = None) -> x86.X86InductorQuantizer:
    quantizer = x86.X86InductorQuantizer()
    if configure is None:
        quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    else:
        configure(quantizer)
    return quantizer


def _pt2e(program, calibration, quantizer):
    prepared = prepare_pt2e(program.module(), quantizer)
    with torch.no_grad():
        for c in calibration:
            prepared(c)
    return convert_pt2e(prepared)


def pt2e_original(model, x, calibration, quantizer=None):
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # torch.export cannot return transformers' DynamicCache
    return _pt2e(torch.export.export(model, (x,)), calibration, quantizer or pt2e_quantizer())


def pt2e_fxprep(gm, x, calibration, quantizer=None):
    return _pt2e(fxprep.export_program(gm, (x,)), calibration, quantizer or pt2e_quantizer())


def _quantsim(model, x, calibration):
    """AIMET QuantSim as tests/test_aimet_handoff.py runs it: build, compute_encodings, run."""
    sim = QuantizationSimModel(model, dummy_input=(x,), **AIMET_QUANT)

    def calibrate(m: nn.Module) -> None:
        with torch.no_grad():
            for c in calibration:
                m(c)

    sim.compute_encodings(calibrate)
    return lambda inp: aimet_float(sim.model(inp))  # QuantSim returns AIMET's dequantized tensors


def aimet_original(model, x, calibration):
    return _quantsim(aimet_preparer.prepare_model(model), x, calibration)  # AIMET's docs: prepare first


def aimet_fxprep(gm, x, calibration):
    return _quantsim(gm, x, calibration)


def _torchao_fx(model, x, calibration):
    """torch.ao FX graph mode as tests/test_torch_ao.py runs it: prepare_fx, calibrate, convert_fx."""
    torch.backends.quantized.engine = ENGINE
    observed = prepare_fx(model, get_default_qconfig_mapping(ENGINE), (x,))
    with torch.no_grad():
        for c in calibration:
            observed(c)
    return convert_fx(observed)


def torchao_original(model, x, calibration):
    return _torchao_fx(model, x, calibration)


def torchao_fxprep(gm, x, calibration):
    """As docs/handoff/torch-ao.md: on a copy (the flow rewrites the module it is given); a
    transformers graph (token ids in) is shape-general, and torch.fx's re-trace cannot run its size
    code, so it goes through retraceable(..., specialize=True), every size the example's."""
    gm = copy.deepcopy(gm)
    if not x.is_floating_point():
        gm = retraceable(gm, (x,), specialize=True)
    return _torchao_fx(gm, x, calibration)


TOOLKITS = {
    "nncf": (nncf_original, nncf_fxprep),
    "brevitas": (brevitas_original, brevitas_fxprep),
    "mct": (mct_original, mct_fxprep),
    "pt2e": (pt2e_original, pt2e_fxprep),
    "aimet": (aimet_original, aimet_fxprep),
    "torchao": (torchao_original, torchao_fxprep),
}

# How fxprep's graph is made for a toolkit: AIMET users call fxprep's drop-in for AIMET's preparer
# (docs/handoff/aimet.md), which captures transformers models with return_dict=False because
# QuantSim traces with torch.jit, and that refuses ModelOutput dicts.
PREPARE: dict[str, Callable[..., nn.Module]] = {"aimet": fx_aimet.prepare_model}


def measure(toolkit: str, name: str, which: str) -> float:
    """SQNR (dB) of ``toolkit`` on model ``name``: ``which`` is "original" or "fxprep"."""
    x, calibration = inputs(name)
    model = build(name)
    with torch.no_grad():
        reference = first_tensor(model(x))
    original, ours = TOOLKITS[toolkit]
    if which == "original":
        quantized = original(model, x, calibration)
    else:
        gm = PREPARE.get(toolkit, fxprep.prepare_model)(model, example_inputs=(x,))
        quantized = ours(gm, x, calibration)
    with torch.no_grad():
        return sqnr(reference, first_tensor(quantized(x)))
