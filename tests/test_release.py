"""What a user of a release relies on besides the API: the package says it is typed, the versions it
states are the ones tested, and `fxprep demo` works in a fresh install that has neither torchvision
nor transformers (the wheel-in-a-clean-venv run itself is `make dist`, run by .ci/run)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

import fxprep
from fxprep import cli

ROOT = Path(__file__).resolve().parents[1]


def test_package_is_marked_typed_and_ships_the_marker():
    assert (Path(fxprep.__file__).parent / "py.typed").exists()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["fxprep"]


def test_stated_floors_are_the_oldest_tested_versions():
    """pyproject's floors and ci/oldest-requirements.txt (what make test-oldest installs) agree."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for req in project["dependencies"] + project["optional-dependencies"]["test"]:
        m = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
        if m:
            floors[m.group(1).lower()] = m.group(2)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9.]+)", (ROOT / "ci" / "oldest-requirements.txt").read_text(), re.M))
    for name, version in pins.items():
        assert floors.get(name.lower()) is not None, f"{name} is pinned for the oldest run but has no floor"
        floor = tuple(int(p) for p in floors[name.lower()].split("."))
        pinned = tuple(int(p) for p in version.split("."))
        assert pinned[:len(floor)] == floor, f"{name}: floor {floors[name.lower()]} but the oldest run tests {version}"


def test_demo_skips_what_is_not_installed(monkeypatch):
    real = importlib.util.find_spec

    def without_torchvision(name, *args, **kwargs):
        return None if name == "torchvision" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_torchvision)
    result = CliRunner().invoke(cli.app, ["demo", "--only", "resnet18|ModelWithReusedReLU", "--json"])
    assert result.exit_code == 0, result.output
    demos = {d["name"]: d for d in json.loads(result.stdout)["demos"]}
    assert demos["resnet18"]["ok"] is None and "torchvision" in demos["resnet18"]["skipped"]
    assert demos["ModelWithReusedReLU"]["ok"] is True


@pytest.mark.smoke
def test_block_reuse_on_a_torch_without_it_says_why(monkeypatch):
    """Block reuse needs a Dynamo flag torch 2.8 lacks: there (or with the flag route made unavailable
    here) the model is captured whole and the report names the flag and the torch version."""
    import torch
    import transformers

    from fxprep.capture import dynamo

    if dynamo.flag_available():  # the newest torch: take the route an older one takes
        monkeypatch.setattr(dynamo, "default_route", lambda: "regroup")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 64, (1, 6))}, progress=False)
    report = gm.fxprep_report
    assert report.verification.status == "passed" and report.tracer == "dynamo"
    notes = [n for n in report.notes if n.startswith("block reuse: off: it needs")]
    assert len(notes) == 1 and torch.__version__ in notes[0] and "install_free_tensors_for_export" in notes[0]
    assert not report.reuse.get("captured")
