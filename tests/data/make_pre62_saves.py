"""Write ``tests/data/pre62_saves/``: saves made by fxprep before issue 62's regrouping (commit 546b3ac).

Why: a save names fxprep's own objects by their dotted names (``fxprep.ops.*`` classes,
``fxprep.cond.cond``, ``fxprep.decisions.check_decision``, the opaque parts of
``fxprep.capture.sites``), and moving a module must not make an earlier save unloadable.
``tests/test_pre62_saves.py`` loads these and compares with the eager outputs stored beside them.
Run once, at the repository root, on the code *before* a change of layout; never regenerate them on
a later commit (they would then prove nothing)::

    PYTHONPATH=src python tests/data/make_pre62_saves.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.data.pre62_models, by the name the saves give it

from tests.data import pre62_models as models  # noqa: E402

import fxprep  # noqa: E402

OUT = Path(__file__).resolve().parent / "pre62_saves"


def cases() -> dict[str, tuple[torch.nn.Module, tuple[Any, ...], list[tuple[Any, ...]], dict[str, Any], list[str]]]:
    """The models, built from fixed seeds (their weights are in the saves anyway)."""
    torch.manual_seed(0)
    plain = models.Plain().eval()
    x = torch.randn(2, 3, 8, 8)
    gated = models.Gated().eval()
    g = torch.randn(3, 4)
    branch = models.Branch().eval()
    b = torch.rand(2, 6) + 0.1
    decided = models.Decided().eval()
    d = torch.randn(2, 6, 8)
    return {
        "plain": (plain, (x,), [(x,), (-x,)], {}, []),
        "opaque": (gated, (g,), [(g,), (g * 3,), (-g.abs(),)], {"modules_to_exclude": [gated.keep]}, ["tests"]),
        "cond": (branch, (b,), [(b,), (-b,)], {"control_flow": "rewrite", "verify_inputs": [(-b,)]}, []),
        "values": (decided, (d, torch.tensor(4)), [(d, torch.tensor(4)), (d * 2, torch.tensor(4))], {}, []),
    }


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    for name, (model, example, checks, options, trusted) in cases().items():
        gm = fxprep.prepare_model(model, example_inputs=example, **options)
        print(name, gm.fxprep_report.tracer, sorted({type(m).__module__ for m in gm.modules()}))
        fxprep.save(gm, OUT / name, trusted_modules=trusted)
        with torch.no_grad():
            expected = {"inputs": checks, "outputs": [model(*inp) for inp in checks], "trusted_modules": trusted}
        torch.save(expected, OUT / f"{name}.expected.pt")


if __name__ == "__main__":
    main()
