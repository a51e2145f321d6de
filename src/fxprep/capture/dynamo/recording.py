"""Opaque parts' eager side: patching a site's callable, and recording what each call returns.

An opaque part (:mod:`.opaque`) is one call in Dynamo's graph, so its outputs must be known without
tracing into it. :func:`record_sites` runs the model eagerly with every site wrapped
(:func:`patched`): each call's output is kept as its pytree structure with tensors described
(:class:`TensorMeta`: shape, dtype, device, strides) and other leaves kept as values. A second run on
perturbed inputs (floating-point inputs shuffled) tells which output sizes follow the data (boxes
kept by NMS) rather than the input shapes; it stops as soon as every site has been called as often
as in the first run. Arguments a graph cannot carry (:func:`graphable`) are kept aside and stand in
Dynamo's graph as a :data:`MARK` string.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...core.runs import SEED, preserved_state
from ..sites import FUNCTIONS, MISSING, Site, put_back

_CONSTANT_LEAVES = (type(None), bool, int, float, str, complex, torch.dtype, torch.device, torch.memory_format,
                    torch.layout, type(Ellipsis))


@dataclass(frozen=True)
class TensorMeta:
    """A tensor an opaque part returned in the eager run: enough to make a fake one like it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...] | None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        try:
            stride: tuple[int, ...] | None = tuple(t.stride())
        except Exception:  # noqa: BLE001 - sparse and other layouts have no strides
            stride = None
        return cls(tuple(t.shape), t.dtype, t.device, stride)


@dataclass
class Recorded:
    """One eager call of a site: input tensor shapes and the output, as structure plus leaves."""

    inputs: list[tuple[int, ...] | None]  # per flat (args, kwargs) leaf: a tensor's shape, else None
    spec: pytree.TreeSpec
    leaves: list[Any]  # TensorMeta for tensors, the value for anything else
    paths: list[tuple[Any, ...]]  # the pytree key path of each tensor leaf, in order
    inputs2: list[tuple[int, ...] | None] | None = None  # the same call in the perturbed run
    shapes2: list[tuple[int, ...]] | None = None  # its tensor outputs' shapes
    objects: dict[int | str, Any] = field(default_factory=dict)  # arguments a graph cannot carry

    @property
    def unsupported(self) -> list[str]:
        """Output leaves that are neither tensors nor plain constants (they cannot be rebuilt), and
        arguments a graph cannot carry that hold tensors (they would be the example's at run time)."""
        bad = [type(v).__name__ for v in self.leaves if not isinstance(v, (TensorMeta, *_CONSTANT_LEAVES))]
        for value in self.objects.values():
            if not isinstance(value, nn.Module) and any(isinstance(v, torch.Tensor) for v in _attributes(value)):
                bad.append(type(value).__name__)
        return bad


def _attributes(value: Any) -> list[Any]:
    try:
        return list(vars(value).values())
    except TypeError:
        return []


MARK = "fxprep-opaque-argument:"  # stands, in Dynamo's graph, for an argument a graph cannot carry


def graphable(value: Any) -> bool:
    """Whether Dynamo can put ``value`` in a graph node's arguments (run by Dynamo in the shim)."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device)):
        return True
    if type(value) in (list, tuple, torch.Size):
        return all(graphable(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and graphable(v) for k, v in value.items())
    return False


def is_mark(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(MARK)


def _describe_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, ...] | None]:
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves((args, kwargs))]


def _recorded(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Recorded:
    flat, spec = pytree.tree_flatten_with_path(out)
    leaves = [TensorMeta.of(v) if isinstance(v, torch.Tensor) else v for _, v in flat]
    paths = [tuple(p) for p, v in flat if isinstance(v, torch.Tensor)]
    named: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    objects = {k: v for k, v in named if not graphable(v)}
    return Recorded(_describe_inputs(args, kwargs), spec, leaves, paths, objects=objects)


def real_callable(site: Site, model: nn.Module) -> Any:
    """What runs for ``site`` without fxprep: an instance-level override first (a patched
    ``forward``), else the class's method bound to the owner, else the function."""
    if site.func is not None:
        return FUNCTIONS[site][0]
    owner = site.owner(model)
    own = owner.__dict__.get(site.method, MISSING) if hasattr(owner, "__dict__") else MISSING
    return own if own is not MISSING else getattr(owner, site.method)


