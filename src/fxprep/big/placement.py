"""Weights placed by a device map: a graph prepared on ``meta`` loaded over devices, CPU and disk.

``load_weights(gm, checkpoint, device_map=...)`` loads each tensor straight to its module's device
under accelerate's map (``"auto"`` keeps repeated blocks whole:
:func:`fxprep.big.partition.default_blocks`), leaves ``disk`` tensors in the checkpoint's own files,
and attaches accelerate's hooks; the graph moves activations at device boundaries
(:func:`_move_between_devices`).

See docs/guides/big-models.md ("Under the hood").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import InvalidInput
from .devices import as_device, existing


def send_to(value: Any, device: str) -> Any:
    """What the graph calls at a device boundary: ``value`` (tensors in containers too) on ``device``."""
    from accelerate.utils import send_to_device

    return send_to_device(value, device)


def dispatch(gm: fx.GraphModule, device_map: dict[str, Any], offload_dir: str | None,
             index: dict[str, Any] | None) -> int:
    """accelerate's ``dispatch_model`` on ``gm`` (weights already where the map puts them, those on
    disk named by ``index``), then the graph's own moves between execution devices."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    forward = type(gm).forward
    dispatch_model(gm, device_map, main_device=main_device(device_map), offload_dir=offload_dir,
                   offload_index=index, force_hooks=True)
    # The hook on the root only moves the call's inputs and outputs; it replaces gm.forward with a
    # partial, which torch.fx cannot trace again (prepare_fx): the graph is called as a graph.
    if not any(t is not None and t.is_meta for t in list(gm._parameters.values()) + list(gm._buffers.values())):
        remove_hook_from_module(gm)
        type(gm).forward = forward  # accelerate puts back a bound method, which fx does not trace
    _pin_direct_reads(gm)
    return move_between_devices(gm, device_map)


