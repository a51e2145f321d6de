"""Saves written before issue 62's regrouping still load, and compute what the eager model did.

A save names fxprep's own objects by their dotted names (``fxprep.ops.*`` op classes,
``fxprep.cond.cond``, ``fxprep.decisions.check_decision``, the opaque parts of
``fxprep.capture.sites``); a module moved in the package must keep those names loadable
(docs/version-policy.md). The saves in ``tests/data/pre62_saves`` were written by
``tests/data/make_pre62_saves.py`` on commit 546b3ac and are never regenerated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fxprep

SAVES = Path(__file__).parent / "data" / "pre62_saves"
CASES = ("plain", "opaque", "cond", "values")


def _named(directory: Path) -> set[str]:
    """Every ``fxprep.`` dotted name the save's JSON files give (to show the case covers what it says)."""
    names: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.startswith("fxprep.") and " " not in value:
            names.add(value)

    for name in ("graph.json", "modules.json"):
        walk(json.loads((directory / name).read_text()))
    return names


@pytest.mark.parametrize("case", CASES)
def test_a_save_from_before_the_regroup_loads_and_matches_the_eager_model(case: str) -> None:
    expected = torch.load(SAVES / f"{case}.expected.pt", weights_only=True)
    loaded = fxprep.load(SAVES / case, trusted_modules=expected["trusted_modules"])
    with torch.no_grad():
        for inputs, output in zip(expected["inputs"], expected["outputs"], strict=True):
            torch.testing.assert_close(loaded(*inputs), output)


def test_the_saves_name_the_fxprep_objects_they_are_kept_for() -> None:
    named = {case: _named(SAVES / case) for case in CASES}
    assert any(n.startswith("fxprep.ops.") for n in named["plain"])
    assert {"fxprep.capture.sites.OpaqueMethod", "fxprep.capture.sites.OpaqueFunction"} <= named["opaque"]
    assert "fxprep.cond.cond" in named["cond"]
    assert "fxprep.decisions.check_decision" in named["values"]
