"""Block reuse's stand-ins: during the outer capture each reused block is one ``call_module``.

Dynamo calls a module whose class lives in ``torch.nn`` as one node and never traces into it
(:data:`STUB_MODULE`). For the length of the outer capture (:mod:`.reuse`), every reused instance
gets a subclass of its own class living there; Dynamo still needs each call's output as a fake
tensor, which the subclass computes by running the real ``forward`` on a fake copy of the first
instance called with each kind of input, and repeats for the others, so the cost of the outer
capture does not grow with depth. Under dynamic shapes that output is first guessed from a static
run and proven later by the block's own capture (:mod:`.tied`). Called on real tensors (the outer graph run for example values,
when a hooked layer's arguments are tied by value), a stand-in runs the block itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import guard_log, tied
from .blocks import freeze, shape_kind, size_key

STUB_MODULE = "torch.nn.fxprep_block"  # Dynamo calls a module whose class lives in torch.nn as one node


class Stubs:
    """For the length of the outer capture, every reused instance has a subclass of its own class
    that Dynamo calls as one ``call_module`` (see the module docstring), one subclass per block
    signature. The user's objects are untouched but for their ``__class__``, put back on exit."""

    def __init__(self, instances: dict[int, tuple[nn.Module, Any]], uncached: set[Any], *, guess: bool = False):
        self.instances = instances  # id -> (module, signature key)
        self.uncached = uncached  # signature keys whose fake outputs are computed for every call
        self.guesses = tied.Guesses(guess)  # symbolic outputs tied to an input by a static run, proven later
        self.originals: dict[int, type] = {}
        self.classes: dict[Any, type] = {}
        self.cache: dict[Any, Any] = {}
        self.unsupported: set[Any] = set()  # signature keys of blocks returning what one call cannot
        self.failed = False  # a block's fake run raised: the outer capture's failure may be the block's
        self.returned: dict[int, set[Any]] = {}  # id(instance) -> what its calls returned (output_signature)

    def __enter__(self) -> Stubs:
        try:
            for mid, (module, key) in self.instances.items():
                cls = type(module)
                if key not in self.classes:
                    self.classes[key] = self._stub(cls, key)
                module.__class__ = self.classes[key]
                self.originals[mid] = cls
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for mid, cls in self.originals.items():
            self.instances[mid][0].__class__ = cls
        self.originals.clear()

    def _stub(self, cls: type, key: Any) -> type:
        stubs = self

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return stubs.fake_call(module, args, kwargs)

        def deepcopy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
            return module  # Dynamo copies a called layer to fake tensors; forward above needs none

        def named_modules(module: nn.Module, memo: set[nn.Module] | None = None, prefix: str = "",
                          remove_duplicate: bool = True) -> Any:
            # The block alone: Dynamo walks the model's modules once per call it records and turns
            # every parameter it finds into a fake tensor; a block's inside is not its business here.
            if memo is None or module not in memo:
                if memo is not None and remove_duplicate:
                    memo.add(module)
                yield prefix, module

        return type(cls.__name__, (cls,), {"forward": forward, "__deepcopy__": deepcopy, "named_modules": named_modules,
                                           "_fxprep_key": key, "_fxprep_original": cls, "__module__": STUB_MODULE,
                                           "__qualname__": cls.__qualname__})

    def fake_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The output of ``module(*args, **kwargs)`` on Dynamo's fake tensors. What it was is kept:
        the block graph stamped at this call must return the same structure (the outer code may
        have branched on it, e.g. on an output being None)."""
        import torch._guards

        if torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs))) is None:
            return self._real_call(module, args, kwargs)  # not the outer capture's call: nothing recorded
        try:
            with guard_log.aside():  # its guards are the computation's, not the outer graph's
                out = self._fake_call(module, args, kwargs)
        except BaseException:
            self.failed = True  # Dynamo re-raises it as its own error, often with no trace of this frame
            raise
        self.returned.setdefault(id(module), set()).add(output_signature(out))
        return out

    @staticmethod
    def _real_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block itself, on real tensors: the outer graph run for example values (regroup ties
        a hooked layer's unread arguments by value)."""
        with _as_original(module):
            return module(*args, **kwargs)

    def _fake_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch._guards

        stub = type(module)
        flat, in_spec = pytree.tree_flatten((args, kwargs))
        fake_mode = torch._guards.detect_fake_mode(flat)
        key = (stub._fxprep_key, _fake_key(flat))  # type: ignore[attr-defined]
        uncached = stub._fxprep_key in self.uncached  # type: ignore[attr-defined]
        described = self.cache.get(key) if not uncached else None
        if described is None and not uncached:
            described = self.guesses.describe(key, lambda mode: _fake_copy(module, mode), flat, in_spec)
            if described is not None:
                self.cache[key] = described
        if described is not None:
            spec, leaves = described
            self.guesses.given(key, module, leaves)
            return pytree.tree_unflatten([_make(leaf, flat) for leaf in leaves], spec)
        copy = _fake_copy(module, fake_mode)
        shape_env = getattr(fake_mode, "shape_env", None)
        # A block that reads values from data (``.tolist()``, with real values propagated) makes
        # unbacked sizes of its own; they stay inside the block, whose own capture decides them.
        fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
        with fresh:
            out = copy(*args, **kwargs)
        if not _one_call_output(out):
            self.unsupported.add(stub._fxprep_key)  # type: ignore[attr-defined]
            raise Unsupported(f"{stub.__name__} returns {type(out).__name__}, which Dynamo cannot take from one call")
        described = _describe(out, flat)
        if described is not None:
            self.cache[key] = described
        return out

    def involved(self, err: BaseException) -> bool:
        """Whether the outer capture's failure ``err`` may come from a stand-in: a block's fake run
        raised, or Dynamo traced into a stand-in's code (a block class overriding ``__call__``,
        like transformers' ``GradientCheckpointingLayer``): a frame of this module is on the stack
        Dynamo reports, or in the traceback of ``err`` or of an exception it was raised from."""
        if self.failed or self.unsupported:
            return True
        seen: set[int] = set()
        cause: BaseException | None = err
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            files = [getattr(frame, "filename", "") for frame in getattr(cause, "real_stack", None) or []]
            tb = cause.__traceback__
            while tb is not None:
                files.append(tb.tb_frame.f_code.co_filename)
                tb = tb.tb_next
            if __file__ in files:
                return True
            cause = cause.__cause__ or cause.__context__
        return False


