"""Running a documentation page's ```python blocks as a reader would, shared by the docs tests
(tests/test_docs.py, test_docs_handoff.py, test_readme.py, test_load_weights.py, tests/llmcompressor).

A page's python blocks run in order, in one namespace, in a real file with each line at its line
number in the page, run as a module of that file, so a traceback points at the page's line and
``inspect`` finds the source of the classes a page defines (what ``control_flow="rewrite"`` reads).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line number of the code, the code) of each ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1).strip() == "python"]


def page_script(page: Path) -> str:
    """The page's python blocks, each line at its line number in the page (the rest blank)."""
    lines: list[str] = []
    for first, code in python_blocks(page):
        lines += [""] * (first - 1 - len(lines))
        lines += code.splitlines()
    return "\n".join(lines) + "\n"


def run_page(page: Path, workdir: Path) -> dict:
    """Run ``page``'s blocks as a module whose file is ``workdir/<page>.py``; its namespace."""
    name = "docs_page_" + re.sub(r"\W", "_", str(page.relative_to(ROOT).with_suffix("")))
    script = workdir / f"{name}.py"
    script.write_text(page_script(page))
    module = types.ModuleType(name)
    module.__file__ = str(script)
    sys.modules[name] = module  # classes a page defines get an importable module (pickle, inspect)
    try:
        exec(compile(script.read_text(), str(script), "exec"), module.__dict__)  # noqa: S102 - the docs' own code
    finally:
        sys.modules.pop(name, None)
    return module.__dict__


# every page with python blocks (tests/test_docs.py runs most, test_docs_handoff.py the hand-off pages)
ALL_PAGES = sorted(p for p in DOCS.rglob("*.md") if python_blocks(p))
