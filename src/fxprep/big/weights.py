"""Weights after preparation: a graph prepared on ``meta`` materialised from a checkpoint.

:func:`load_weights` puts a checkpoint's weights into a graph prepared on ``meta``, shard by shard,
by the original names: each shared tensor replaced everywhere at once so ties stay ties, everything
checked before anything changes, non-persistent buffers recomputed (:mod:`fxprep.big.recompute`),
``meta`` device literals moved, hub-layout checkpoints converted. :func:`verify_prepared` then
compares with the original, which the prepared module remembers (:func:`remember_original`).

See docs/guides/big-models.md ("Under the hood").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import families
from ..core.inputs import normalize_example_inputs, split_calls
from ..errors import InvalidInput, WeightsError
from ..ops import BoundOp
from . import recompute, weight_store
from .checkpoint import Checkpoint, open_checkpoint

ORIGINAL_META = "fxprep_original"


class _Original:
    """The model a prepared module came from, and the ``concrete_args`` it was captured with. A deep
    copy of the prepared module shares it (a copy must not copy the model), pickling drops it."""

    def __init__(self, model: nn.Module | None, concrete: dict[str, Any] | None):
        self.model = model
        self.concrete = concrete

    def __deepcopy__(self, memo: dict[int, Any]) -> _Original:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Original, (None, None))


def remember_original(gm: fx.GraphModule, model: nn.Module, concrete: dict[str, Any] | None) -> None:
    """Called by ``prepare_model``: what :func:`load_weights` and :func:`verify_prepared` need."""
    gm.meta[ORIGINAL_META] = _Original(model, dict(concrete) if concrete else None)


def _original(gm: nn.Module) -> _Original | None:
    meta = getattr(gm, "meta", None)
    found = meta.get(ORIGINAL_META) if isinstance(meta, dict) else None
    return found if isinstance(found, _Original) and found.model is not None else None


# --- the tensors of a prepared module --------------------------------------------------------------
@dataclass
class _Slot:
    tensor: torch.Tensor
    names: list[str] = field(default_factory=list)  # state_dict names (persistent)
    paths: list[str] = field(default_factory=list)  # every path it is reachable under
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, buffer name) of the original
    in_gm: bool = False  # reachable from the prepared module (not only from the original)


def _modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    seen: set[int] = set()
    for name, module in root.named_modules(remove_duplicate=False):
        if id(module) not in seen:
            seen.add(id(module))
            yield name, module


def _tensors_of(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((k, t) for k, t in module._parameters.items() if t is not None)
    yield from ((k, t) for k, t in module._buffers.items() if t is not None)
    yield from ((k, t) for k, t in vars(module).items() if isinstance(t, torch.Tensor) and not k.startswith("__"))


def _slots(gm: nn.Module, original: nn.Module | None) -> dict[int, _Slot]:
    slots: dict[int, _Slot] = {}
    for name, tensor in gm.state_dict(keep_vars=True).items():
        slots.setdefault(id(tensor), _Slot(tensor)).names.append(name)
    for root in (gm, original) if original is not None else (gm,):
        for prefix, module in _modules(root):
            for key, tensor in _tensors_of(module):
                slot = slots.setdefault(id(tensor), _Slot(tensor))
                path = f"{prefix}.{key}" if prefix else key
                if path not in slot.paths:
                    slot.paths.append(path)
                if root is original and key in module._buffers:
                    slot.owners.append((module, key))
                slot.in_gm = slot.in_gm or root is gm
    return slots


# --- loading -----------------------------------------------------------------------------------------
def load_weights(gm: fx.GraphModule, source: Any, *, device: Any = None, dtype: torch.dtype | None = None,
                 device_map: Any = None, offload_dir: Any = None, max_memory: dict[Any, Any] | None = None
                 ) -> fx.GraphModule:
    """Materialise ``gm`` (typically prepared on ``meta``) from a checkpoint, in place.

    The model it was prepared from gets the same tensors; every problem is found before anything changes
    (docs/guides/big-models.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        source: A state_dict, a ``.safetensors`` file, or a directory of sharded safetensors with a Hugging Face index.
        device: Where the weights go (default: where ``gm``'s tensors are, ``cpu`` for ``meta``).
        dtype: Cast floating-point checkpoint tensors to it (the dtype ``gm`` was prepared in); default: another dtype is an error.
        device_map: Instead of ``device``: accelerate's ``{module name: device}`` (``"cpu"``, ``"disk"``, accelerators) or ``"auto"``.
        offload_dir: Where weights mapped to ``"disk"`` go when the checkpoint does not hold them as safetensors.
        max_memory: accelerate's ``{device: size}`` for ``device_map="auto"``.

    Returns:
        ``gm``.

    Raises:
        InvalidInput: An argument of the wrong kind (``gm``, ``dtype``, a device, the map, the source's path).
        WeightsError: Keys missing or unexpected, shapes or dtypes that differ, a tensor that could not be recomputed.
    """
    if not isinstance(gm, nn.Module):
        raise InvalidInput(f"load_weights takes the module prepare_model returned, not {type(gm).__name__}.")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"dtype must be a torch.dtype, not {dtype!r}.")
    if device_map is not None:
        if device is not None:
            raise InvalidInput("pass device or device_map, not both.")
        return _load_by_map(gm, source, device_map, dtype, offload_dir, max_memory)
    checkpoint = open_checkpoint(source)
    remembered = _original(gm)
    original = remembered.model if remembered is not None else None
    slots = _slots(gm, original)
    before = {t.device for s in slots.values() for t in (s.tensor,)}
    target = _device(device) if device is not None else _default_device(before)
    checkpoint, plan = _fitting(slots, checkpoint, source, original, dtype, target)
    roots = [gm] if original is None else [gm, original]
    recompute, new = _fill_missing(slots, plan, checkpoint, original, roots, target)
    loaded = 0
    for shard in checkpoint.shards(set(plan.first) | set(plan.duplicates)):
        fresh: dict[int, torch.Tensor] = {}
        for key, value in shard:
            slot = plan.slot_of[key]
            try:
                cast = value.to(device=target, dtype=plan.dtypes[key])
            except (RuntimeError, MemoryError) as err:  # the device ran out of memory
                raise WeightsError(f"cannot put {key!r} ({list(value.shape)}, {plan.dtypes[key]}) onto {target}: "
                                   f"{type(err).__name__}: {str(err)[:200]}. {loaded} tensor(s) were loaded; the "
                                   f"module now holds some new weights and some old ones: load again.") from err
            if key in plan.duplicates:
                plan.pending[key] = cast
                continue
            fresh[id(slot.tensor)] = _like(slot.tensor, cast)
            loaded += 1
        _replace(roots, fresh)
        new.update(fresh)
    _check_duplicates(plan, new)
    moved = _move_device_literals(gm, before, target)
    left = [s.paths[0] for s in recompute if id(s.tensor) not in new]
    done = [s.paths[0] for s in recompute if id(s.tensor) in new]
    _note(gm, f"weights loaded from {checkpoint.where}: {loaded} tensor(s) onto {target}"
              + (f", {len(done)} recomputed ({_list(done)})" if done else "")
              + (f"; left on meta in the original model only (the graph does not use them): {_list(left)}" if left else "")
              + (f", {moved} device literal(s) moved" if moved else "") + ".")
    return gm


def _fill_missing(slots: dict[int, _Slot], plan: _Plan, checkpoint: Checkpoint, original: nn.Module | None,
                  roots: list[nn.Module], device: torch.device) -> tuple[list[_Slot], dict[int, torch.Tensor]]:
    """The tensors on ``meta`` the checkpoint does not hold, recomputed by their module's own
    initialisation on ``device`` and put in place in ``roots`` (both :func:`load_weights` paths).
    Returns those slots and the new tensors by the old one's id; :class:`WeightsError` before any
    change when one the graph uses cannot be recomputed."""
    recompute = [s for s in slots.values() if id(s.tensor) not in plan.keys and s.tensor.is_meta]
    new = _recompute(recompute, original, device)
    failed = [s for s in recompute if id(s.tensor) not in new and s.in_gm]
    if failed:
        raise WeightsError(
            f"{len(failed)} tensor(s) hold no value and are not in {checkpoint.where}, and could not be recomputed by "
            f"their module's own initialisation: {_list(s.paths[0] for s in failed)}. Pass their values in the source "
            f"(a state_dict may hold non-persistent buffers too)."
        )
    _replace(roots, new)
    return recompute, new


def _device(device: Any) -> torch.device:
    """``device=`` as a torch.device this process can put tensors on: a misspelt name or a device
    torch has no driver for is an :class:`InvalidInput` here, before anything is read or changed."""
    try:
        target = torch.device(device)
        torch.empty(0, device=target)  # no memory: raises when the device is not usable here
    except (RuntimeError, TypeError, ValueError, AssertionError) as err:
        raise InvalidInput(f"device={str(device)[:80]!r} is not a device this process can use ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200] if str(err) else ''}).") from err
    return target


def _default_device(devices: set[torch.device]) -> torch.device:
    real = {d for d in devices if d.type != "meta"}
    return next(iter(real)) if len(real) == 1 else torch.device("cpu")


@dataclass
class _Plan:
    keys: set[int] = field(default_factory=set)  # ids of slots the checkpoint fills
    first: dict[str, _Slot] = field(default_factory=dict)  # key loaded for each slot
    duplicates: dict[str, str] = field(default_factory=dict)  # another key for a loaded slot -> the loaded key
    slot_of: dict[str, _Slot] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)


def _plan(slots: dict[int, _Slot], checkpoint: Checkpoint, dtype: torch.dtype | None) -> _Plan:
    plan = _Plan()
    by_name: dict[str, _Slot] = {}
    for each in slots.values():
        for name in dict.fromkeys(each.names + each.paths):
            by_name.setdefault(name, each)
    problems: list[str] = []
    unexpected = [k for k in checkpoint.specs if k not in by_name]
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) not in the prepared module: {_list(unexpected)}")
    for key, (shape, have) in checkpoint.specs.items():
        slot = by_name.get(key)
        if slot is None:
            continue
        plan.slot_of[key] = slot
        if id(slot.tensor) in plan.keys:
            plan.duplicates[key] = next(k for k, s in plan.first.items() if s is slot)
        else:
            plan.keys.add(id(slot.tensor))
            plan.first[key] = slot
        want = slot.tensor.dtype
        if tuple(slot.tensor.shape) != shape:
            problems.append(f"{key}: shape {list(shape)} in the checkpoint, {list(slot.tensor.shape)} in the module")
        elif have != want and not (dtype is not None and have.is_floating_point and want.is_floating_point):
            hint = f" (pass dtype={want} to cast)" if have.is_floating_point and want.is_floating_point else ""
            problems.append(f"{key}: dtype {have} in the checkpoint, {want} in the module{hint}")
        elif dtype is not None and want.is_floating_point and dtype != want:
            problems.append(f"{key}: dtype={dtype} asked for, but the graph was prepared with {want}: dtypes baked "
                            f"into it at capture would not follow; prepare the model in {dtype} instead")
        plan.dtypes[key] = want
    missing = [s.names[0] for s in slots.values() if s.names and id(s.tensor) not in plan.keys]
    if missing:
        problems.append(f"{len(missing)} missing key(s): {_list(missing)}")
    if problems:
        raise WeightsError(f"{checkpoint.where} does not fit the prepared module: " + "; ".join(problems) + ".")
    return plan


def _fitting(slots: dict[int, _Slot], checkpoint: Checkpoint, source: Any, original: nn.Module | None,
             dtype: torch.dtype | None, device: torch.device) -> tuple[Checkpoint, _Plan]:
    """``checkpoint`` and the plan for loading it; where its keys do not fit the module's names and
    it is a family's checkpoint in another layout (transformers' hub layout: experts one tensor each, a VLM's language
    model under its old prefix), the same checkpoint as the family converts it into the model's
    layout (:func:`fxprep.families.converted_checkpoint`, loaded onto ``device``). A mismatch that is not one
    of names (shapes, dtypes) is the error it was."""
    try:
        return checkpoint, _plan(slots, checkpoint, dtype)
    except WeightsError as err:
        names = {n for s in slots.values() for n in (*s.names, *s.paths)}
        if all(k in names for k in checkpoint.specs):
            raise
        other, why = families.converted_checkpoint(source, original, device, dtype)
        if other is None:
            if why:
                raise WeightsError(f"{err} {why}") from err
            raise
        return other, _plan(slots, other, dtype)


def _mark_tie(index: dict[str, Any], path: str, key: str) -> None:
    """A ``.dat`` written under ``path`` for the tensor loaded from ``key`` says so in its index entry:
    the modules' tensor objects stop showing a tie once accelerate's hooks replace them, and a weight
    written back (:mod:`fxprep.big.weight_store`) must reach every name of its tensor."""
    if path != key:
        index[path][weight_store.TIE] = key


def _check_duplicates(plan: _Plan, new: dict[int, torch.Tensor]) -> None:
    for key, value in plan.pending.items():
        loaded = new.get(id(plan.slot_of[key].tensor))
        if loaded is not None and not torch.equal(loaded.detach(), value):
            raise WeightsError(f"the checkpoint holds different values for '{plan.duplicates[key]}' and '{key}', "
                               f"which are one tensor in the model (tied); the first was loaded.")


def _like(old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(old, nn.Parameter):
        return nn.Parameter(value, requires_grad=old.requires_grad)
    return value


def _replace(roots: list[nn.Module], new: dict[int, torch.Tensor]) -> None:
    """Every occurrence of an old tensor object (by identity) becomes its new one."""
    if not new:
        return
    for root in roots:
        for _, module in _modules(root):
            for registry in (module._parameters, module._buffers):
                for key, t in registry.items():
                    if t is not None and id(t) in new:
                        registry[key] = new[id(t)]
            for key, t in list(vars(module).items()):
                if isinstance(t, torch.Tensor) and id(t) in new:
                    module.__dict__[key] = new[id(t)]
            if isinstance(module, BoundOp):
                module.args = _swap(module.args, new)
                module.kwargs = _swap(module.kwargs, new)


def _swap(value: Any, new: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return new.get(id(value), value)
    if type(value) in (tuple, list):
        return type(value)(_swap(v, new) for v in value)
    if type(value) is dict:
        return {k: _swap(v, new) for k, v in value.items()}
    return value


# --- tensors no checkpoint holds ---------------------------------------------------------------
def _recompute(slots: list[_Slot], original: nn.Module | None, device: torch.device) -> dict[int, torch.Tensor]:
    """New values for non-persistent buffers (and other tensors no checkpoint holds), each from its
    owning module's own initialisation; those it cannot give are left out."""
    by_owner: dict[int, tuple[nn.Module, list[tuple[str, _Slot]]]] = {}
    for slot in slots:
        for module, key in slot.owners:
            by_owner.setdefault(id(module), (module, []))[1].append((key, slot))
    out: dict[int, torch.Tensor] = {}
    for owner, pairs in by_owner.values():
        values = recompute.buffer_values(owner, [k for k, _ in pairs], original, device)
        for key, slot in pairs:
            value = values.get(key)
            if value is not None and tuple(value.shape) == tuple(slot.tensor.shape) and value.dtype == slot.tensor.dtype:
                out[id(slot.tensor)] = _like(slot.tensor, value)
    return out


# --- device literals, report, verification -----------------------------------------------------------
def _move_device_literals(gm: fx.GraphModule, before: set[torch.device], target: torch.device) -> int:
    """``torch.device`` literals naming the device the module was prepared on (``meta``) now name
    ``target``: in graph arguments and in the templates of op modules."""
    old = {d for d in before if d != target and d.type == "meta"}
    if not old:
        return 0
    count = 0

    def swap(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.device) and value in old:
            count += 1
            return target
        if type(value) in (tuple, list):
            return type(value)(swap(v) for v in value)
        if type(value) is dict:
            return {k: swap(v) for k, v in value.items()}
        return value

    changed = False
    for node in gm.graph.nodes:
        before_count = count
        args, kwargs = swap(tuple(node.args)), swap(dict(node.kwargs))
        if count != before_count:
            node.args, node.kwargs = args, kwargs
            changed = True
    for _, module in _modules(gm):
        if isinstance(module, BoundOp):
            module.args, module.kwargs = swap(module.args), swap(module.kwargs)
    if changed:
        gm.recompile()
    return count


def _note(gm: nn.Module, text: str) -> None:
    report = getattr(gm, "fxprep_report", None)
    if report is not None and hasattr(report, "note"):
        report.note(text)


def _list(names: Any, limit: int = 8) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def verify_prepared(gm: fx.GraphModule, example_inputs: Any, *, rtol: float | None = None,
                    atol: float | None = None) -> Any:
    """Compare ``gm`` with the model it was prepared from, typically after :func:`load_weights`.

    Args:
        gm: A module returned by :func:`fxprep.prepare_model` in this process.
        example_inputs: Real inputs, on the weights' device.
        rtol: Relative tolerance (default: by dtype, as ``prepare_model``'s).
        atol: Absolute tolerance (default: by dtype).

    Returns:
        The :class:`~fxprep.reporting.report.Verification`, also recorded in ``gm``'s report.

    Raises:
        InvalidInput: ``gm`` does not know its model (loaded from disk), no ``example_inputs``, or the model is still on ``meta``.
        ModelError: The model itself fails on ``example_inputs``.
        EquivalenceError: The two differ.
    """
    from ..core.runs import hooks_left_as_found
    from ..verify import verify

    remembered = _original(gm)
    if remembered is None or remembered.model is None:
        raise InvalidInput("this module does not know the model it was prepared from (it was loaded from disk, or "
                           "made elsewhere): compare it yourself, e.g. with torch.testing.assert_close.")
    example = normalize_example_inputs(example_inputs)
    if example is None:
        raise InvalidInput("verify_prepared needs example_inputs.")
    meta = [n for n, t in remembered.model.state_dict(keep_vars=True).items() if t.is_meta]
    if meta:
        raise InvalidInput(f"the original model still has tensors on 'meta' ({_list(meta, 4)}): load_weights first.")
    original_call, prepared_call = split_calls(remembered.model, example, remembered.concrete)
    # the user's model is run here as in prepare_model, inside its family's working_on (transformers:
    # the hooks it installs on a first call are installed once) and its hooks taken out after
    with hooks_left_as_found(remembered.model), families.family_for(remembered.model).working_on(remembered.model):
        result = verify(remembered.model, gm, original_call, prepared_example=prepared_call, rtol=rtol, atol=atol)
    report = getattr(gm, "fxprep_report", None)
    if report is not None:
        report.verification = result
    return result


# --- weights over devices, CPU and disk (fxprep.big.placement) -------------------------------------------
def _load_by_map(gm: fx.GraphModule, source: Any, device_map: Any, dtype: torch.dtype | None, offload_dir: Any,
                 max_memory: dict[Any, Any] | None) -> fx.GraphModule:
    """:func:`load_weights` with a device map: each tensor straight to its module's device; those
    mapped to ``disk`` are not loaded but named in accelerate's offload index (the checkpoint's own
    safetensors files, or written to ``offload_dir``), then accelerate's ``dispatch_model``."""
    import shutil
    import tempfile
    import weakref

    from accelerate.utils import offload_weight, save_offload_index

    from . import placement

    remembered = _original(gm)
    original = remembered.model if remembered is not None else None
    device_map = placement.resolve(gm, original if original is not None else gm, device_map, max_memory, dtype)
    main = torch.device(placement.main_device(device_map))
    checkpoint = open_checkpoint(source)
    slots = _slots(gm, original)
    checkpoint, plan = _fitting(slots, checkpoint, source, original, dtype, torch.device("cpu"))
    where = {key: placement.device_of(slot.paths + slot.names, device_map) for key, slot in plan.slot_of.items()}
    disk = {key for key, device in where.items() if device == "disk"}
    on_disk = "disk" in device_map.values()
    folder = str(offload_dir) if offload_dir is not None else None
    if folder is not None and on_disk:
        try:
            os.makedirs(folder, exist_ok=True)  # accelerate writes into it without making it
            weight_store.clear_folder(folder)  # what an earlier load (or its write-backs) left: replaced, not added to
        except OSError as err:
            raise InvalidInput(f"offload_dir={folder!r} cannot be made ({err}).") from err
    if folder is None and on_disk:
        # fxprep's own folder lives as long as the module whose hooks read it (weights written there
        # from a .bin checkpoint are as large as those weights): removed when the module is collected
        folder = tempfile.mkdtemp(prefix="fxprep-offload-")
        weakref.finalize(gm, shutil.rmtree, folder, True)
    roots = [gm] if original is None else [gm, original]
    _, new = _fill_missing(slots, plan, checkpoint, original, roots, main)
    index: dict[str, Any] = {}
    for shard_file, keys in checkpoint.files.items():
        for key in keys:
            if key in disk and shard_file.endswith(".safetensors"):
                entry = {"safetensors_file": shard_file, "weight_name": key,
                         "dtype": str(plan.dtypes[key]).removeprefix("torch.")}
                index.update({path: entry for path in plan.slot_of[key].paths + plan.slot_of[key].names})
    loaded = 0
    for shard in checkpoint.shards({k for k in plan.slot_of if k not in index}):
        fresh: dict[int, torch.Tensor] = {}
        for key, value in shard:
            slot = plan.slot_of[key]
            if key in disk:  # not a safetensors file: written out, once under each name a hook may ask for
                for path in dict.fromkeys(slot.paths + slot.names):
                    if path not in index:
                        offload_weight(value.to(dtype=plan.dtypes[key]), path, folder, index=index)
                        _mark_tie(index, path, key)
                continue
            cast = value.to(device=placement.torch_device(where[key]), dtype=plan.dtypes[key])
            if key in plan.duplicates:
                plan.pending[key] = cast
                continue
            fresh[id(slot.tensor)] = _like(slot.tensor, cast)
            loaded += 1
            for path in slot.paths:  # tied to a module the map puts on disk: its hook reads it from there too
                if path not in index and placement.device_of([path], device_map) == "disk":
                    offload_weight(cast.detach().cpu(), path, folder, index=index)
                    _mark_tie(index, path, key)
        _replace(roots, fresh)
        new.update(fresh)
    _check_duplicates(plan, new)
    if on_disk:
        save_offload_index(index, folder)
    _move_device_literals(gm, {s.tensor.device for s in slots.values()}, main)
    moves = placement.dispatch(gm, device_map, folder if on_disk else None, index if on_disk else None)
    _note(gm, f"weights loaded from {checkpoint.where} by a device map: {loaded} tensor(s) onto "
              f"{sorted({str(d) for d in device_map.values() if d != 'disk'})}"
              + (f", {len(disk)} left on disk (read when their module runs)" if disk else "")
              + (f", {moves} activation move(s) at device boundaries" if moves else "") + ".")
    return gm
