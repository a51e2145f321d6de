"""The regroup route's eager recording run: what each leaf call received and returned.

Dynamo inlines every module on the regroup route, so which graph values a leaf module was called
with, and which of its values leave it, must be learnt from the model itself: one eager run with
forward hooks on the leaves (:func:`record_calls`). It keeps no tensors, only what binding needs:
shapes, dtypes, identities (a tensor that is a model input, a parameter, or another leaf's output)
and a fingerprint of the values to tell same-shaped candidates apart (:class:`TensorSpec`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...core.runs import SEED, preserved_state
from .names import Names
from .opaque import running_opaque

_SAMPLES = 64  # values sampled per fingerprint, spread evenly over the tensor


@dataclass(frozen=True)
class TensorSpec:
    """What the regrouping keeps of a tensor seen in the eager run: its shape, dtype and a
    fingerprint of its values (their float64 sum and a few evenly spread elements).

    Why not the values: the only use of values is telling same-shaped candidates apart, and
    cloning the inputs and outputs of every recorded leaf call made RAM grow by a fifth of
    vit_b_16's parameter bytes. A fingerprint is a few numbers, taken when the hook runs (so a
    later in-place op cannot change it).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    total: float | None = None  # None: no values to compare (meta, sparse, ...)
    samples: tuple[Any, ...] = ()

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        shape, dtype = tuple(t.shape), t.dtype
        if t.is_meta or t.layout != torch.strided:
            return cls(shape, dtype)
        try:
            with torch.no_grad():
                v = torch.atleast_1d(torch.view_as_real(t.detach()) if t.is_complex() else t.detach())
                total = float(v.sum(dtype=torch.float64))
                picks = torch.linspace(0, v.numel() - 1, steps=min(v.numel(), _SAMPLES), device=v.device).long()
                samples = tuple(v[torch.unravel_index(picks, v.shape)].tolist())
        except Exception:  # noqa: BLE001 - a tensor subclass without these ops: shape and dtype only
            return cls(shape, dtype)
        return cls(shape, dtype, total, samples)

    def same_values(self, other: TensorSpec | None) -> bool:
        """Whether ``other`` holds the same values (sums may differ in the last bits when the two
        tensors were summed in a different order, e.g. one contiguous and one a view)."""
        return (
            other is not None and self.total is not None and other.total is not None
            and self.shape == other.shape and self.dtype == other.dtype and self.samples == other.samples
            and math.isclose(self.total, other.total, rel_tol=1e-9, abs_tol=1e-9)
        )


def specs_of(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, TensorSpec.of, tree)


@dataclass
class Call:
    module: nn.Module
    seq: int
    args: tuple[Any, ...]  # tensors are _TensorSpecs, everything else as passed
    kwargs: dict[str, Any]
    output: Any = None
    # identity facts, taken before anything could mutate or free the tensors
    arg_origin: list[tuple[str, Any]] = field(default_factory=list)  # per flat arg tensor leaf
    arg_ids: list[int] = field(default_factory=list)  # id() of each flat arg tensor leaf as passed
    output_is_arg: list[int | None] = field(default_factory=list)  # per flat output tensor leaf


def record_calls(
    model: nn.Module, leaves: dict[int, nn.Module], call: ExampleInputs, names: Names
) -> dict[int, list[Call]]:
    """Run ``model`` once with hooks on ``leaves``; the outermost leaf calls, in order, per module."""
    calls: dict[int, list[Call]] = {}
    active: list[Call] = []
    # id(tensor) -> (seq, flat output index). The tensors are not kept alive: an entry goes when
    # its tensor dies, so a new tensor reusing the id is not taken for it.
    produced: dict[int, tuple[int, int]] = {}
    counter = [0]
    fresh = call.fresh_copy()
    inputs = {id(t): i for i, t in enumerate(pytree.tree_leaves((fresh.args, fresh.kwargs))) if isinstance(t, torch.Tensor)}

    def origin(t: torch.Tensor) -> tuple[str, Any]:
        if id(t) in inputs:
            return ("input", inputs[id(t)])
        if id(t) in names.tensors:
            return ("tensor", names.tensors[id(t)][0])
        if id(t) in produced:
            return ("call", produced[id(t)])
        return ("other", None)

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if active or running_opaque():  # inside an opaque part: the graph does not have it
            active.append(None)  # type: ignore[arg-type]  # nested leaf call: not recorded
            return
        leaves_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        rec = Call(module, counter[0], *specs_of((tuple(args), dict(kwargs))))
        rec.arg_origin = [origin(t) for t in leaves_in]
        rec.arg_ids = [id(t) for t in leaves_in]
        counter[0] += 1
        calls.setdefault(id(module), []).append(rec)
        active.append(rec)

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        rec = active.pop()
        if rec is None or active:
            return
        out_leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        arg_ids = rec.arg_ids
        rec.output_is_arg = [arg_ids.index(id(t)) if id(t) in arg_ids else None for t in out_leaves]
        for i, t in enumerate(out_leaves):
            produced[id(t)] = (rec.seq, i)
            forget_when_dead(t, produced)
        rec.output = specs_of(output)

    handles = []
    try:
        for module in leaves.values():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            model(*fresh.args, **fresh.kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def forget_when_dead(t: torch.Tensor, table: dict[int, Any]) -> None:
    """Drop ``t``'s entry from ``table`` when ``t`` dies. Its id cannot be reused before then, so the
    entry found at that moment is ``t``'s own."""
    weakref.finalize(t, table.pop, id(t), None).atexit = False


class ValueRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]):
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.wanted and isinstance(result, torch.Tensor):
            self.values[n] = TensorSpec.of(result)
        return result


def record_values(gm: fx.GraphModule, model: nn.Module, call: ExampleInputs,
                   wanted: set[fx.Node]) -> dict[fx.Node, TensorSpec]:
    fresh = call.fresh_copy()
    flat = pytree.tree_leaves((fresh.args, fresh.kwargs))
    recorder = ValueRecorder(gm, wanted)
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            recorder.run(*flat)
    except Exception:  # noqa: BLE001 - values only break ties; shapes and identity still work
        return {}
    return recorder.values
