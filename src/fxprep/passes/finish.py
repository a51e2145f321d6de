"""The last touches on a prepared graph, after every other pass: modes and the output's type.

Both follow the user's model rather than fx's defaults: fx builds new modules in training mode and
returns the plain dict it traced, where the model may be in eval mode and return an ``OrderedDict``.
"""

from __future__ import annotations

import collections
from typing import Any

import torch.fx as fx
from torch import nn


def restore_output_type(gm: fx.GraphModule, reference: Any) -> None:
    """fx returns the dict literal it traced; a model returning an ``OrderedDict`` (torchvision
    segmentation) must still return one, so the output is wrapped in the original's type."""
    if type(reference) is not collections.OrderedDict:
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    if isinstance(value, dict):  # fx stores it as its immutable_dict
        value = dict(value)
        with gm.graph.inserting_before(output):
            wrapped = gm.graph.call_function(collections.OrderedDict, (value,))
        wrapped.meta["fxprep_kind"] = "other"
        output.args = (wrapped,)


def match_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give modules fxprep created the training flag of the scope they came from; the user's own
    module objects are left exactly as they are (setting gm.train() would flip them)."""
    originals = {id(m) for m in model.modules()}
    scopes = dict(model.named_modules(remove_duplicate=False))
    gm.training = model.training
    for name, module in gm.named_modules():
        if id(module) in originals or module is gm:
            continue
        scope = name
        mode = model.training
        while scope:
            scope = scope.rpartition(".")[0]
            if scope in scopes:
                mode = scopes[scope].training
                break
        if "." not in name:
            mode = model.training
        module.training = mode
