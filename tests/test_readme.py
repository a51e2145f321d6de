"""The README's hand-off examples run as written (a documented example that does not run is a bug)."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section_code(title: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], flags=re.S)


def test_hand_off_section_runs(tmp_path):
    blocks = section_code("Hand-off to quantization toolkits")
    assert len(blocks) == 4
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict = {}
        for block in blocks:  # one session, like a reader pasting them in order
            exec(compile(block, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    finally:
        os.chdir(cwd)
    assert (tmp_path / "out" / "resnet18_int8.onnx").exists() and (tmp_path / "out" / "llama_int8.onnx").exists()
    assert type(scope["sim"].model.get_submodule("model.layers.0.mlp.down_proj")).__name__.startswith("Quantized")
    assert scope["int8_model"] is not None and scope["pt2e_model"] is not None