def _pin_direct_reads(gm: fx.GraphModule) -> None:
    """A tensor the graph reads with ``get_attr`` (a norm's weight, a position embedding) is read
    without calling its module, so an offload hook on that module would never onload it: such a
    module's tensors are put on its execution device and its hook taken out."""
    from accelerate.hooks import AlignDevicesHook, remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    owners = {str(n.target).rpartition(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
    for path in sorted(owners):
        module = gm.get_submodule(path) if path else gm
        hook = getattr(module, "_hf_hook", None)
        if not isinstance(hook, AlignDevicesHook) or not hook.offload or path == "":
            continue
        values = {name: hook.weights_map[name] for name, t in list(module._parameters.items()) +
                  list(module._buffers.items()) if t is not None and t.is_meta}
        remove_hook_from_module(module)
        for name, value in values.items():
            set_module_tensor_to_device(module, name, hook.execution_device, value=value)


def resolve(gm: fx.GraphModule, tree: nn.Module, device_map: Any, max_memory: dict[Any, Any] | None,
             dtype: torch.dtype | None) -> dict[str, Any]:
    from accelerate.utils import infer_auto_device_map

    from .partition import default_blocks

    if device_map == "auto":
        for key in max_memory or {}:  # accelerate asks the device for its memory: a raw error for one not here
            if key not in ("cpu", "disk"):
                existing(key, f"max_memory[{key!r}]")
        blocks = default_blocks(gm)
        classes = sorted({type(tree.get_submodule(b)).__name__ for b in blocks if _has_module(tree, b)})
        device_map = infer_auto_device_map(tree, max_memory=max_memory, no_split_module_classes=classes,
                                           dtype=dtype)
    if not isinstance(device_map, dict) or not device_map:
        raise InvalidInput(f"device_map must be 'auto' or a non-empty {{module name: device}} dict, not {device_map!r}.")
    out: dict[str, Any] = {}
    for name, device in device_map.items():
        if not isinstance(name, str) or (name and not _has_module(tree, name)):
            raise InvalidInput(f"device_map names {name!r}, which is not a module of the model.")
        if device == "disk":
            out[name] = "disk"
            continue
        if str(device).partition(":")[0] == "meta":
            raise InvalidInput(f"device_map[{name!r}] is 'meta', which holds no values: map it to 'disk' to keep its "
                               f"weights out of memory until its module runs.")
        place = existing(device, f"device_map[{name!r}]")  # a device this machine has, before anything is loaded
        out[name] = str(place) if place.type == "cpu" else place.index if place.index is not None else str(place)
    return _disjoint(gm, out)


def _disjoint(gm: nn.Module, device_map: dict[str, Any]) -> dict[str, Any]:
    """A map whose entries nest (``{"": "cpu", "model.layers.1": "disk"}``) as accelerate's
    ``dispatch_model`` takes them: disjoint, a nesting entry replaced by its children."""
    out: dict[str, Any] = {}

    def place(name: str, module: nn.Module, device: Any) -> None:
        inner = [k for k in device_map if k != name and (name == "" or k.startswith(name + "."))]
        if not inner:
            out[name] = device
            return
        if name and any(t is not None for t in list(module._parameters.values()) + list(module._buffers.values())):
            raise InvalidInput(f"device_map places modules inside '{name}', which holds tensors of its own: "
                               f"map '{name}' as a whole or each of its children.")
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            place(full, child, device_map.get(full, device))

    for name in sorted(device_map, key=lambda k: (k.count(".") if k else -1, k)):
        if not any(name != k and (k == "" or name.startswith(k + ".")) for k in device_map):
            place(name, gm.get_submodule(name) if name else gm, device_map[name])
    return out


def _has_module(tree: nn.Module, name: str) -> bool:
    try:
        tree.get_submodule(name)
    except AttributeError:
        return False
    return True


def _entry(path: str, device_map: dict[str, Any]) -> tuple[int, Any] | None:
    """The map's longest entry holding ``path``, as ``(its length, its device)``; None if none does."""
    hits = [(len(name), device) for name, device in device_map.items()
            if name == "" or path == name or path.startswith(name + ".")]
    return max(hits, key=lambda h: h[0]) if hits else None


def device_of(paths: list[str], device_map: dict[str, Any]) -> Any:
    """The device the map gives a tensor reachable under ``paths`` (its longest matching entry)."""
    hits = [hit for hit in (_entry(path, device_map) for path in paths) if hit is not None]
    if not hits:
        raise InvalidInput(f"the device_map places no module holding '{paths[0]}'.")
    return max(hits, key=lambda h: h[0])[1]


def main_device(device_map: dict[str, Any]) -> str:
    accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return str(torch_device(accelerators[0])) if accelerators else "cpu"


def _execution_device(device: Any, main: str) -> str:
    return main if device in ("cpu", "disk") else str(torch_device(device))


def move_between_devices(gm: fx.GraphModule, device_map: dict[str, Any]) -> int:
    """Where two consecutive stages of ``gm`` (:func:`fxprep.partition`) execute on different devices,
    the later one's inputs are moved (:func:`send_to`) before their first use, each value once per
    device (rotary tables read by every layer are not copied again for each one; a value a stage
    changes in place is moved afresh after it). A stage changing a moved copy in place does not
    change the original on its own device (not carried back). Nothing changes when
    the map has one execution device (CPU and disk execute on the main device)."""
    from .partition import partition

    main = main_device(device_map)
    devices = {_execution_device(d, main) for d in device_map.values()}
    if len(devices) < 2:
        return 0
    stages = partition(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    produced_on: dict[str, str] = {}
    sent: dict[tuple[str, str], fx.Node] = {}  # (value, device) -> its move, which later stages read too
    moves = 0
    for stage in stages:
        place = main
        for path in stage.weight_modules:
            hit = _entry(path, device_map)
            if hit is not None:
                place = _execution_device(hit[1], main)
                break
        computing = {n.name for n in stage.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}
        for name in stage.inputs:
            if produced_on.get(name, main) == place:
                continue
            value = by_name[name]
            users = sorted((u for u in value.users if u.name in computing), key=order.__getitem__)
            if not users:
                continue
            moved = sent.get((name, place))
            if moved is None:  # the first stage on this device to read it: moved once, before that use
                with gm.graph.inserting_before(users[0]):
                    moved = sent[(name, place)] = gm.graph.call_function(send_to, (value, place))
                moves += 1
            for user in users:
                user.replace_input_with(value, moved)
        for name in stage.outputs:
            produced_on[name] = place
            # changed in place here (a stage outputs an existing value only then): copies on other devices are stale
            for key in [k for k in sent if k[0] == name and k[1] != place]:
                del sent[key]
    if moves:
        gm.graph.lint()
        gm.recompile()
    return moves


def torch_device(device: Any) -> torch.device:
    """A device-map value (``"cpu"``, ``0``, ``"cuda:1"``) as a ``torch.device``."""
    return as_device(device)
