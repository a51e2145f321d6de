"""Every ```python block of the documentation runs (a documented example that does not run is a bug).

Each page under ``docs/`` is one test: its python blocks run in order, in one namespace, like a reader
pasting them into one session, in a temporary working directory. The blocks are written into a real
file with each line at its line number in the page, run as a module of that file, so a traceback
points at the page's line and ``inspect`` finds the source of the classes a page defines (what
``control_flow="rewrite"`` reads). A fragment that cannot run alone is fenced ```py-norun (or
```text); any other fence language is refused, so a typo cannot turn a block off silently.
"""

from __future__ import annotations

import pytest

from .helpers_docs import ALL_PAGES, DOCS, FENCE, ROOT, page_script, run_page

# what a fence may say: runnable python, a fragment that is not run, or something that is not python
LANGUAGES = {"python", "py-norun", "text", "bash", "sh", "shell", "console", "json", "yaml", "toml", "ini", "html",
             "css", "js", "xml", "csv", "diff", "dot", "mermaid", ""}


# the hand-off pages (QuantSim, torch.ao, ...) are the slow ones: they run in tests/test_docs_handoff.py,
# another file, so that pytest-xdist's --dist loadfile puts them on another worker;
# checkpoints.md runs in tests/test_docs_checkpoints.py, which first writes the checkpoint the page names
OWN_RUNNER = {"checkpoints.md"}
PAGES = [p for p in ALL_PAGES if p.relative_to(DOCS).parts[0] != "handoff" and str(p.relative_to(DOCS)) not in OWN_RUNNER]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page, tmp_path)


def test_pages_with_code_are_found():
    names = {str(p.relative_to(DOCS)) for p in ALL_PAGES}
    assert {"getting-started.md", "handoff/aimet.md", "handoff/torch-ao.md", "handoff/onnx.md"} <= names


def test_fences_name_a_known_language():
    for page in [*DOCS.rglob("*.md"), ROOT / "README.md"]:
        for m in FENCE.finditer(page.read_text()):
            assert m.group(1).strip() in LANGUAGES, f"{page}: a ```{m.group(1)} block (use python, py-norun or text)"


def test_script_keeps_the_page_line_numbers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\na = 1\n```\n\ntext\n```py-norun\nnot run\n```\n```python\nb = a + 1\n```\n")
    lines = page_script(page).splitlines()
    assert lines[3] == "a = 1" and lines[11] == "b = a + 1" and "not run" not in lines
