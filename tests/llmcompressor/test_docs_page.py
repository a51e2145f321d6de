"""docs/handoff/llm-compressor.md runs (in llm-compressor's environment: the default suite's
tests/test_docs_handoff.py leaves this page to this file)."""

from __future__ import annotations

from tests.helpers_docs import DOCS, run_page


def test_llm_compressor_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = run_page(DOCS / "handoff" / "llm-compressor.md", tmp_path)
    capture = scope["capture"]
    assert [s.name for s in capture.subgraphs] == ["head", "model.layers.0", "model.layers.1"]
    assert capture.report.verification.status == "passed"