@contextlib.contextmanager
def patched(model: nn.Module, replacements: dict[Site, Any], classes: bool = False) -> Iterator[None]:
    """Each site's callable replaced by the given one, put back on exit.

    With ``classes``, a module site gets its replacement ``forward`` from a subclass its object is
    switched to, not from its ``__dict__``: Dynamo takes a module whose instance has a ``forward``
    attribute for a monkey-patched one and treats it (and its attributes, e.g. ``.dtype``)
    differently from the unpatched model it must capture."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for site, new in replacements.items():
            if site.func is not None:
                for g in FUNCTIONS[site][1]:
                    undo.append((g, site.method, g.get(site.method, MISSING)))
                    g[site.method] = new
                continue
            owner = site.owner(model)
            if classes and site.is_module and "forward" not in owner.__dict__:
                cls = type(owner)
                swapped.append((owner, cls))
                owner.__class__ = _forward_subclass(cls, new)
                continue
            undo.append((owner.__dict__, site.method, owner.__dict__.get(site.method, MISSING)))
            owner.__dict__[site.method] = new
        yield
    finally:
        put_back(undo)
        for owner, cls in reversed(swapped):
            owner.__class__ = cls


ORIGINAL_CLASS = "__fxprep_original_class__"  # on the subclass a module site is switched to


def _forward_subclass(cls: type, shim: Any) -> type:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return shim(*args, **kwargs)

    namespace = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 ORIGINAL_CLASS: cls}
    return type(cls.__name__, (cls,), namespace)


def original_class(cls: Any) -> Any:
    """The user's class behind a class :func:`patched` switched a module to (else ``cls``)."""
    return cls.__dict__.get(ORIGINAL_CLASS, cls) if isinstance(cls, type) else cls


def perturbed(call: ExampleInputs, seed: int = 0) -> ExampleInputs:
    """``call`` with every floating-point tensor's values shuffled (same shape, dtype and value
    distribution, different data; ``seed`` picks the shuffle): a size an opaque part returns that
    changes with it follows the data, not the shapes."""
    gen = torch.Generator().manual_seed(SEED + seed)

    def shuffle(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.numel() < 2:
            return t.detach().clone()
        flat = t.detach().reshape(-1)
        return flat[torch.randperm(flat.numel(), generator=gen).to(flat.device)].reshape(t.shape).clone()

    args, kwargs = pytree.tree_map_only(torch.Tensor, shuffle, (call.args, call.kwargs))
    return ExampleInputs(tuple(args), dict(kwargs))


class _Enough(BaseException):
    """Stops the perturbed run once every site has been called as often as in the first run (not an
    Exception: model code that catches those must not swallow it)."""


def record_sites(model: nn.Module, call: ExampleInputs, sites: list[Site]) -> dict[Site, list[Recorded]]:
    """Run ``model`` eagerly with every site wrapped; each site's calls, in order. Sites whose calls
    an eager failure prevents from being recorded are left out.

    The perturbed run is made only where there is something to perturb (a floating-point input with
    values), and it stops as soon as each site has been called as often as in the first run:
    only those calls are compared, and the rest of the forward (a detector's mask head, after the
    proposals were filtered) would be run for nothing."""
    runs: list[dict[Site, list[Recorded]]] = []
    # the perturbed run only differs where a floating-point input holds values to shuffle: token ids
    # alone, or tensors on ``meta``, would repeat the first run exactly
    shuffled = any(t.is_floating_point() and t.numel() >= 2 and t.device.type != "meta"
                   for t in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor))
    for k, inputs in enumerate((call, perturbed(call)) if shuffled else (call,)):
        found: dict[Site, list[Recorded]] = {site: [] for site in sites}
        wanted = {site: len(calls) for site, calls in runs[0].items()} if runs else None

        def recorder(site: Site, real: Any, found: dict[Site, list[Recorded]] = found,
                     wanted: dict[Site, int] | None = wanted) -> Any:
            def recording(*args: Any, **kwargs: Any) -> Any:
                out = real(*args, **kwargs)
                found[site].append(_recorded(args, kwargs, out))
                if wanted is not None and all(len(found[s]) >= n for s, n in wanted.items()):
                    raise _Enough
                return out

            return recording

        wrappers = {site: recorder(site, real_callable(site, model)) for site in sites}
        fresh = inputs.fresh_copy()
        try:
            with patched(model, wrappers), preserved_state(model), torch.no_grad():
                torch.manual_seed(SEED)
                model(*fresh.args, **fresh.kwargs)
        except _Enough:
            pass
        except Exception:  # noqa: BLE001 - perturbed inputs a model refuses: one run only
            if k == 0:
                raise
            break
        runs.append(found)
    records = runs[0]
    if len(runs) == 2:
        for site, calls in records.items():
            for rec, rec2 in zip(calls, runs[1][site]):
                if rec2.spec == rec.spec:
                    rec.inputs2 = rec2.inputs
                    rec.shapes2 = [m.shape for m in rec2.leaves if isinstance(m, TensorMeta)]
    return records


__all__ = ["MARK", "ORIGINAL_CLASS", "Recorded", "TensorMeta", "graphable", "is_mark", "original_class", "patched",
           "perturbed", "real_callable", "record_sites"]
