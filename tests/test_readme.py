"""The README's example runs as written (a documented example that does not run is a bug).

The README is the front page; the manual's examples (the hand-off code this test used to run
included) are in docs/ and run in tests/test_docs.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .helpers_docs import FENCE, run_page

README = Path(__file__).resolve().parents[1] / "README.md"


def test_front_page_example_runs(tmp_path, monkeypatch):
    blocks = [m.group(2) for m in FENCE.finditer(README.read_text()) if m.group(1).strip() == "python"]
    assert len(blocks) == 1, "the front page has one example"
    monkeypatch.chdir(tmp_path)
    scope = run_page(README, tmp_path)
    assert scope["gm"].fxprep_report.verification.status == "passed"
    assert (tmp_path / "out" / "resnet18" / "manifest.json").exists()
    loaded = __import__("fxprep").load(tmp_path / "out" / "resnet18")
    torch.testing.assert_close(loaded(scope["x"]), scope["gm"](scope["x"]))
