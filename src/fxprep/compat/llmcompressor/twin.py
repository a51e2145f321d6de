"""A plain twin of a wrapped model, captured in its place, and the graph bound back to the model.

compressed-tensors and accelerate wrap a model's modules in ways Dynamo cannot trace.
:func:`plain_twin` makes a twin of the module tree (same classes and attributes, plain tensors, no
hooks), sharing the model's tensors where they are real and on one device and holding ``meta``
tensors otherwise; :func:`bind_to_model` puts the model's own modules back at the paths the graph
calls. The model itself is never changed.

See docs/handoff/llm-compressor.md ("Under the hood").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ...errors import PassFailure

# instance attributes the wrappers set (compressed-tensors' offloading, accelerate's hooks): the twin
# runs its class's forward instead
_WRAPPER_ATTRIBUTES = ("forward", "_original_forward_func", "_hf_hook", "_old_forward")


@dataclass
class Twin:
    """``root``: the twin of the model; ``model_of``: ``{id(twin module): the model's module}``;
    ``device``: where its tensors are (``meta`` when they could not be shared)."""

    root: nn.Module
    model_of: dict[int, nn.Module]
    twin_of: dict[int, nn.Module]
    device: torch.device

    @property
    def real(self) -> bool:
        """Whether the twin holds the model's own tensors (a capture on it can be verified)."""
        return self.device.type != "meta"


def stored_tensors(mapping: Any) -> dict[str, Any]:
    """A module's ``_parameters`` / ``_buffers`` as stored, without onloading: compressed-tensors'
    ``OffloadCache`` keeps them in ``offloaded_values`` (a ``meta`` tensor for one on disk)."""
    return dict(_stored(mapping))


def _stored(mapping: Any) -> Any:
    """:func:`stored_tensors` without the copy (read only)."""
    stored = getattr(mapping, "offloaded_values", None)
    return stored if isinstance(stored, dict) else mapping


def _devices(model: nn.Module) -> set[torch.device]:
    found: set[torch.device] = set()
    for module in model.modules():
        for mapping in (module._parameters, module._buffers):
            for t in _stored(mapping).values():
                if isinstance(t, torch.Tensor):
                    found.add(t.device)
    return found


def plain_twin(model: nn.Module, shallow: set[int] | frozenset[int] = frozenset()) -> Twin:
    """The twin of ``model`` (see the module docstring). Modules that appear twice (shared) are
    twinned once, so the twin shares them the same way.

    ``shallow``: ``id`` of modules nothing will run on the twin (the capture calls them whole, and
    binds the call to the model's module): where the twin is on ``meta``, each is twinned as the
    module object alone (class and attributes), without its children and tensors. On a 7B that is
    all but the few modules around the decoder layers."""
    devices = _devices(model)
    meta = len(devices) != 1 or next(iter(devices)).type == "meta"
    memo: dict[int, nn.Module] = {}
    model_of: dict[int, nn.Module] = {}
    root = _twin(model, memo, model_of, {}, meta, shallow if meta else frozenset())
    device = torch.device("meta") if meta else next(iter(devices))
    return Twin(root, model_of, memo, device)


def _twin(module: nn.Module, memo: dict[int, nn.Module], model_of: dict[int, nn.Module], tensors: dict[int, Any],
          meta: bool, shallow: set[int] | frozenset[int]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    twin: nn.Module = object.__new__(type(module))
    memo[id(module)] = twin
    model_of[id(twin)] = module
    state = dict(module.__dict__)
    for name in _WRAPPER_ATTRIBUTES:
        state.pop(name, None)
    for name in [n for n in state if "hooks" in n]:
        if isinstance(state[name], dict):
            state[name] = OrderedDict()  # the twin runs with no hook: the capture must not fire the modifiers'
    if id(module) in shallow:
        state.update(_parameters={}, _buffers={}, _non_persistent_buffers_set=set(), _modules={})
        twin.__dict__.update(state)
        return twin
    state["_parameters"] = {k: _tensor(v, tensors, meta) for k, v in _stored(module._parameters).items()}
    state["_buffers"] = {k: _tensor(v, tensors, meta) for k, v in _stored(module._buffers).items()}
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    state["_modules"] = {k: (None if c is None else _twin(c, memo, model_of, tensors, meta, shallow))
                         for k, c in module._modules.items()}
    twin.__dict__.update(state)
    return twin


def _tensor(value: Any, tensors: dict[int, Any], meta: bool) -> Any:
    """The model's tensor itself, or (``meta``) one ``meta`` stand-in per tensor object (ties stay ties);
    a tensor already on ``meta`` is its own stand-in (it holds nothing to protect)."""
    if not isinstance(value, torch.Tensor) or not meta or (type(value) in (torch.Tensor, nn.Parameter) and value.is_meta):
        return value
    if id(value) not in tensors:
        stand_in = torch.empty_like(value, device="meta")
        if isinstance(value, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=value.requires_grad)
        tensors[id(value)] = stand_in
    return tensors[id(value)]


def bind_to_model(gm: fx.GraphModule, twin: Twin) -> None:
    """Put the model's own module at every path ``gm`` calls (``call_module``) or reads a tensor of
    (``get_attr``) where ``gm`` holds a twin, so the graph runs the model's objects. Only ``gm``'s
    own tree changes (its containers are the twin's, which nobody else holds)."""
    paths = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            paths.add(str(node.target))
        elif node.op == "get_attr":
            paths.add(str(node.target).rpartition(".")[0])
    for path in sorted(p for p in paths if p):
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):  # outermost first: the rest of the path is then the model's
            prefix = ".".join(parts[:depth])
            held = gm.get_submodule(prefix)
            real = twin.model_of.get(id(held))
            if real is not None:
                parent_path, _, leaf = prefix.rpartition(".")
                parent = gm.get_submodule(parent_path) if parent_path else gm
                parent._modules[leaf] = real
                break
    left = [p for p in paths if p and id(gm.get_submodule(p)) in twin.model_of]
    if left:
        raise PassFailure(f"the graph still calls the twin's modules at {sorted(left)[:5]} after binding to the model.")
