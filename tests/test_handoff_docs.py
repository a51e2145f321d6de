"""Each hand-off page under docs/handoff/ runs as written (a documented example that does not run is a bug)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

PAGES = Path(__file__).resolve().parents[1] / "docs" / "handoff"

os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")  # NNCF compiles its CPU kernels once (minutes on 2 cores)


def page_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (PAGES / name).read_text(), flags=re.S)


@pytest.mark.parametrize("page", ["nncf.md", "brevitas.md", "mct.md", "pt2e.md"])
def test_handoff_page_runs(page, tmp_path, monkeypatch):
    blocks = page_blocks(page)
    assert blocks, f"{page} has no python block"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:  # one session, like a reader pasting them in order
        exec(compile(block, str(PAGES / page), "exec"), scope)  # noqa: S102 - the page's own code
    assert scope["quantized"] is not None
