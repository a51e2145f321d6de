"""The memory a loaded graph's forward takes, bounded op by op before each op runs.

The self-check's probe fits the load budget, but what the forward computes from it need not.
:class:`Bounded` runs the graph under a dispatch mode (:class:`_Budget`) that runs each aten op
first on fake copies of its inputs and refuses it, with :class:`ForwardTooLarge` naming its node,
when what is alive plus what it would make passes ``limit``. Tensor counts, splits, ``tolist`` and
data-dependent ops are bounded too (:func:`_pieces`, :func:`_data_bound`).

See docs/security.md ("Under the hood") for what is counted and what is not.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .. import ops
from . import pyvalues
from .format import LIMITS

aten = torch.ops.aten

# FakeTensorMode logs an op whose meta kernel raises (an op given the wrong shapes) as an error; the
# real op then raises itself, and the self-check records where.
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


# What one element of ``tolist``'s result takes: a float object and the list's pointer to it (31 bytes
# measured a float element, 24 an int; 2-core CPU, CPython 3.11).
LIST_ITEM_BYTES = 32


class ForwardTooLarge(Exception):
    """Running ``node`` would take the forward past ``limit``, in ``unit``: "bytes" alive, "tensors"
    alive, "flops" of one op; ``live`` what was alive before its op, ``need`` what the op makes (for
    an op counted after it ran, what it made)."""

    def __init__(self, node: str, live: int, need: int, limit: int, unit: str = "bytes"):
        super().__init__(f"node {node!r} would need {need:,} {unit} with {live:,} alive, more than {limit:,}")
        self.node, self.live, self.need, self.limit, self.unit = node, live, need, limit, unit

    @property
    def tensors(self) -> bool:
        return self.unit == "tensors"


class TooSlow(Exception):
    """The whole-load time limit passed while ``node`` was about to run (``LIMITS["load_seconds"]``)."""

    def __init__(self, node: str, seconds: float):
        super().__init__(f"past {seconds:g} s at node {node!r}")
        self.node, self.seconds = node, seconds


class PythonTooLarge(Exception):
    """Node ``node``'s Python call would build ``what`` (:mod:`.pyvalues`), past ``LIMITS[limit]``."""

    def __init__(self, node: str, what: str, limit: str):
        super().__init__(f"node {node!r} would build {what}")
        self.node, self.what, self.limit = node, what, limit


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of ``t``'s storage; None for a tensor without one (sparse, nested)."""
    try:
        storage = t.untyped_storage()
        return StorageWeakRef(storage).cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storages(tree: Any) -> dict[int, int]:
    """Storage key -> bytes, for the distinct storages of the tensors in ``tree``."""
    return {s[0]: s[1] for t in _tensors(tree) if (s := _storage(t)) is not None}


def _new_bytes(out: Any, inputs: Any) -> int:
    """Bytes of the distinct storages in ``out`` that none of ``inputs`` has (a view or an in-place
    result shares its input's storage: nothing new)."""
    old = _storages(inputs)
    return sum(size for key, size in _storages(out).items() if key not in old)


def _data_bound(func: Any, args: tuple, kwargs: dict) -> int:
    """An upper bound of the bytes an op whose output size depends on values makes (its fake run
    raised DynamicOutputShapeException). ``bincount`` makes max(input) + 1 counts, ``repeat_interleave``
    sum(repeats) indices: read from the real inputs. Every other such op selects from its inputs
    (``nonzero``, ``unique``, ``masked_select``, mask indexing): per result, at most one 8-byte value
    per element and dimension of its largest input."""
    if func.overloadpacket is aten.bincount:
        x, minlength = args[0], (args[2] if len(args) > 2 else kwargs.get("minlength", 0))
        return 8 * max(int(x.max()) + 1 if x.numel() else 0, int(minlength))
    if func is aten.repeat_interleave.Tensor:
        return 8 * max(int(args[0].sum()), 0)
    largest = max((t.numel() * max(t.dim(), 1) * max(t.element_size(), 8) for t in _tensors((args, kwargs))), default=0)
    return len(func._schema.returns) * largest


@functools.cache
def _is_view(func: Any) -> bool:
    """Whether an aten op returns a view of its first argument (its schema says so: ``Tensor(a)``)."""
    arguments = func._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and not alias.is_write


