"""Running the user's model without changing it, and seeing what a run would have changed.

Capture and verification run the user's own model, and each run must leave it exactly as it was.
:func:`preserved_state` snapshots what a forward can write and puts it back, saying what changed
(:class:`StateChanges`); runs use fresh input copies and the same RNG seed. :func:`observed_state`
is what verification compares after the original's and the prepared module's runs, so state updates
the graph does not make are found by name.

See docs/concepts/sharing.md ("Under the hood").
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .inputs import ExampleInputs

SEED = 20260611
_MISSING = object()
# Plain attribute values a forward keeps as state (counters, flags, running scalars).
_SCALARS = (bool, int, float, complex, str)


@dataclass
class StateChanges:
    """What one run changed on the modules (all restored): qualified names."""

    attributes: list[str] = field(default_factory=list)  # rebound, added or removed (registries included)
    buffers: list[str] = field(default_factory=list)  # values written in place (buffers, tensor attributes)
    containers: list[str] = field(default_factory=list)  # plain list/dict attributes changed in place

    def __bool__(self) -> bool:
        return bool(self.attributes or self.buffers or self.containers)

    def names(self) -> list[str]:
        return sorted(set(self.attributes) | set(self.buffers) | set(self.containers))


class ModelState:
    """A snapshot of everything a forward may write on ``modules`` (see the module docstring)."""

    def __init__(self, *modules: nn.Module):
        self.entries: list[tuple[str, nn.Module, dict[str, Any], tuple[dict[str, Any], ...]]] = []
        self.tensors: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.containers: list[tuple[str, Any, Any]] = []
        seen_modules: set[int] = set()
        seen_tensors: set[int] = set()
        for root in modules:
            for name, m in root.named_modules(remove_duplicate=False):
                if id(m) in seen_modules:
                    continue
                seen_modules.add(id(m))
                prefix = f"{name}." if name else ""
                if isinstance(m, torch.jit.ScriptModule):  # Python code cannot rebind its attributes
                    self._tensors(prefix, m.named_buffers(recurse=False), seen_tensors)
                    continue
                attrs = dict(m.__dict__)
                self.entries.append((prefix, m, attrs, (dict(m._parameters), dict(m._buffers), dict(m._modules))))
                if m._buffers:
                    self._tensors(prefix, m._buffers.items(), seen_tensors)
                for key, value in attrs.items():  # one pass: tensor attributes and plain containers
                    kind = type(value)
                    if kind is torch.Tensor:
                        self._tensors(prefix, ((key, value),), seen_tensors)
                    elif kind is list:
                        self.containers.append((prefix + key, value, list(value)))
                    elif kind is dict and not key.startswith("_"):
                        self.containers.append((prefix + key, value, dict(value)))

    def _tensors(self, prefix: str, items: Any, seen: set[int]) -> None:
        for key, t in items:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            # a meta tensor holds no values: an alias keeps its shape (cloning one costs ~50 us)
            self.tensors.append((prefix + key, t, t.detach() if t.is_meta else t.detach().clone()))

    def restore(self) -> StateChanges:
        """Put everything back; returns what had changed."""
        changes = StateChanges()
        for prefix, m, attrs, registries in self.entries:
            for registry, before in zip((m._parameters, m._buffers, m._modules), registries):
                if not _unchanged(registry, before):
                    changes.attributes += [prefix + k for k in set(registry) | set(before)
                                           if registry.get(k, _MISSING) is not before.get(k, _MISSING)]
                    registry.clear()
                    registry.update(before)
            now = m.__dict__
            if _unchanged(now, attrs):
                continue
            for key in [k for k in now if k not in attrs]:
                del now[key]
                changes.attributes.append(prefix + key)
            for key, value in attrs.items():
                if now.get(key, _MISSING) is not value:
                    now[key] = value
                    changes.attributes.append(prefix + key)
        with torch.no_grad():
            for name, t, value in self.tensors:
                # every value is compared and copied back: kernels such as batch_norm update
                # running statistics in place without bumping the tensor's version counter
                if t.shape != value.shape or t.dtype != value.dtype:
                    t.set_(value)  # resized in place (``self.buf.resize_(...)``)
                    changes.buffers.append(name)
                    continue
                if t.device.type == "meta":
                    continue
                if not _same(t, value):
                    changes.buffers.append(name)
                t.copy_(value)
        for name, container, before in self.containers:
            if _container_changed(container, before):
                changes.containers.append(name)
                if type(container) is list:
                    container[:] = before
                else:
                    container.clear()
                    container.update(before)
        changes.attributes = sorted(set(changes.attributes))
        return changes


def _unchanged(now: dict[str, Any], before: dict[str, Any]) -> bool:
    """Same keys in the same order, each bound to the same object (the common case, checked in C)."""
    return len(now) == len(before) and all(map(operator.is_, now.values(), before.values())) and list(now) == list(before)


def _container_changed(now: Any, before: Any) -> bool:
    """By identity: ``==`` on a list of tensors compares them element-wise."""
    if len(now) != len(before):
        return True
    if type(now) is list:
        return any(a is not b for a, b in zip(now, before))
    return now.keys() != before.keys() or any(now[k] is not v for k, v in before.items())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(a, b)) or bool(torch.isnan(a).all() and torch.isnan(b).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@contextlib.contextmanager
def preserved_state(*modules: nn.Module, changes: StateChanges | None = None) -> Iterator[ModelState]:
    """Restore everything a forward may write on ``modules`` (and the RNG) on exit: running a model
    must not change it. What had changed is added to ``changes`` when one is given."""
    state = ModelState(*modules)
    with torch.random.fork_rng(devices=[]):
        try:
            yield state
        finally:
            found = state.restore()
            if changes is not None:
                changes.attributes += found.attributes
                changes.buffers += found.buffers
                changes.containers += found.containers


def observed_state(model: nn.Module) -> dict[str, Any]:
    """What a run leaves behind on ``model``, by qualified name: buffer values (copies) and plain
    scalar attributes (counters, flags). Compared between a run of the original and one of the
    prepared module (which shares the user's buffer objects, so in-graph updates show here)."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, buf in m._buffers.items():
            if buf is not None:
                out[prefix + key] = buf.detach().clone()
        if isinstance(m, torch.jit.ScriptModule):
            continue
        for key, value in m.__dict__.items():
            if not key.startswith("_") and type(value) in _SCALARS and key != "training":
                out[prefix + key] = value
    return out


def state_differences(before: dict[str, Any], after: dict[str, Any], rtol: float, atol: float) -> list[str]:
    """Names whose values differ between two :func:`observed_state` results."""
    differ = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name, _MISSING), after.get(name, _MISSING)
        if a is _MISSING or b is _MISSING:
            differ.append(name)
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.device.type == "meta" or b.device.type == "meta":
                if a.shape != b.shape or a.dtype != b.dtype:
                    differ.append(name)
            elif a.shape != b.shape or a.dtype != b.dtype or not _close(a, b, rtol, atol):
                differ.append(name)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            differ.append(name)
        elif a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            differ.append(name)
    return differ


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    return bool(torch.equal(a, b))


