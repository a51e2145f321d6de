"""Every failure a user can cause is an FxprepError subclass with an actionable message, and the CLI
maps it to its documented exit code (issue 10).

Before the fix: ``verify_inputs`` of the wrong shape raised a raw ``RuntimeError``; ``dynamic``
naming a dimension that does not exist made capture fail and fx silently take over (then a raw
``RuntimeError`` at the second size); ``modules_to_exclude=5`` and ``module_classes_to_exclude=
nn.Linear`` raised ``TypeError: ... not iterable``; ``rtol=nan`` an ``EquivalenceError`` saying the
prepared module differs; and ``name=123``, ``share_parameters="no"`` and friends were accepted.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fxprep
from fxprep import cli

torch.set_num_threads(1)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()


X = torch.randn(2, 4)

CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("verify_inputs wrong shape", {"example_inputs": X, "verify_inputs": [torch.randn(2, 5)]}, fxprep.ModelError,
     "verify_inputs[0]"),
    ("dynamic dim that does not exist", {"example_inputs": X, "dynamic": {"input": {5: "b"}}}, fxprep.InvalidInput,
     "dimension 5 of 'input' does not exist"),
    ("dynamic input that does not exist", {"example_inputs": X, "dynamic": {"nope": {0: "b"}}}, fxprep.InvalidInput,
     "nope"),
    ("dynamic symbol not a str", {"example_inputs": X, "dynamic": {"input": {0: 3}}}, fxprep.InvalidInput, "not a str"),
    ("rtol nan", {"example_inputs": X, "rtol": math.nan}, fxprep.InvalidInput, "rtol must be a finite"),
    ("atol inf", {"example_inputs": X, "atol": math.inf}, fxprep.InvalidInput, "atol must be a finite"),
    ("rtol bool", {"example_inputs": X, "rtol": True}, fxprep.InvalidInput, "rtol"),
    ("rtol negative", {"example_inputs": X, "rtol": -1.0}, fxprep.InvalidInput, "non-negative"),
    ("name int", {"name": 123}, fxprep.InvalidInput, "name must be a non-empty str"),
    ("name empty", {"name": " "}, fxprep.InvalidInput, "name must be a non-empty str"),
    ("share_parameters str", {"share_parameters": "no"}, fxprep.InvalidInput, "share_parameters must be one of True, False"),
    ("unroll int", {"unroll": 0}, fxprep.InvalidInput, "unroll must be one of"),
    ("convert_functionals None", {"convert_functionals": None}, fxprep.InvalidInput, "convert_functionals"),
    ("copy str", {"copy": "yes"}, fxprep.InvalidInput, "copy must be one of"),
    ("verify int", {"example_inputs": X, "verify": 1}, fxprep.InvalidInput, "verify must be one of"),
    ("tracer unknown", {"tracer": "jit"}, fxprep.InvalidInput, "tracer must be one of"),
    ("style unknown", {"style": "onnx"}, fxprep.InvalidInput, "style"),
    ("fallback unknown", {"fallback": "skip"}, fxprep.InvalidInput, "fallback"),
    ("control_flow bool", {"control_flow": True}, fxprep.InvalidInput, "control_flow"),
    ("autowrap not callables", {"autowrap_functions": (1,)}, fxprep.InvalidInput, "autowrap_functions"),
    ("verify_inputs one tensor", {"verify_inputs": X}, fxprep.InvalidInput, "verify_inputs must be a list"),
    ("progress str", {"progress": "on"}, fxprep.InvalidInput, "progress must be one of"),
    ("unknown option", {"tracr": "fx"}, fxprep.UnknownOption, "known options"),
]


@pytest.mark.parametrize("what,options,error,message", CASES, ids=[c[0] for c in CASES])
def test_option_mistakes_are_fxprep_errors(what: str, options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        fxprep.prepare_model(_model(), **{"progress": False, **options})
    assert isinstance(info.value, fxprep.FxprepError)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("args,message", [
    ((5,), "modules_to_exclude must be a list, not int"),
    ((None, nn.Linear), "module_classes_to_exclude must be a list, not type"),
    (("0",), "modules_to_exclude must be a list, not str"),
])
def test_positional_argument_mistakes_are_fxprep_errors(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(fxprep.InvalidInput, match=message):
        fxprep.prepare_model(_model(), *args, progress=False)
    with pytest.raises(fxprep.InvalidInput, match=message):
        fxprep.check_traceability(_model(), X, **dict(zip(("modules_to_exclude", "module_classes_to_exclude"), args)))


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli.app, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,code,error", [
    (("--verify-input", "1x3x8x9x2"), 2, "ModelError"),
    (("--dynamic", "x:7=b"), 2, "InvalidInput"),
    (("--input", "99999999x99999999x9999"), 2, "SpecError"),
    (("-o", "/proc/no/such/dir"), 4, "SerializationError"),
])
def test_cli_maps_user_mistakes_to_documented_exit_codes(args: tuple[str, ...], code: int, error: str) -> None:
    exit_code, out = _cli("prepare", "demo:ModelWithFunctionalReLU", "--json", "-q", *args)
    assert (exit_code, out["error_type"]) == (code, error), out
    assert out["exit_code"] == code and "bug in fxprep" not in out["error"]

