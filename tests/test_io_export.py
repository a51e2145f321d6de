"""fxprep.io.export refuses what it cannot export with a message a person can act on: a module that
is not a prepared GraphModule, or example inputs the prepared module does not take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import InvalidInput
from fxprep.io import export


@pytest.fixture(scope="module")
def prepared():
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    return model, fxprep.prepare_model(model, example_inputs=x), x


@pytest.mark.parametrize("exporter", ["onnx", "program"])
def test_a_plain_module_is_refused(prepared, tmp_path, exporter):
    model, _, x = prepared
    with pytest.raises(InvalidInput, match="GraphModule returned by fxprep.prepare_model.*ModelWithReusedReLU"):
        if exporter == "onnx":
            export.export_onnx(model, x, tmp_path / "m.onnx")
        else:
            export.export_program(model, x)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("exporter", ["onnx", "program"])
@pytest.mark.parametrize("bad", [torch.randn(1, 3, 32, 32, dtype=torch.float64), torch.randn(1, 5, 32, 32),
                                 torch.randint(0, 9, (1, 3, 32, 32)), (torch.randn(1, 3, 32, 32),) * 2])
def test_inputs_the_prepared_module_does_not_take_are_refused(prepared, tmp_path, exporter, bad):
    _, gm, _ = prepared
    with pytest.raises(InvalidInput, match="prepared module fails on these example inputs.*1x3x32x32"):
        if exporter == "onnx":
            export.export_onnx(gm, bad, tmp_path / "m.onnx")
        else:
            export.export_program(gm, bad)


def test_valid_exports_still_work(prepared, tmp_path):
    _, gm, x = prepared
    assert export.export_onnx(gm, x, tmp_path / "m.onnx") < 1e-4
    program = export.export_program(gm, x, verify=False)
    assert torch.allclose(program.module()(x), gm(x), atol=1e-5)
    assert isinstance(program.module(), nn.Module)
