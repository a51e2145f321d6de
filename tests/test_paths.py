"""fxprep.core.paths: dotted paths read, tested and placed as torch reads them, never into the user's modules."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from fxprep.core.paths import get_path, has_path, install

from .helpers import assert_unchanged, module_snapshot


def test_every_name_torch_lists_is_found_as_the_same_object() -> None:
    model = torchvision.models.resnet18(weights=None)
    named = [*model.named_modules(), *model.named_parameters(), *model.named_buffers()]
    for name, obj in named:
        if not name:
            continue
        assert has_path(model, name), name
        assert get_path(model, name) is obj, name
    assert get_path(model, "layer1.0.conv1.weight") is model.get_parameter("layer1.0.conv1.weight")


def test_missing_paths_are_false_and_reading_them_raises() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert not has_path(model, "0.bias_")
    assert not has_path(model, "1.weight")
    assert not has_path(model, "0.weight.nothing")
    with pytest.raises(AttributeError):
        get_path(model, "1.weight")


def test_class_attributes_properties_and_custom_getattr_count() -> None:
    class Custom(nn.Module):
        scale = 2.0

        @property
        def doubled(self) -> float:
            return self.scale * 2

        def __getattr__(self, name: str) -> object:
            if name == "virtual":
                return 7
            return super().__getattr__(name)

    model = nn.Sequential(Custom())
    assert has_path(model, "0.scale") and has_path(model, "0.doubled") and has_path(model, "0.forward")
    assert has_path(model, "0.virtual") and get_path(model, "0.virtual") == 7
    assert not has_path(model, "0.other")


def test_install_makes_plain_containers_and_registers_like_fx() -> None:
    holder = nn.Module()
    weight, buffer, lin = nn.Parameter(torch.ones(2)), torch.zeros(3), nn.Linear(2, 2)
    install(holder, "a.b.weight", weight)
    install(holder, "a.b.running", buffer)
    install(holder, "a.lin", lin)
    install(holder, "a.note", "text")
    assert type(holder.a) is nn.Module and type(holder.a.b) is nn.Module
    assert dict(holder.named_parameters(remove_duplicate=False)) == {
        "a.b.weight": weight, "a.lin.weight": lin.weight, "a.lin.bias": lin.bias}
    assert holder.get_buffer("a.b.running") is buffer
    assert holder.get_submodule("a.lin") is lin and holder.a.note == "text"


def test_install_never_writes_into_a_module_of_the_model() -> None:
    lin = nn.Linear(2, 2)
    holder = nn.Module()
    install(holder, "block", lin)
    before = module_snapshot(lin)
    install(holder, "block.weight", lin.weight)  # already there: nothing to do
    with pytest.raises(ValueError, match="'block' is a module of the model"):
        install(holder, "block.weight", nn.Parameter(torch.zeros(2, 2)))
    with pytest.raises(ValueError, match="never written into"):
        install(holder, "block.extra.w", torch.zeros(1))
    assert_unchanged(lin, before)
    assert holder.block.weight is lin.weight
