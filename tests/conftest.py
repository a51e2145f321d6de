"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU


@pytest.fixture
def seed_save(tmp_path):
    """AIMET's seed model with a reused ReLU, prepared on one image and saved: (directory, the prepared
    module, the input)."""
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    return io.save(gm, tmp_path / "saved"), gm, x
