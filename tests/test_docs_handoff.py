"""The hand-off pages' code runs (docs/handoff/*.md), with what each flow must have produced checked.

Split from tests/test_docs.py (same runner) because these are the slow pages: QuantSim calibrations
and exports, torch.ao and PT2E quantization.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers_docs import ALL_PAGES, DOCS, run_page

os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")  # NNCF compiles its CPU kernels once (minutes on 2 cores)

# llm-compressor's page needs its own environment (it pins torch and transformers): it runs in
# tests/llmcompressor/test_docs_page.py (`make test-llmcompressor`)
OWN_ENVIRONMENT = {"handoff/llm-compressor.md"}
HANDOFF = [p for p in ALL_PAGES if p.relative_to(DOCS).parts[0] == "handoff"
           and str(p.relative_to(DOCS)) not in OWN_ENVIRONMENT]


def _aimet_page(scope: dict, workdir: Path) -> None:
    # the QuantSim flows ran to the end: both quantized ONNX files written, the Llama's layers quantized
    assert (workdir / "out" / "resnet18_int8.onnx").exists() and (workdir / "out" / "llama_int8.onnx").exists()
    assert type(scope["sim"].model.get_submodule("model.layers.0.mlp.down_proj")).__name__.startswith("Quantized")


def _torch_ao_page(scope: dict, workdir: Path) -> None:
    import torch

    quantized = {type(m).__module__ for m in scope["int8_model"].modules()}
    assert any("quantized" in name for name in quantized), quantized
    # PT2E: only the module configured by name got quantize/dequantize around it
    ops = [n.target for n in scope["pt2e_model"].graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.quantized_decomposed.dequantize_per_tensor.default) >= 1


def _quantized(scope: dict, workdir: Path) -> None:
    # the NNCF, Brevitas, MCT and PT2E pages each end on the toolkit's quantized model, checked there
    assert scope["quantized"] is not None


CHECKS = {"handoff/aimet.md": _aimet_page, "handoff/torch-ao.md": _torch_ao_page, "handoff/nncf.md": _quantized,
          "handoff/brevitas.md": _quantized, "handoff/mct.md": _quantized, "handoff/pt2e.md": _quantized}



@pytest.mark.parametrize("page", HANDOFF, ids=lambda p: str(p.relative_to(DOCS)))
def test_handoff_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = run_page(page, tmp_path)
    check = CHECKS.get(str(page.relative_to(DOCS)))
    if check is not None:
        check(scope, tmp_path)
