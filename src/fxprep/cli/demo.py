"""Built-in demo models: what ``fxprep demo`` (and ``make demo``) prepares and reports on.

The three AIMET Model Preparer examples are reproduced as written in its documentation (functional
ReLUs, one ReLU reused four times, an element-wise add), so the demo shows fxprep doing what that
tool's users expect, plus a torchvision ResNet-18 and a tiny transformers model built from a
config. Everything is built offline with random weights and small inputs, so the demo runs in
seconds on one CPU core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ModelWithFunctionalReLU(nn.Module):
    """Model that uses functional ReLU instead of nn.Modules. Expects input of shape (1, 3, 32, 32)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x).relu()
        return x


class ModelWithReusedReLU(nn.Module):
    """Model that uses single ReLU instances multiple times in the forward. Expects input of shape (1, 3, 32, 32)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.relu(x)
        x = self.conv2(x)
        x = self.relu(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        x = self.relu(x)
        return x


class ModelWithElementwiseAddOp(nn.Module):
    """Two convolutions summed element-wise. Takes two inputs of shape (1, 3, 32, 32)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5, bias=False)
        self.conv2 = nn.Conv2d(3, 6, 5)

    def forward(self, *inputs):
        x1 = self.conv1(inputs[0])
        x2 = self.conv2(inputs[1])
        x = x1 + x2
        return x


def _image(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _seed(cls: type[nn.Module], n_inputs: int = 1) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return cls().eval(), tuple(_image(1, 3, 32, 32) for _ in range(n_inputs))
    return build


def _resnet18() -> tuple[nn.Module, Any]:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(weights=None).eval(), (_image(1, 3, 64, 64),)


# Two layers, width 32: builds in milliseconds (the same size as the ``transformers:`` specs).
TINY_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                 max_position_embeddings=64)


def _tiny_bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**TINY_BERT)).eval()
    ids = torch.randint(0, TINY_BERT["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


@dataclass(frozen=True)
class Demo:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, Any]]
    options: tuple[tuple[str, Any], ...] = ()
    # the package the model comes from, when it is not one of fxprep's dependencies: a fresh
    # `pip install fxprep` has neither torchvision nor transformers, and the demo says so
    needs: str | None = None

    def missing(self) -> str | None:
        """The package this demo needs and cannot import, if any."""
        import importlib.util

        return self.needs if self.needs and importlib.util.find_spec(self.needs) is None else None


DEMOS: tuple[Demo, ...] = (
    Demo("ModelWithFunctionalReLU", "AIMET example 1: functional relus become nn.ReLU modules", _seed(ModelWithFunctionalReLU)),
    Demo("ModelWithReusedReLU", "AIMET example 2: one nn.ReLU called four times is unrolled", _seed(ModelWithReusedReLU)),
    Demo("ModelWithElementwiseAddOp", "AIMET example 3: x1 + x2 becomes an Add module", _seed(ModelWithElementwiseAddOp, 2)),
    Demo("resnet18", "torchvision ResNet-18 (random weights, 64x64 input)", _resnet18, needs="torchvision"),
    Demo("tiny_bert", "transformers BertModel from a 2-layer, width-32 config (tracer='auto')", _tiny_bert,
         (("tracer", "auto"),), needs="transformers"),
)
