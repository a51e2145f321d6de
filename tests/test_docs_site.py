"""What a newcomer reads is right (issue 61): the home page leads to every page, the numbers the
pages state are the ones fxprep prints, no sample output holds a path of the machine it was made on,
and the API reference renders its cross-references instead of raw Sphinx roles.

(tests/test_docs.py runs the pages' code; this file checks their text and the built site.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fxprep.verify import FLOAT_TOLERANCES, HALF_DIVISOR

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)


def _nav_pages(entries) -> list[str]:
    out = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _mkdocs() -> dict:
    text = (ROOT / "mkdocs.yml").read_text()
    return yaml.safe_load(re.sub(r"!!python/\S+", "", text))


def test_the_home_page_leads_to_every_page() -> None:
    """The home page linked neither the guides (checkpoints, big models, VLMs, progress) nor half the concepts."""
    home = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)", home))
    pages = [p for p in _nav_pages(_mkdocs()["nav"]) if p != "index.md" and (DOCS / p).is_file()]
    assert len(pages) > 20
    assert [p for p in pages if p not in linked] == []


# a path only the machine that printed it has: a home or work directory, a virtual environment's site-packages
MACHINE_PATH = re.compile(r"(?<![\w.…])(/(?:work|root|Users|home/(?!me/))[/\w.-]*|[/\w.-]*\.venv/lib/python[\d.]+/\S*|"
                          r"/(?:usr|opt)/\S*site-packages\S*|[A-Z]:\\\\Users\S*)")


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_paths(page: Path) -> None:
    """docs/cli.md's sample output held /work/main/examples/...: a path of the machine it was made on."""
    found = MACHINE_PATH.findall(page.read_text())
    assert found == [], f"{page.name}: {found[:3]} (write paths relative to the checkout, or site-packages as …/)"


def test_the_machine_path_check_finds_one() -> None:
    assert MACHINE_PATH.findall("- dynamo: failed (1.92s) - Unsupported (/work/main/examples/non_traceable.py:18)")
    assert MACHINE_PATH.findall("at /srv/x/.venv/lib/python3.11/site-packages/transformers/a.py:3")
    assert not MACHINE_PATH.findall("at …/torchvision/models/detection/ssd.py:425 or /home/me/secret.safetensors")


def _printed(rtol: float, atol: float) -> str:
    return f"(rtol={rtol:g}, atol={atol:g})"  # as Report._verification_line prints them


def test_tolerances_are_the_ones_printed() -> None:
    """verification.md said "1e-2 for half types" where the report printed ``(rtol=0, atol=0.00165)``."""
    page = (DOCS / "concepts" / "verification.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `rtol`, `atol`"))
    rtol, atol = FLOAT_TOLERANCES
    assert f"`rtol={rtol:g}, atol={atol:g}`" in row
    assert f"√(graph depth) / {HALF_DIVISOR}" in row and "`rtol=0`" in row
    numbers = set(re.findall(r"\b\d(?:\.\d+)?e-\d+\b|\b0\.0\d+\b", row))
    assert numbers <= {f"{rtol:g}", f"{atol:g}", "0.00165"}, numbers
    for doc in [*PAGES, ROOT / "README.md"]:  # every sample verification line: the float defaults or a half-precision pair
        for found in re.findall(r"\(rtol=([\d.e-]+), atol=([\d.e-]+)\)", doc.read_text()):
            assert found[0] == "0" or _printed(float(found[0]), float(found[1])) == _printed(rtol, atol), (doc, found)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    problems = [line for line in proc.stderr.splitlines() if "handoff/llm-compressor.md" not in line and line.strip()]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [p for p in problems if p.startswith(("WARNING", "ERROR"))], problems
    return out


def test_the_api_reference_renders_its_cross_references(site: Path) -> None:
    """The API page printed 23 Sphinx roles as written (``:class:`ExportError```): mkdocstrings reads
    Markdown. They are links now where the target is on the page, inline code elsewhere."""
    page = (site / "reference" / "api" / "index.html").read_text()
    assert re.findall(r":(?:class|func|meth|mod|attr|data|exc|obj):", page) == []
    assert 'href="#fxprep.errors.ExportError"' in page and 'href="#fxprep.prepare_model"' in page
