"""Devices a user names (``run_sequential(device=...)``, a ``device_map``), checked before anything runs.

``torch.device("cuda:3")`` is accepted on a machine without a GPU; the first tensor moved there
fails, after weights were loaded or stages ran. A sequential calibration of a large model may run
for hours before reaching the module a device map put on a missing device, so the device is checked
when it is named: its backend must be available and its index within the backend's device count.
This module depends only on :mod:`fxprep.errors`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInput


def as_device(device: Any) -> torch.device:
    """A device as ``torch.device`` (an int is a CUDA index, as in accelerate's device maps)."""
    if isinstance(device, bool):
        raise TypeError(f"{device!r} is not a device")
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def existing(device: Any, what: str) -> torch.device:
    """``device`` as a ``torch.device`` that this machine has; else :class:`InvalidInput` naming ``what``
    (the argument or map entry that named it) and what exists."""
    try:
        place = as_device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise InvalidInput(f"{what} = {device!r} is not a device (e.g. 'cpu', 'cuda', 'cuda:1', 0).") from err
    if place.type == "meta":
        raise InvalidInput(f"{what} is 'meta', which holds no values: name a device that computes ('cpu', 'cuda').")
    if place.type == "cpu":
        return place
    count = _count(place.type)
    if count == 0:
        raise InvalidInput(f"{what} = {device!r}, but this machine has no {place.type} device "
                           f"(torch.{place.type} is not available): use 'cpu', or run where a {place.type} device is.")
    if place.index is not None and place.index >= count:
        raise InvalidInput(f"{what} = {device!r}, but this machine has {count} {place.type} device(s) "
                           f"({place.type}:0 to {place.type}:{count - 1}).")
    return place


def _count(kind: str) -> int:
    """How many devices of backend ``kind`` this process sees (0: none, or the backend is unknown)."""
    if kind == "mps":
        backend = getattr(torch.backends, "mps", None)
        return 1 if backend is not None and backend.is_available() else 0
    module = getattr(torch, kind, None)
    available = getattr(module, "is_available", None)
    if module is None or available is None or not available():
        return 0
    count = getattr(module, "device_count", None)
    return int(count()) if count is not None else 1