def _pieces(func: Any, args: tuple, kwargs: dict) -> int:
    """How many tensors an op that splits its input returns, from its arguments (before it runs: the
    fake run would make as many fake tensors); 1 for any other op (a list of sizes written in the
    graph is as long as the graph allows)."""
    if func.overloadpacket in (aten.unbind, aten.unbind_copy):
        x, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
        return int(x.shape[dim]) if x.dim() and -x.dim() <= dim < x.dim() else 1
    if func in (aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_copy.Tensor):
        x, size = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if not x.dim() or not -x.dim() <= dim < x.dim() or size <= 0:
            return 1
        return max(-(-int(x.shape[dim]) // int(size)), 1)
    return 1


@functools.cache
def _writes(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of the arguments an op's schema marks written (``Tensor(a!)``)."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes: ``self`` of an in-place op, ``out=`` arguments. Such an op can resize
    them (``resize_``, an ``out=`` of another shape), which makes storage no output shows."""
    found: list[torch.Tensor] = []
    for i, name, kwarg_only in _writes(func):
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        found += _tensors(value)
    return found


def _sizes(tensors: list[torch.Tensor]) -> list[tuple[int, int] | None]:
    return [_storage(t) for t in tensors]


def _growth(tensors: list[torch.Tensor], before: list[tuple[int, int] | None]) -> int:
    """Bytes the storages of ``tensors`` grew by since ``before`` (each storage once)."""
    grown: dict[int, int] = {}
    for t, old in zip(tensors, before):
        now = _storage(t)
        if now is not None and old is not None and now[1] > old[1]:
            grown[now[0]] = now[1] - old[1]
    return sum(grown.values())


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Multiply-adds x 2 of the ops whose cost is not their size (matmuls, convolutions, attention),
    from the shapes of their (fake) arguments and outputs; 0 for any other op, whose time follows the
    memory it touches (bounded by the forward budget)."""
    packet = func.overloadpacket
    name = packet.__name__
    try:
        if packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
            a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
            return 2 * _numel(a.shape) * int(b.shape[-1])
        if packet in (aten.convolution, aten._convolution):
            x, w = args[0], args[1]
            per = _numel(w.shape) // max(int(w.shape[0]), 1)
            return 2 * per * max(_numel(out.shape), _numel(x.shape) * int(w.shape[0]) // max(int(x.shape[1]), 1))
        if "scaled_dot_product" in name or name in ("_flash_attention_forward", "_efficient_attention_forward"):
            q, k = args[0], args[1]
            return 4 * _numel(q.shape[:-1]) * int(k.shape[-2]) * int(q.shape[-1])
    except (IndexError, AttributeError, TypeError, ValueError, RuntimeError):
        return 0
    return 0


# What an op makes and its flops follow from the op and its arguments' metadata alone (the fake run
# sees nothing else): kept per process by that metadata, so the repeated layers of a model, and the
# next load of it, are counted without running the op on fake tensors again.
_NEEDS: dict[Any, tuple[int, int]] = {}
_MAX_NEEDS = 20_000
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _op_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op and everything its fake run reads of its arguments: per tensor its shape, strides,
    offset, dtype, device, grad flag and storage (its size, and which argument's storage it shares);
    layout and conjugate/negative bits; plain values themselves; each argument's number of leaves. None where an argument is anything
    else (then the op is run on fake tensors, as always)."""
    storages: dict[int, int] = {}
    parts: list[Any] = [func, tuple(kwargs)]
    for value in (*args, *kwargs.values()):
        leaves = tree_leaves(value)
        parts.append(len(leaves))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.layout is not torch.strided:
                    return None  # a subclass or a sparse tensor: its metadata is not all here
                storage = leaf.untyped_storage()
                index = storages.setdefault(storage.data_ptr(), len(storages))
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.device,
                              leaf.requires_grad, leaf.layout, leaf.is_conj(), leaf.is_neg(), index, storage.nbytes()))
            elif type(leaf) in _PLAIN:
                parts.append((type(leaf), leaf))
            else:
                return None
    return tuple(parts)


class _Budget(TorchDispatchMode):
    """Refuses an op whose outputs would take what is alive past ``limit`` (see the module's
    docstring), and follows every storage an op makes until the last tensor holding it is garbage.
    ``held`` bytes are alive throughout (the probe); ``node`` is the graph node now running. At most
    ``max_tensors`` tensors made by ops are alive at once."""

    def __init__(self, limit: int, held: int, max_tensors: int, max_flops: int | None = None,
                 deadline: float | None = None) -> None:
        super().__init__()
        self.limit, self.held, self.max_tensors, self.max_flops = limit, held, max_tensors, max_flops
        self.deadline, self.seconds = deadline, 0.0
        self.node = ""
        self.live = 0
        self.tensors = 0
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._storages: dict[int, list[int]] = {}  # storage key -> [bytes, tensors holding it]

    def tick(self) -> None:
        """Stop between two ops once the whole-load time limit has passed."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TooSlow(self.node, self.seconds)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.tick()
        pieces = _pieces(func, args, kwargs)
        if self.tensors + pieces > self.max_tensors:
            raise ForwardTooLarge(self.node, self.tensors, pieces, self.max_tensors, "tensors")
        written = _written(func, args, kwargs)
        sizes = _sizes(written)
        need = self._need(func, args, kwargs)
        self.check(need)
        before = self.live
        out = func(*args, **kwargs)
        self._follow(out, args, kwargs)
        self._grown(written, sizes)
        if need is None and self.held + self.live > self.limit:
            raise ForwardTooLarge(self.node, self.held + before, self.live - before, self.limit)
        if self.tensors > self.max_tensors:  # pieces made op by op (tensor_split's slices)
            raise ForwardTooLarge(self.node, self.tensors - 1, 1, self.max_tensors, "tensors")
        return out

    def check(self, need: int | None) -> None:
        """Refuse ``need`` more bytes where they would take what is alive past the limit."""
        if need is not None and self.held + self.live + need > self.limit:
            raise ForwardTooLarge(self.node, self.held + self.live, need, self.limit)

    def _need(self, func: Any, args: tuple, kwargs: dict) -> int | None:
        """What ``func`` makes, from its run on fake copies of the inputs (a view: nothing); None where
        it has no fake kernel."""
        if _is_view(func):
            return 0
        key = _op_key(func, args, kwargs)
        known = _NEEDS.get(key) if key is not None else None
        if known is not None:
            need, flops = known
        else:
            try:
                with self.fake:
                    fake_args, fake_kwargs = tree_map(self._faked, (args, kwargs))
                    written = _written(func, fake_args, fake_kwargs)
                    before = _sizes(written)
                    out = func(*fake_args, **fake_kwargs)
                    need = _new_bytes(out, (fake_args, fake_kwargs)) + _growth(written, before)
            except DynamicOutputShapeException:
                return _data_bound(func, args, kwargs)
            except Exception:  # noqa: BLE001 - any op the fake run cannot follow: counted after it ran
                return None
            flops = _flops(func, fake_args, fake_kwargs, out)
            if key is not None:
                if len(_NEEDS) >= _MAX_NEEDS:
                    _NEEDS.clear()
                _NEEDS[key] = (need, flops)
        if self.max_flops is not None and flops > self.max_flops:
            raise ForwardTooLarge(self.node, 0, flops, self.max_flops, "flops")
        return need

    def _grown(self, written: list[torch.Tensor], sizes: list[tuple[int, int] | None]) -> None:
        """Storage an op grew in place (``resize_``, an ``out=`` argument): counted as alive, in the
        storage's own record where it is held, else for the rest of the run (the probe's or the
        module's own storage, which stays that large)."""
        for t, before in zip(written, sizes):
            now = _storage(t)
            if now is None or before is None or now[1] <= before[1]:
                continue
            held = self._storages.get(now[0])
            if held is not None:
                held[0] += now[1] - before[1]
            self.live += now[1] - before[1]

    def _faked(self, value: Any) -> Any:
        return self.fake.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def _follow(self, out: Any, args: tuple, kwargs: dict) -> None:
        """Hold each output tensor's storage: a new one adds its bytes; a view of one already held
        holds it longer; a view of an input the op was given (the probe, the module's state) is not
        counted; an in-place op's result, the input object itself, is not a new tensor."""
        inputs, objects = _storages((args, kwargs)), {id(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if id(t) in objects:
                continue
            s = _storage(t)
            key = None if s is None or (s[0] in inputs and s[0] not in self._storages) else s[0]
            if s is not None and key is not None:
                held = self._storages.get(key)
                if held is None:
                    held = self._storages[key] = [s[1], 0]
                    self.live += s[1]
                held[1] += 1
            self.tensors += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key: int | None) -> None:
        self.tensors -= 1
        if key is None:
            return
        held = self._storages[key]
        held[1] -= 1
        if held[1] == 0:
            self.live -= held[0]
            del self._storages[key]


class Bounded(fx.Interpreter):
    """fx's interpreter, refusing to run an op that would take the tensors alive past ``limit``
    bytes (see the module's docstring), an op past ``max_flops``, a Python call that would build a
    value past :mod:`.pyvalues`' limits, and stopping between two ops once ``deadline``
    (``time.monotonic()``) has passed. The module's own state is not counted. Nested graphs (a
    ``cond``'s branches) run in a child interpreter under the same budget."""

    def __init__(self, gm: fx.GraphModule, limit: int, max_tensors: int, max_flops: int | None = None,
                 deadline: float | None = None, seconds: float = 0.0):
        super().__init__(gm)
        self.limit, self.max_tensors, self.max_flops = limit, max_tensors, max_flops
        self.deadline, self.seconds = deadline, seconds
        self.budget: _Budget | None = None
        self.made = [0]  # Python items made by the graph's Python calls, shared with nested graphs

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.budget = _Budget(self.limit, sum(_storages((args, kwargs)).values()), self.max_tensors, self.max_flops,
                              self.deadline)
        self.budget.seconds = self.seconds
        level = _FAKE_LOG.level
        _FAKE_LOG.setLevel(logging.CRITICAL)
        nested = [m for m in self.module.modules() if m is not self.module and isinstance(m, fx.GraphModule)]
        for branch in nested:  # an instance attribute: nn.Module's call finds it before the class's forward
            branch.forward = functools.partial(self._nested, branch)
        try:
            with self.budget:
                return super().run(*args, **kwargs)
        finally:
            for branch in nested:
                branch.__dict__.pop("forward", None)
            self.budget = None
            _FAKE_LOG.setLevel(level)

    def _nested(self, branch: fx.GraphModule, *args: Any) -> Any:
        child = Bounded(branch, self.limit, self.max_tensors)
        child.budget, child.made = self.budget, self.made
        return fx.Interpreter.run(child, *args)

    def run_node(self, n: fx.Node) -> Any:
        if self.budget is not None:
            self.budget.node = n.name
            self.budget.tick()
            if (n.op, n.target) in (("call_method", "tolist"), ("call_function", torch.Tensor.tolist)) and n.args:
                x = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
                if isinstance(x, torch.Tensor):  # Python objects, made without an aten op
                    self.budget.check(x.numel() * LIST_ITEM_BYTES)
        return super().run_node(n)

    # --- the graph's own Python calls (io/pyvalues.py) --------------------------------------------
    def _python(self, fn: Any, args: tuple, kwargs: dict, call: Any) -> Any:
        node = self.budget.node if self.budget is not None else "?"
        try:
            pyvalues.check(fn, args, kwargs)
        except pyvalues.PythonValueTooLarge as err:
            raise PythonTooLarge(node, err.what, err.limit) from None
        out = call()
        self.made[0] += pyvalues.items(out)
        if self.made[0] > LIMITS["python_total"]:
            raise PythonTooLarge(node, f"Python values of {self.made[0]:,} items in all", "python_total")
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if not pyvalues.is_python(target):
            return super().call_function(target, args, kwargs)
        return self._python(target, args, kwargs, lambda: super(Bounded, self).call_function(target, args, kwargs))

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            return super().call_method(target, args, kwargs)
        return self._python(None, args, kwargs, lambda: super(Bounded, self).call_method(target, args, kwargs))

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        if not isinstance(module, ops.BoundOp) or not pyvalues.is_python(module.fn):
            return super().call_module(target, args, kwargs)
        filled = ops.filled(tuple(module.args), args), ops.filled(dict(module.kwargs), args)
        return self._python(module.fn, *filled, lambda: super(Bounded, self).call_module(target, args, kwargs))
