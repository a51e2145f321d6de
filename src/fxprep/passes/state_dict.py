"""State-dict parity: the prepared module loads the original's ``state_dict`` and vice versa.

Three things break parity after capture and the other passes, and this pass mends each, in two
steps around the passes that move modules (:func:`restore` before, :func:`record_aliases` after):

* Parameters/buffers the forward never touches are not copied into a GraphModule; they are put back
  (the same tensor objects) at their original paths.
* ``torch.fx`` registers every buffer it reads as persistent; persistence is made to match the
  original (a non-persistent rotary ``inv_freq`` must stay out of the state_dict).
* Unrolled modules and layers built from functionals hold the original tensors under *new* names.
  Those names are aliases: hidden from ``state_dict()``, and filled from their canonical key by
  ``load_state_dict()``, so both directions work with ``strict=True``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..runtime.prepared import set_preserved

ALIASES_ATTR = "_fxprep_state_aliases"
METADATA_ATTR = "_fxprep_state_metadata"


def _container(gm: nn.Module, path: str) -> nn.Module:
    module = gm
    for atom in filter(None, path.split(".")):
        child = module._modules.get(atom)
        if child is None:
            child = nn.Module()
            child.training = module.training
            module.add_module(atom, child)
        module = child
    return module


def _drop_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for alias in getattr(module, ALIASES_ATTR, {}):
        state_dict.pop(prefix + alias, None)


def _fill_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for alias, canonical in getattr(module, ALIASES_ATTR, {}).items():
        if prefix + alias not in state_dict and prefix + canonical in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + canonical]


def _restore_metadata(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Give the prepared state_dict the original's per-module ``version`` entries: a module class
    reads them to upgrade old checkpoints (MNASNet rebuilds its stem for version 1)."""
    target = getattr(state_dict, "_metadata", None)
    if target is None:
        return
    for key, meta in getattr(module, METADATA_ATTR, {}).items():
        full = f"{prefix}{key}" if key else prefix[:-1] if prefix else ""
        target[full] = dict(meta)


def _reorder(gm_module: nn.Module, original: nn.Module, user_ids: set[int]) -> None:
    """Children, parameters and buffers in the original's order (optimizer states and checkpoints
    that rely on ``parameters()`` order keep working); what fxprep added goes last."""
    for registry, reference in ((gm_module._modules, original._modules), (gm_module._parameters, original._parameters),
                                (gm_module._buffers, original._buffers)):
        order = [k for k in reference if k in registry] + [k for k in registry if k not in reference]
        if list(registry) != order:
            items = [(k, registry[k]) for k in order]
            registry.clear()
            registry.update(items)
    for name, child in gm_module._modules.items():
        theirs = original._modules.get(name)
        if child is not None and theirs is not None and id(child) not in user_ids:
            _reorder(child, theirs, user_ids)


def aliases(gm: nn.Module) -> dict[str, str]:
    """``{alias key: canonical key}`` of a prepared module (empty for anything else)."""
    return dict(getattr(gm, ALIASES_ATTR, {}))


def restore(gm: fx.GraphModule, original: nn.Module, original_state: dict[str, Any] | None = None) -> fx.GraphModule:
    """Put back (the same objects) what the forward never read, make buffer persistence the
    original's, and order children, parameters and buffers as the original does. Runs before the
    passes that name layers after their owners (:mod:`fxprep.passes.owner_names` compares a layer's
    parameters with the raw ones put back here); :func:`record_aliases` runs after them.
    ``original_state``: ``original.state_dict(keep_vars=True)`` where the caller has it already."""
    if original_state is None:
        original_state = original.state_dict(keep_vars=True)
    non_persistent = {
        f"{name}.{b}" if name else b
        for name, m in original.named_modules(remove_duplicate=False)
        if not isinstance(m, torch.jit.ScriptModule)
        for b in m._non_persistent_buffers_set
    }
    current = gm.state_dict(keep_vars=True)
    for key, tensor in original_state.items():
        if key in current:
            continue
        path, _, leaf = key.rpartition(".")
        container = _container(gm, path)
        if isinstance(tensor, nn.Parameter):
            container.register_parameter(leaf, tensor)
        elif isinstance(tensor, torch.Tensor):
            container.register_buffer(leaf, tensor, persistent=True)
    for name, module in gm.named_modules(remove_duplicate=False):
        if isinstance(module, torch.jit.ScriptModule):
            continue  # TorchScript keeps its own buffer registry; it is the user's object anyway
        for b in list(module._buffers):
            key = f"{name}.{b}" if name else b
            if key in non_persistent:
                module._non_persistent_buffers_set.add(b)
    _reorder(gm, original, {id(m) for m in original.modules()})
    return gm


def record_aliases(gm: fx.GraphModule, original: nn.Module, original_state: dict[str, Any] | None = None
                   ) -> fx.GraphModule:
    """Everything in the prepared state_dict that is not an original key is an alias of one (found
    by tensor identity, never by name), hidden by ``state_dict()`` and filled by
    ``load_state_dict()``; or a constant the tracer made, which is not state. Runs after every pass
    that moves modules: an alias recorded at a path that no longer exists would be filled by
    ``load_state_dict`` and refused as unexpected. ``original_state`` as in :func:`restore`."""
    if original_state is None:
        original_state = original.state_dict(keep_vars=True)
    canonical_by_id: dict[int, str] = {}
    for key, tensor in original_state.items():
        canonical_by_id.setdefault(id(tensor), key)
    found: dict[str, str] = {}
    for key, tensor in gm.state_dict(keep_vars=True).items():
        if key in original_state:
            continue
        if id(tensor) in canonical_by_id:
            found[key] = canonical_by_id[id(tensor)]
            continue
        path, _, leaf = key.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        if leaf in owner._buffers:  # a constant the tracer made (``_tensor_constant0``): not state
            owner._non_persistent_buffers_set.add(leaf)
    set_preserved(gm, ALIASES_ATTR, found)
    set_preserved(gm, METADATA_ATTR, {k: dict(v) for k, v in getattr(original_state, "_metadata", {}).items()})
    gm.register_state_dict_post_hook(_drop_aliases)
    gm.register_state_dict_post_hook(_restore_metadata)
    gm.register_load_state_dict_pre_hook(_fill_aliases)
    return gm
