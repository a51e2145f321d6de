"""The memory a loaded graph's forward takes, bounded node by node before each node runs.

``load`` runs the loaded module once on a probe shaped like its example (:mod:`.selfcheck`). The probe
inputs fit the whole-load budget (:mod:`.budget`, counted from the declared shapes), but what the
forward computes from them does not follow from their size: an edited input guard can describe a
probe of 2**28 token ids for a model whose embedding makes 8 bytes x its width of each, and every
layer after it as much again. Counting that before the run would need each op's output size, which
is what running the graph on fake tensors gives (``torch._subclasses.FakeTensorMode``: shapes,
dtypes and devices, no data, nothing allocated).

So :class:`Bounded` runs the graph node by node, in lockstep: before a node runs for real, it runs on
fake copies of its real inputs (a module's own parameters and buffers made fake too, through
``torch.func.functional_call``, so that the fake run writes nothing into the real module), and a
dispatch mode (:class:`_Allocations`) follows every tensor the node's ops make, freed when Python
drops it, to the node's peak. When what is alive now plus that peak passes ``limit``, the node does
not run: :class:`ForwardTooLarge` names it. A node the fake run cannot follow (an op whose output
size depends on values, such as ``nonzero``) runs for real and is counted after it ran.

The fake run is a run of the node's code: a module's forward hooks see it too (with fake tensors),
and at ``save``, where the graph holds the user's own modules, their parameters are swapped for fake
ones for its length (``functional_call`` puts them back). Loaded modules have no hooks.

What is counted: every tensor alive between nodes (the probe included, for the whole run: its caller
holds it), not the module's own
parameters and buffers (a model's size is what its user loads anyway), and each node's peak of
tensors made inside it. Not counted: an op's scratch memory inside one kernel.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .regions import autocast_role

# FakeTensorMode logs an op whose meta kernel raises (a node given the wrong shapes) as an error; the
# real run then stops at that node and says so itself.
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class ForwardTooLarge(Exception):
    """Running ``node`` would take the forward past ``limit`` bytes (``live`` alive before it,
    ``need`` its own peak; ``need`` is what it made where it ran before it could be counted)."""

    def __init__(self, node: str, live: int, need: int, limit: int):
        super().__init__(f"node {node!r} would need {need:,} bytes with {live:,} alive, more than {limit:,}")
        self.node, self.live, self.need, self.limit = node, live, need, limit


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of ``t``'s storage; None for a tensor without one (sparse, nested)."""
    try:
        storage = t.untyped_storage()
        return StorageWeakRef(storage).cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Allocations(TorchDispatchMode):
    """The peak bytes of the storages that ops make while it is active, each freed when the last
    tensor that holds it is garbage (a view or an in-place result shares its input's storage and is
    not counted again)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage key -> [bytes, tensors holding it]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {s[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and (s := _storage(t))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None and s[0] not in inputs:
                self._hold(t, *s)
        return out

    def _hold(self, t: torch.Tensor, key: int, nbytes: int) -> None:
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [nbytes, 0]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        held[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        held = self._held[key]
        held[1] -= 1
        if held[1] == 0:
            self.live -= held[0]
            del self._held[key]


class Bounded(fx.Interpreter):
    """fx's interpreter, refusing to run a node that would take the live tensors past ``limit``
    bytes (see the module's docstring). The module's own state is not counted."""

    def __init__(self, gm: fx.GraphModule, limit: int):
        super().__init__(gm)
        self.limit = limit
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.state = {s[0] for t in (*gm.parameters(), *gm.buffers()) if (s := _storage(t)) is not None}
        self.inputs: tuple[Any, ...] = ()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.inputs = args  # the caller holds them for the whole run: alive throughout
        try:
            return super().run(*args, **kwargs)
        finally:
            self.inputs = ()

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        if n.op == "get_attr":  # the module's own state, whatever its kind
            value = super().run_node(n)
            self.state |= {s[0] for t in tree_leaves(value) if isinstance(t, torch.Tensor) and (s := _storage(t))}
            return value
        live = self._live()
        # an autocast enter or exit sets process state: run once only (its fake run would enter twice)
        need = None if autocast_role(n, self.module) is not None else self._fake_peak(n)
        if need is not None and live + need > self.limit:
            raise ForwardTooLarge(n.name, live, need, self.limit)
        value = super().run_node(n)
        if need is None and (after := self._live(value)) > self.limit:
            raise ForwardTooLarge(n.name, live, after - live, self.limit)
        return value

    def _live(self, extra: Any = None) -> int:
        """Bytes of the distinct storages alive in the environment (and in ``extra``), state excepted."""
        seen: dict[int, int] = {}
        for t in tree_leaves((list(self.env.values()), self.inputs, extra)):
            if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None and s[0] not in self.state:
                seen[s[0]] = s[1]
        return sum(seen.values())

    def _fake_peak(self, n: fx.Node) -> int | None:
        """The peak bytes node ``n`` makes, run on fake copies of its inputs; None where the fake run
        cannot follow it."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        counter = _Allocations()
        try:
            with _quiet(_FAKE_LOG), self.fake, torch.no_grad():
                args, kwargs = tree_map(self._faked, (args, kwargs))
                with counter:
                    if n.op == "call_module":
                        module = self.fetch_attr(str(n.target))
                        state = {name: self._faked(t) for name, t in
                                 (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))}
                        out = torch.func.functional_call(module, state, tuple(args), kwargs, strict=False)
                    else:
                        out = getattr(self, n.op)(n.target, args, kwargs)
                    del out
        except Exception:  # noqa: BLE001 - any op the fake run cannot follow: the real run is counted after
            return None
        return counter.peak

    def _faked(self, value: Any) -> Any:
        return self.fake.from_tensor(value) if isinstance(value, torch.Tensor) else value