def run_model(model: nn.Module, example: ExampleInputs, *, grad: bool = False, what: str = "the model") -> Any:
    """Run ``model`` on a fresh copy of ``example`` with the fixed seed."""
    fresh = example.fresh_copy()
    torch.manual_seed(SEED)
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx:
        return model(*fresh.args, **fresh.kwargs)


FX_ERROR_PREFIX = "Call using an FX-traced Module"


class _WithoutFxErrorPrint:
    """``sys.stderr`` minus what fx prints, in one thread, when a GraphModule's forward raises.

    Why: a GraphModule prints "Call using an FX-traced Module, line N of the traced Module's
    generated forward function: ..." to stderr before re-raising any error of its forward. Where
    fxprep runs a prepared module expecting it may fail (the batch probe at another batch size, on a
    graph Dynamo specialised to the example's), that text is a scary traceback in the middle of a
    successful prepare: the failure is already said in the report. Other threads' writes, and every
    other write of this one, pass through."""

    def __init__(self, stream: Any, thread: int):
        self._stream = stream
        self._thread = thread
        self._dropping = False

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            if FX_ERROR_PREFIX in text:  # one write: the traceback, this line, the code around it
                self._dropping = True
                return len(text)
            if self._dropping and text == "\n":  # print()'s end after the message
                self._dropping = False
                return len(text)
            self._dropping = False
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_fx_errors() -> Iterator[None]:
    """Within: fx's error print for a failing GraphModule forward is dropped in this thread (see
    :class:`_WithoutFxErrorPrint`); the error itself is raised as before."""
    before = sys.stderr
    sys.stderr = _WithoutFxErrorPrint(before, threading.get_ident())
    try:
        yield
    finally:
        if isinstance(sys.stderr, _WithoutFxErrorPrint) and sys.stderr._stream is before:
            sys.stderr = before


# A module's forward-side hook dicts (the ``*_with_kwargs`` / ``*_always_called`` ones are keyed by the
# same handles as the first two and say how each runs), then every other hook dict ``nn.Module`` keeps.
FORWARD_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
_HOOK_DICTS = (*FORWARD_HOOK_DICTS, "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@contextlib.contextmanager
def hooks_left_as_found(model: nn.Module) -> Iterator[None]:
    """Within, hooks a forward registers on ``model``'s modules stay (the capture must see them);
    on exit every hook registered since entry is removed.

    Why: :func:`preserved_state` puts back what a forward writes in a module's attributes, but a
    hook lives in a dict the module keeps: transformers 5 registers its output-capturing hooks on the
    first call and sets a flag, and after fxprep's reference run the flag was gone and the hooks were
    not, so the user's next call registered them a second time."""
    if not isinstance(model, nn.Module):
        yield
        return
    before = {id(m): {d: set(hooks) for d in _HOOK_DICTS if (hooks := getattr(m, d, None))} for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            known = before.get(id(m), {})
            for d in _HOOK_DICTS:
                hooks = getattr(m, d, None)
                if isinstance(hooks, dict) and hooks:
                    had = known.get(d, ())
                    for key in [k for k in hooks if k not in had]:
                        del hooks[key]
