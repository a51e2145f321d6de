"""Issue 59: vision-language models prepared on ``meta``, loaded offloaded, calibrated stage by stage.

Qwen2-VL, Qwen2.5-VL and Llava (Pixtral vision tower), tiny, built from their configs: each built
on ``meta`` and prepared there with the inputs that carry values (token ids, the image grid, image
sizes) given as real tensors and the pixels on ``meta`` (:mod:`fxprep.big.stand_ins`); then the weights
of a checkpoint of the same model loaded with every module on disk, and the graph run whole and
stage by stage (``run_sequential``): both equal to transformers' ``from_pretrained`` on the same
checkpoint, bit for bit, in float32 (Llava in bfloat16 too). The stand-ins take no memory: a
256 MiB one read whole leaves the process's resident set where it was.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxprep
from fxprep.big.stand_ins import zero_pages

sys.path.insert(0, str(Path(__file__).parent))
import vlm_models  # noqa: E402


@pytest.mark.parametrize(("name", "dtype"), [("qwen2_vl", torch.float32), ("qwen2_5_vl", torch.float32),
                                             ("llava_pixtral", torch.float32), ("llava_pixtral", torch.bfloat16)])
def test_a_vlm_prepared_on_meta_equals_from_pretrained(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model, inputs = getattr(vlm_models, name)()
    model = model.to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    model.save_pretrained(tmp_path / "checkpoint")
    cls, config = type(model), model.config
    del model
    with torch.device("meta"):
        meta_model = cls._from_config(config, dtype=dtype).eval()
    # values read by the forward as real tensors, the image on meta: no weight or pixel in memory
    example = {k: v.to("meta") if v.is_floating_point() else v for k, v in inputs.items()}
    gm = fxprep.prepare_model(meta_model, example_inputs=example, verify=False)
    assert all(p.is_meta for p in gm.parameters()) and all(p.is_meta for p in meta_model.parameters())
    assert any("stood in as a zero CPU tensor" in n for n in gm.fxprep_report.notes)

    reference = cls.from_pretrained(tmp_path / "checkpoint", dtype=dtype).eval()
    with torch.no_grad():
        want = reference(**inputs, use_cache=False).logits
    fxprep.load_weights(gm, tmp_path / "checkpoint", device_map={"": "disk"}, offload_dir=tmp_path / "offload")
    with torch.no_grad():
        assert torch.equal(gm(**inputs).logits, want)
    stages = fxprep.partition(gm)
    assert len(stages) >= 5  # vision blocks and language layers, each a stage
    run = fxprep.run_sequential(stages, [inputs], device="cpu", offload="disk")
    assert torch.equal(run.outputs[0].logits, want)
    assert run.peak_weight_bytes < run.total_weight_bytes


def test_a_stand_in_takes_no_memory() -> None:
    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    weight = zero_pages((8192, 8192), torch.float32)  # 256 MiB
    x = torch.ones(2, 8192)
    assert torch.equal(x @ weight.T, torch.zeros(2, 8192)) and weight.sum().item() == 0
    assert process.memory_info().rss - before < 32 << 20


def test_a_meta_model_with_meta_inputs_is_not_stood_in() -> None:
    """The decoder-only path stays as it was: everything on meta, nothing computed."""
    from fxprep.big.stand_ins import needed

    model, inputs = vlm_models.qwen2_vl()
    with torch.device("meta"):
        meta_model = type(model)(model.config)
    assert not needed(meta_model, {k: v.to("meta") for k, v in inputs.items()})
    assert needed(meta_model, inputs) and not needed(model, inputs)
    del model, meta_model



def test_copy_true_keeps_the_copy_on_meta() -> None:
    """copy=True with stand-ins: the copy is made on meta first, so the graph holds the copy's meta
    tensors (not zeros in memory) and shares none with the model."""
    model, inputs = vlm_models.llava_pixtral()
    with torch.device("meta"):
        meta_model = type(model)(model.config).eval()
    del model
    example = {k: v.to("meta") if v.is_floating_point() else v for k, v in inputs.items()}
    gm = fxprep.prepare_model(meta_model, example_inputs=example, verify=False, copy=True)
    assert all(p.is_meta for p in gm.parameters())
    assert not {id(p) for p in gm.parameters()} & {id(p) for p in meta_model.parameters()}
