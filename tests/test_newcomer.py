"""The newcomer check (tests/newcomer.py, ``make newcomer``) and what ``make demo`` installs (issue 61).

``make newcomer`` runs every documented command in a fresh environment (minutes); here the command
list is checked to be the pages' and the mistakes are run in the test environment (seconds each).
"""

from __future__ import annotations

import re
from pathlib import Path

from fxprep.cli.demo import DEMOS

from . import newcomer

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_commands_are_the_pages() -> None:
    cases = newcomer.documented(cuda=False)
    by_page = {page: [c.args for c in cases if c.source == page] for page in newcomer.PAGES}
    assert by_page["README.md"][0][:2] == ["prepare", "torchvision:resnet50"]
    assert ["check", "examples/non_traceable.py:NonTraceableModel", "--input", "1x10"] in by_page["docs/cli.md"]
    assert ["prepare", "./my-llama", "--meta", "--dtype", "bfloat16", "-o", "./my-llama-fx"] in by_page["docs/checkpoints.md"]
    survey = next(a for a in by_page["docs/cli.md"] if a[0] == "survey")
    assert "[" not in " ".join(survey) and survey[-2:] == ["--filter", r"^torchvision:alexnet$"]  # one model, not 121
    assert not any("--device cuda" in " ".join(c.args) for c in cases)


def test_optional_parts_are_left_out() -> None:
    assert newcomer.without_optional("fxprep a [--x y] b [-o D [--trust P ...]] c") == "fxprep a b c"


def test_the_mistakes_say_what_is_wrong() -> None:
    assert newcomer.main(["--only-mistakes"]) == 0


def test_make_demo_installs_what_the_demo_needs_only() -> None:
    """`make demo` installed the whole development environment (every toolkit, 7.1 GB) to run five models."""
    line = re.search(r"^demo = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert line is not None, "pyproject.toml has no demo extra"
    demo = {re.split(r"[<>=\[ ]", r.strip().strip('"'))[0] for r in line.group(1).split(",") if r.strip()}
    assert {d.needs for d in DEMOS if d.needs} <= demo == {"torchvision", "transformers"}
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(DEMO_STAMP): pyproject.toml"):makefile.index("\ndemo:")]
    assert '-e ".[demo]"' in recipe and "[dev]" not in recipe
    assert recipe.count("@echo") >= 2  # it says what it is doing while pip works
