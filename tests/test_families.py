"""The family registry (fxprep.families): a model's family told by identity, the neutral family for
any other model, a new family asked by the pipeline with no change outside its folder, and fxprep
preparing a model with transformers not installed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxprep
from fxprep import families
from fxprep.capture.request import CaptureRequest
from fxprep.families import NEUTRAL, Family, family_for


def test_a_model_of_no_family_gets_the_neutral_one() -> None:
    linear = nn.Linear(2, 2)
    assert family_for(linear) is NEUTRAL
    assert family_for("not a module") is NEUTRAL
    assert NEUTRAL.concrete_args(linear, {"a": 1}, None) == {"a": 1}
    assert NEUTRAL.absent_outputs(None, {"a": 1}) == {} and NEUTRAL.without_added({"a": 1}, {}) == {"a": 1}
    assert NEUTRAL.example_inputs(linear) is None and NEUTRAL.tuple_output(linear) is None
    assert NEUTRAL.fx_capture(linear, None) == (None, None) and NEUTRAL.method_source(None) is None
    assert not NEUTRAL.recover(RuntimeError("x"), linear, None) and not NEUTRAL.output_recorders([print])
    assert CaptureRequest(linear).family is NEUTRAL


def test_a_transformers_model_and_a_module_wrapping_one_are_the_transformers_family() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16)
    bert = transformers.BertModel(config)
    family = family_for(bert)
    assert family.name == "transformers" and family_for(nn.Sequential(bert)) is family
    assert CaptureRequest(bert).family is family
    assert set(family.example_inputs(bert, batch=1, seq_len=4) or {}) >= {"input_ids"}
    # what concerns the transformers model itself is not asked of a wrapper (as before the registry)
    assert family.tuple_output(bert) is not None and family.tuple_output(nn.Sequential(bert)) is None


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale


class ScaledFamily(Family):
    """A family that is not transformers: it fixes ``scale`` for capture and notes each capture."""

    name = "scaled"

    def matches(self, model: Any) -> bool:
        return isinstance(model, Scaled)

    def concrete_args(self, model: nn.Module, concrete: dict[str, Any] | None, example: Any) -> dict[str, Any] | None:
        return concrete if "scale" in (concrete or {}) else {**(concrete or {}), "scale": 2.0}

    @contextlib.contextmanager
    def _noting(self, notes: list[str] | None) -> Iterator[None]:
        if notes is not None:
            notes.append("captured with the scaled family's context")
        yield

    def capture_context(self, model: nn.Module, notes: list[str] | None = None, example: Any = None,
                        dynamic_length: int | None = None) -> contextlib.AbstractContextManager[None]:
        return self._noting(notes)


def test_a_new_family_is_asked_with_no_change_outside_its_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    registered = families.known()
    monkeypatch.setattr(families, "known", lambda: (ScaledFamily(), *registered))
    model = Scaled().eval()
    assert family_for(model).name == "scaled" and family_for(nn.Linear(2, 2)) is NEUTRAL
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x, 2.0))
    assert "captured with the scaled family's context" in fxprep.get_report(gm).notes


def test_fxprep_prepares_a_model_without_transformers_installed() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if not installed: importing it raises ImportError\n"
        "import torch, fxprep\n"
        "from fxprep.families import family_for\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))\n"
        "assert family_for(model).name == 'none' and 'fxprep.families.transformers' in sys.modules\n"
        "assert fxprep.check_traceability(model, torch.randn(2, 4)) is not None\n"
        "print('ok')\n"
    )
    src = str(Path(fxprep.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
