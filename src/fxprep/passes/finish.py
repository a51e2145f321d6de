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
    segmentation) or a transformers ``ModelOutput`` (a model torch.fx traced, its output built from
    proxies) must still return one, so the output is wrapped in the original's type. A
    ``ModelOutput`` built from keywords drops its None fields from its keys, as the model's did (MRA
    returned ``logits`` alone eagerly and a dict with ``hidden_states: None`` prepared). Not where the
    graph's calling convention rebuilds the output already (a Dynamo capture's pytree ``out_spec``)."""
    cls = type(reference)
    model_output = any(c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.") for c in cls.__mro__)
    if cls is not collections.OrderedDict and not model_output:
        return
    if getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None) is not None:
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    if isinstance(value, dict) and type(value) is not cls:  # fx stores a dict as its immutable_dict
        value = dict(value)
        with gm.graph.inserting_before(output):
            if model_output:
                wrapped = gm.graph.call_function(cls, (), value)
            else:
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
