"""Tensors no checkpoint holds, recomputed by their owning module's own initialisation.

Non-persistent buffers (rotary ``inv_freq``, causal masks, ``position_ids``, an embedding's scale)
are in no checkpoint, and a module prepared on ``meta`` holds no value for them. ``from_pretrained``
fills them with the model's ``_init_weights``; :func:`buffer_values` does the same for
:func:`fxprep.load_weights`, and only takes a value two runs from different garbage agree on:

* the whole model's ``_init_weights`` of the owner;
* else the owner's class built again from its own attributes (:func:`_by_rebuild`);
* else, from above (:func:`_from_above`): a sub-model's own ``_init_weights`` of the owner, or an
  initialisation run on a module above the owner while all that module holds is on ``meta``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def buffer_values(owner: nn.Module, keys: list[str], original: nn.Module | None,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Values on ``device`` for ``owner``'s buffers ``keys``, each the way the module docstring
    lists; those no way gives are left out."""
    values = _by_hf_init(owner, keys, getattr(original, "_init_weights", None), device) or {}
    missing = [k for k in keys if k not in values]
    if missing:
        values.update(_by_rebuild(owner, missing, device))
    missing = [k for k in keys if k not in values]
    if missing:
        values.update(_from_above(owner, missing, original, device))
    return values


def _by_hf_init(owner: nn.Module, keys: list[str], init: Any, device: torch.device,
                via: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """transformers' own ``init`` (a model's ``_init_weights``: how ``from_pretrained`` fills these
    buffers) of ``owner``, run twice on buffers filled with different garbage: a value both runs
    agree on is computed. ``via``: a module above ``owner`` whose initialisation fills them, run only
    while every tensor it holds but these is on ``meta`` (so it can change nothing else)."""
    if init is None or not callable(init) or not keys or any(not p.is_meta for p in owner.parameters(recurse=False)):
        return None
    if via is not None:
        ours = {id(owner._buffers[k]) for k in keys}
        if any(not t.is_meta and id(t) not in ours for t in (*via.parameters(), *via.buffers())):
            return None
    old = {k: owner._buffers[k] for k in keys}
    runs = []
    try:
        for fill in (0, 1):
            for k, t in old.items():
                owner._buffers[k] = torch.full(t.shape, fill, dtype=t.dtype, device=device)
            with torch.no_grad():
                init(owner if via is None else via)
            runs.append({k: owner._buffers[k] for k in keys})
    except Exception:  # noqa: BLE001 - not transformers' kind of module: the next way is tried
        runs = []
    finally:
        for k, t in old.items():
            owner._buffers[k] = t  # the caller puts the new values in everywhere at once
    if len(runs) != 2:
        return None
    return {k: runs[1][k] for k in keys if torch.equal(runs[0][k], runs[1][k])}


def _from_above(owner: nn.Module, keys: list[str], original: nn.Module | None,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Buffers that the whole model's ``_init_weights`` does not fill on their owner: a sub-model's
    own ``_init_weights`` may (PaliGemma's Gemma text model scales its embeddings; the VLM's
    initialisation does not know that module), or an initialisation run on a module above the owner
    (Falcon-H1's ``mup_vector``, set for every layer's mixer by the whole model's), while all that
    module holds is on ``meta``."""
    above = _ancestors(original, owner)
    inits: dict[Any, Any] = {}
    for module in (original, *above):
        init = getattr(module, "_init_weights", None)
        if callable(init):
            inits.setdefault(getattr(init, "__func__", init), init)
    root = getattr(getattr(original, "_init_weights", None), "__func__", None)
    found: dict[str, torch.Tensor] = {}
    for via in (None, *above):
        for func, init in inits.items():
            if via is None and func is root and root is not None:
                continue  # the whole model's own init of the owner: buffer_values ran it first
            left = [k for k in keys if k not in found]
            if not left:
                return found
            found.update(_by_hf_init(owner, left, init, device, via=via) or {})
    return found


def _ancestors(original: nn.Module | None, owner: nn.Module) -> list[nn.Module]:
    """The modules above ``owner`` in ``original``, nearest first (none where it is not found)."""
    if original is None:
        return []
    path = next((n for n, m in original.named_modules() if m is owner), None)
    if not path:
        return []
    parts = path.split(".")
    return [original.get_submodule(".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1)]


def _by_rebuild(owner: nn.Module, keys: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The owner's class built again on ``device`` from its own attributes: every argument of its
    ``__init__`` must be an attribute of the same name (``device`` and ``dtype`` aside), so no
    default can stand in for a value the original was built with. Built twice; values both agree on."""
    cls = type(owner)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            return {}
        if p.name == "device":
            kwargs[p.name] = device
        elif p.name == "dtype" and keys:
            kwargs[p.name] = owner._buffers[keys[0]].dtype
        elif p.name in owner.__dict__ and not isinstance(owner.__dict__[p.name], torch.Tensor):
            kwargs[p.name] = owner.__dict__[p.name]
        else:
            return {}
    builds = []
    try:
        for _ in range(2):
            with torch.device(device):
                builds.append(cls(**kwargs))
    except Exception:  # noqa: BLE001 - not rebuildable this way
        return {}
    out = {}
    for k in keys:
        a, b = builds[0]._buffers.get(k), builds[1]._buffers.get(k)
        if a is not None and b is not None and a.device == device and torch.equal(a, b):
            out[k] = a
    return out