@contextlib.contextmanager
def _as_original(module: nn.Module) -> Any:
    """Within, a stand-in instance is of its own class again (its real ``forward``)."""
    stub = type(module)
    module.__class__ = stub._fxprep_original  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.__class__ = stub


def _fake_copy(module: nn.Module, fake_mode: Any) -> nn.Module:
    """A copy of a stand-in's block, of its own class, with fake tensors of ``fake_mode``."""
    from torch._dynamo.utils import deepcopy_to_fake_tensor

    with _as_original(module):
        return deepcopy_to_fake_tensor(module, fake_mode)


class OtherOutput(RuntimeError):
    """A block instance returns another structure than the first one of its kind did, whose output
    the outer capture repeated for it: the capture is retried computing every such output."""

    def __init__(self, message: str, key: Any):
        super().__init__(message)
        self.key = key


class Unsupported(RuntimeError):
    """A block's output is not something Dynamo accepts from a ``call_module`` (a dict, a
    ``ModelOutput``): the capture is retried with that block's children as the blocks."""


def output_signature(out: Any) -> Any:
    """The structure of a block's output, its tensors' shapes and dtypes, and its other values."""
    leaves, spec = pytree.tree_flatten(out)
    return (str(spec), tuple(("t", shape_kind(x.shape), x.dtype) if isinstance(x, torch.Tensor) else freeze(x)
                             for x in leaves))


def _one_call_output(out: Any) -> bool:
    """What Dynamo takes as the result of one ``call_module``: a tensor, or tuples / lists of
    tensors, ``None`` and numbers (measured on torch 2.14: dicts and ``ModelOutput`` are refused)."""
    if isinstance(out, torch.Tensor):
        return True
    if type(out) in (tuple, list):
        return all(x is None or isinstance(x, (bool, int, float)) or _one_call_output(x) for x in out)
    return False


def _fake_key(flat: list[Any]) -> Any:
    out = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            out.append((size_key(leaf.shape), size_key(leaf.stride()), leaf.dtype, leaf.device, leaf.requires_grad,
                        next(i for i, x in enumerate(flat) if x is leaf)))
        else:
            out.append(freeze(leaf))
    return tuple(out)


def _describe(out: Any, inputs: list[Any]) -> tuple[Any, list[Any]] | None:
    leaves, spec = pytree.tree_flatten(out)
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            alias = next((i for i, x in enumerate(inputs) if x is leaf), None)
            described.append(("in", alias) if alias is not None else
                             ("t", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, (type(None), bool, int, float, str)):
            described.append(("c", leaf))
        else:
            return None  # anything else is computed afresh for every instance
    return spec, described


def _make(leaf: Any, inputs: list[Any]) -> Any:
    if leaf[0] == "in":
        return inputs[leaf[1]]
    if leaf[0] == "c":
        return leaf[1]
    if leaf[0] == "tie":
        return tied.made(leaf, inputs)
    _, shape, stride, dtype, device, grad = leaf
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t.requires_grad_(grad) if grad else t
