"""The graph view opened in a real browser (headless Chromium): it loads without script errors,
shows the node count, folds a big graph, and the search reveals a module.

Runs where Chromium is installed (``.ci/run`` installs the Debian package when it can); this is the
only test that may skip, and only for that reason.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithReusedReLU

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")


def dump_dom(page: Path, profile: Path, fragment: str = "") -> tuple[str, str]:
    """The page's DOM after its scripts ran, and the browser's log (console messages included)."""
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", "--no-first-run", f"--user-data-dir={profile}", "--window-size=1200,800",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.resolve().as_uri() + fragment],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def _attr(dom: str, tag_id: str, attr: str) -> str | None:
    m = re.search(rf'<[^>]*id="{tag_id}"[^>]*\b{attr}="([^"]*)"', dom)
    return m.group(1) if m else None


def _check_loaded(dom: str, log: str, nodes: int) -> None:
    assert 'data-ready="1"' in dom, "the page's script did not finish"
    errors = re.search(r'<html[^>]*data-errors="([^"]*)"', dom)
    assert errors is None, errors.group(1)
    assert "Uncaught" not in log, [line for line in log.splitlines() if "Uncaught" in line]
    assert f'<span id="node-count">{nodes} nodes</span>' in dom


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


@needs_chromium
def test_live_view_loads_and_counts(tmp_path):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval(), example_inputs=torch.randn(1, 3, 32, 32))
    page = fxprep.show(gm, tmp_path / "g.html")
    dom, log = dump_dom(page, tmp_path / "profile")
    _check_loaded(dom, log, len(gm.graph.nodes))
    assert 'class="node kind-unrolled"' in dom and "1×6×28×28 f32" in html.unescape(dom)  # shapes on edges
    assert "reused modules unrolled: 1" in dom  # the report panel


@needs_chromium
def test_big_graph_opens_folded_and_search_reveals(tmp_path):
    model = nn.Sequential(*[Block() for _ in range(30)]).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 8))
    fxprep.save(gm, tmp_path / "saved", example_inputs=torch.randn(2, 8))
    page = fxprep.show(tmp_path / "saved", tmp_path / "big.html")  # the saved form, as `fxprep show DIR`
    nodes = len(gm.graph.nodes)
    dom, log = dump_dom(page, tmp_path / "profile")
    _check_loaded(dom, log, nodes)
    visible = int(_attr(dom, "graph", "data-visible"))
    assert visible <= 40 < nodes  # 30 folded blocks (+ input and output), not a column of every node
    dom, log = dump_dom(page, tmp_path / "profile", "#find=17.fc")
    _check_loaded(dom, log, nodes)
    details = dom[dom.index('id="details"'):]
    assert "<h3>17.fc</h3>" in details and "your module" in details  # found, unfolded, selected
    assert int(_attr(dom, "graph", "data-visible")) > visible  # block 17 was unfolded to show it
