"""Values baked into the graph: what a forward reads that is not an input, a parameter or a buffer,
checked at each call, or named in the report as assumed.

Both tracers turn Python values a forward reads from module attributes or globals into constants of
the graph. :func:`record_baked` records them for every module whose forward was traced into (scalars
and immutable values by identity and equality, data structures as snapshots, up to :data:`MAX_DEPTH`
and :data:`MAX_LEAVES`), and a change raises :class:`~fxprep.errors.InputMismatch` naming it. A copy
of the prepared module checks nothing.

See docs/baked-values.md for what is and is not recorded.
"""

from __future__ import annotations

import enum
import functools
import reprlib
import sys
import types
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import InputMismatch

SCALARS = (bool, int, float, str)
MAX_LEAVES = 4000  # parts of one recorded value (a transformers config: ~150)
MAX_DEPTH = 8
_GONE = object()
# nn.Module's own fields, and transformers' bookkeeping that no forward reads (set by loading code)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_is_hf_initialized", "name_or_path"}
# values compared as they are: immutable, hashable, cheap to compare
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
              torch.memory_format, torch.layout, enum.Enum, range, slice)
# code and namespaces: the graph's code, not values it holds
_CODE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, functools.partial,
         staticmethod, classmethod, property)
# runtime objects that are no setting: a logger's level, a lock's state
_RUNTIME_MODULES = ("logging", "threading", "_thread", "io", "_io", "multiprocessing", "concurrent", "asyncio",
                    "weakref", "queue", "socket", "subprocess", "tempfile", "contextvars", "_contextvars")

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 50, 50, 6, 4, 3


class _TooLarge(Exception):
    """A value of more than :data:`MAX_LEAVES` parts, or nested deeper than :data:`MAX_DEPTH`."""


def _immutable(value: Any) -> bool:
    if isinstance(value, _IMMUTABLE):
        return True
    return type(value) in (tuple, frozenset) and len(value) <= 64 and all(_immutable(v) for v in value)


def _runtime(value: Any) -> bool:
    module = type(value).__module__ or ""
    return module.split(".")[0] in _RUNTIME_MODULES


def _is_data_object(value: Any) -> bool:
    """An instance whose state is its ``__dict__`` (a dataclass, a namespace, a config object)."""
    return (isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, (_CODE, nn.Module, torch.Tensor))
            and not _runtime(value) and not callable(value))


# --- snapshots ----------------------------------------------------------------------------------------
# node forms: (_VALUE, value) | (_IDENTITY, reference) | (_SEQ, type, children) | (_MAP, type, keys, children)
#             | (_OBJECT, type, keys, children, number of dunder keys) | (_SET, type, frozenset)
_VALUE, _IDENTITY, _SEQ, _MAP, _OBJECT, _SET = range(6)


class _Strong:
    """A reference held as is, for an object that has no weak references (kept alive: a small price)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def _reference(value: Any) -> Any:
    try:
        return weakref.ref(value)
    except TypeError:
        return _Strong(value)


def _snapshot(value: Any, depth: int, budget: list[int]) -> tuple[Any, ...]:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise _TooLarge
    if _immutable(value):
        return (_VALUE, value)
    kind = type(value)
    if kind in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return (_SEQ, kind, tuple(_snapshot(v, depth + 1, budget) for v in value))
    if isinstance(value, dict) and all(_immutable(k) for k in dict.keys(value)):  # dict's own methods: a
        # subclass may override them (transformers' registries)
        return (_MAP, kind, tuple(dict.keys(value)), tuple(_snapshot(v, depth + 1, budget) for v in dict.values(value)))
    if kind in (set, frozenset) and all(_immutable(v) for v in value):
        budget[0] -= len(value)
        return (_SET, kind, frozenset(value))
    if _is_data_object(value):
        everything = vars(value)
        state = {k: v for k, v in everything.items() if not k.startswith("__")}
        return (_OBJECT, kind, tuple(state), tuple(_snapshot(v, depth + 1, budget) for v in state.values()),
                len(everything) - len(state))
    return (_IDENTITY, _reference(value))  # a tensor, module, function or other object in the data


def _same(node: tuple[Any, ...], now: Any) -> bool:
    form = node[0]
    if form == _VALUE:
        value = node[1]
        return now is value or (type(now) is type(value) and now == value)
    if form == _IDENTITY:
        return node[1]() is now
    if type(now) is not node[1]:
        return False
    if form == _SEQ:
        children = node[2]
        if len(now) != len(children):
            return False
        for child, item in zip(children, now):
            if child[0] == _VALUE and item is child[1]:
                continue
            if not _same(child, item):
                return False
        return True
    if form == _MAP or form == _OBJECT:
        state = now if form == _MAP else getattr(now, "__dict__", None)
        keys, children = node[2], node[3]
        if not isinstance(state, dict) or dict.__len__(state) != len(keys) + (node[4] if form == _OBJECT else 0):
            return False
        for key, child in zip(keys, children):
            item = dict.get(state, key, _GONE)
            if child[0] == _VALUE and item is child[1]:
                continue
            if not _same(child, item):
                return False
        return True
    return now == node[2]  # _SET


# --- what a forward reads -----------------------------------------------------------------------------
class _Reads:
    """What the code a module class runs in its forward reads and writes (:func:`_class_code`)."""

    __slots__ = ("stores", "attrs", "loads")

    def __init__(self) -> None:
        self.stores: set[str] = set()  # attributes it assigns (``self.x = ...``): state a run updates
        self.attrs: set[str] = set()  # attribute names it reads (``self.scale``, ``cfg.width``)
        self.loads: dict[int, tuple[dict[str, Any], set[str]]] = {}  # per globals dict, the names it loads


_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_MAX_FUNCTIONS = 400  # per class: the forward's helpers, transitively (a transformers layer: ~30)


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    """``code`` and the code objects nested in it (comprehensions, lambdas, inner functions)."""
    stack = [code]
    while stack:
        c = stack.pop()
        yield c
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def _user_module(module: types.ModuleType) -> bool:
    """A module of the user's own (a ``config.py`` beside the model), not the standard library's or an
    installed package's: its data attributes are settings a forward may read (``config.WIDTH``)."""
    top = module.__name__.split(".")[0]
    path = str(getattr(module, "__file__", None) or "")
    return (bool(path) and top not in sys.stdlib_module_names and top not in ("torch", "fxprep")
            and "site-packages" not in path and "dist-packages" not in path)


def _own(fn: Any) -> bool:
    """A Python function whose code fxprep may read for what a forward reads (not torch's own helpers)."""
    return isinstance(fn, types.FunctionType) and not str(fn.__module__).startswith("torch.")


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


@functools.cache
def _class_code(cls: type) -> _Reads:
    """What a module class's forward (and every method, property and global helper function it
    calls, transitively) reads and writes, from the bytecode: attribute names it reads and assigns,
    and per globals dict the global names it loads. nn.Module's own methods are not read."""
    import dis

    methods: dict[str, list[Any]] = {}
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for name, member in vars(klass).items():
            fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if isinstance(fn, types.FunctionType):
                methods.setdefault(name, []).append(fn)
    reads = _Reads()
    todo = [fn for name, fns in methods.items() if "forward" in name for fn in fns]
    done: set[int] = set()
    while todo and len(done) < _MAX_FUNCTIONS:
        fn = todo.pop()
        if id(fn) in done:
            continue
        done.add(id(fn))
        # a decorated forward (transformers' ``@can_return_tuple``): the function it wraps, and the
        # functions its closure holds, run too
        todo.extend(f for f in (getattr(fn, "__wrapped__", None), *(_cell(c) for c in fn.__closure__ or ()))
                    if isinstance(f, types.FunctionType))
        names = reads.loads.setdefault(id(fn.__globals__), (fn.__globals__, set()))[1]
        for code in _codes(fn.__code__):
            for ins in dis.get_instructions(code):
                op, arg = ins.opname, ins.argval
                if op in _ATTR_LOADS and isinstance(arg, str):
                    reads.attrs.add(arg)
                    todo.extend(methods.get(arg, ()))
                elif op == "LOAD_CONST" and isinstance(arg, str) and arg.isidentifier():
                    reads.attrs.add(arg)  # getattr(self, "name"), setattr's names: read by name too
                elif op == "STORE_ATTR":
                    reads.stores.add(str(arg))
                elif op == "LOAD_GLOBAL" and isinstance(arg, str):
                    names.add(arg)
                    value = fn.__globals__.get(arg)
                    if _own(value):
                        todo.append(value)
    return reads


class BakedValues:
    """What :func:`record_baked` found: ``entries`` (owner ``dict``, key, value at capture, label, its
    snapshot or None for an immutable value) and ``unchecked`` (label, value shown) of what is too
    large or not plain data to check (the report names them as assumed). Checked by
    :func:`check_baked` at each call of the prepared module. A copy (deepcopy, pickle, save) checks
    nothing: it no longer shares the modules whose attributes were read."""

    __slots__ = ("entries", "unchecked")

    def __init__(self, entries: list[tuple[dict[str, Any], str, Any, str, tuple[Any, ...] | None]],
                 unchecked: list[tuple[str, str]] | None = None):
        self.entries, self.unchecked = entries, unchecked or []

    def __len__(self) -> int:
        return len(self.entries) + len(self.unchecked)

    def __deepcopy__(self, memo: dict[int, Any]) -> BakedValues:
        return BakedValues([])

    def __reduce__(self) -> tuple[Any, ...]:
        return (BakedValues, ([],))

    def names(self) -> list[str]:
        """The checked values' names."""
        return list(dict.fromkeys(label for _, _, _, label, _ in self.entries))

    def assumed(self) -> list[str]:
        """What the graph may hold that is not checked at each call, with its value at capture."""
        return [f"{label} = {shown}" for label, shown in self.unchecked]


def _whole_calls(gm: nn.Module) -> set[int]:
    """ids of the modules ``gm`` calls whole (and of everything inside them, and opaque parts' owners)."""
    import torch.fx as fx

    whole: set[int] = set()
    for node in getattr(gm, "graph", fx.Graph()).nodes:
        if node.op != "call_module":
            continue
        try:
            called = gm.get_submodule(node.target)
        except AttributeError:
            continue
        for m in called.modules():
            whole.add(id(m))
            owner = m.__dict__.get("owner")
            if isinstance(owner, nn.Module):
                whole.update(id(o) for o in owner.modules())
    return whole


class _Recorder:
    def __init__(self, changed: Iterable[str]):
        self.entries: list[tuple[dict[str, Any], str, Any, str, tuple[Any, ...] | None]] = []
        self.unchecked: list[tuple[str, str]] = []
        self.snapshots: dict[int, tuple[Any, ...] | None] = {}  # id(value) -> its snapshot (None: not checkable)
        self.changed = frozenset(changed)

    def add(self, owner: dict[str, Any], key: str, value: Any, label: str) -> None:
        if isinstance(value, (torch.Tensor, nn.Module, _CODE)) or callable(value) or _runtime(value):
            return
        if _immutable(value):
            self.entries.append((owner, key, value, label, None))
            return
        if id(value) not in self.snapshots:  # a config object many modules hold: one snapshot
            # A container of tensors is a cache the model fills and clears (LeViT's attention-bias
            # cache): the graph computes what it reads or follows the tensors by identity, so it is
            # named as assumed, not checked (a check would refuse every call after the cache moved).
            held = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            tensors = any(isinstance(v, torch.Tensor) for v in held)
            self.snapshots[id(value)] = node = None if tensors else self._snapshot(value)
            if node is None:
                self.unchecked.append((label, _shown(value)))
        node = self.snapshots[id(value)]
        if node is not None:
            self.entries.append((owner, key, value, label, node))

    @staticmethod
    def _snapshot(value: Any) -> tuple[Any, ...] | None:
        """``value``'s snapshot, or None for what cannot be checked: not plain data (no ``__dict__``:
        slots, a C type), too large, or not equal to itself (NaN inside, an odd ``__eq__``)."""
        if not (isinstance(value, (list, tuple, dict, set, frozenset)) or _is_data_object(value)):
            return None
        try:
            node = _snapshot(value, 0, [MAX_LEAVES])
            return node if _same(node, value) else None
        except Exception:  # noqa: BLE001 - too large, or state that cannot be read as data
            return None


def _shown(value: Any) -> str:
    try:
        return _SHOW.repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails: its type
        return f"<{type(value).__qualname__}>"


def record_baked(gm: nn.Module, model: nn.Module, changed: Iterable[str] = ()) -> BakedValues:
    """The values of every module of ``model`` whose forward was traced into (see the module
    docstring) that some traced forward reads by name, and the globals those forwards (and their
    helpers) load. ``changed``: qualified names of the attributes and containers a run of the
    model's forward changed (state, not settings: not recorded)."""
    whole = _whole_calls(gm)
    traced = [(path, module) for path, module in model.named_modules(remove_duplicate=True) if id(module) not in whole]
    codes: dict[type, _Reads] = {}
    for _, module in traced:
        try:
            codes.setdefault(type(module), _class_code(type(module)))  # type: ignore[arg-type]
        except TypeError:  # an unhashable class (never seen): nothing read
            continue
    read = set().union(*(c.attrs for c in codes.values())) if codes else set()
    recorder = _Recorder(changed)
    for path, module in traced:
        code = codes.get(type(module))
        if code is None:
            continue
        label = f"model.{path}" if path else "model"
        prefix = f"{path}." if path else ""
        for key, value in list(module.__dict__.items()):
            if key not in read or key == "training" or key in _MODULE_INTERNALS or key in code.stores \
                    or key.startswith("__") or prefix + key in recorder.changed:
                continue
            recorder.add(module.__dict__, key, value, f"{label}.{key}")
    seen_globals: set[tuple[int, str]] = set()
    for code in codes.values():
        for namespace, global_names in code.loads.values():
            for name in sorted(global_names):
                value = namespace.get(name, _GONE)
                if value is _GONE or name.startswith("__") or (id(namespace), name) in seen_globals:
                    continue
                seen_globals.add((id(namespace), name))
                if name.startswith("_") and not _immutable(value):
                    continue  # a library's private state (a registry filled as models are built), not a setting
                if isinstance(value, types.ModuleType) and _user_module(value):  # ``import config``: config.WIDTH
                    for attr in sorted(read & set(vars(value))):
                        if not attr.startswith("_"):
                            recorder.add(vars(value), attr, vars(value)[attr], f"global {value.__name__}.{attr}")
                    continue
                recorder.add(namespace, name, value, f"global {namespace.get('__name__', '?')}.{name}")
    return BakedValues(recorder.entries, recorder.unchecked)


def check_baked(baked: BakedValues) -> None:
    """Raise :class:`InputMismatch` when a value recorded by :func:`record_baked` has changed: a
    scalar rebound to another value, a container or config object changed in place or rebound to one
    that does not hold the same (each object is compared once per call, however many modules hold it)."""
    changed = None
    compared: dict[int, tuple[Any, ...]] = {}  # id(object now) -> the snapshot it matched, this call
    for owner, key, value, label, node in baked.entries:
        now = owner.get(key, _GONE)
        if node is None:
            if now is value or (type(now) is type(value) and now == value):
                continue
        else:
            if compared.get(id(now)) is node:
                continue
            try:
                same = now is not _GONE and _same(node, now)
            except Exception:  # noqa: BLE001 - a comparison that raises now (it did not at capture): changed
                same = False
            if same:
                compared[id(now)] = node
                continue
        changed = changed or []
        changed.append(f"  - {label}: {_shown(value) if node is None else _shown_node(node)} at capture, now "
                       f"{'deleted' if now is _GONE else _shown(now)}")
    if changed:
        raise InputMismatch(
            "values the graph took from the model's attributes or globals changed after prepare_model; the graph "
            "holds them as constants and would silently compute with the old ones:\n" + "\n".join(changed[:8])
            + ("\n  ..." if len(changed) > 8 else "")
            + "\nPrepare the model again after changing them (or change them back).")


def _rebuilt(node: tuple[Any, ...], depth: int = 0) -> Any:
    """What a snapshot recorded, as plain values again (for messages only)."""
    form = node[0]
    if form == _VALUE:
        return node[1]
    if form == _IDENTITY:
        return node[1]()
    if form == _SEQ:
        return [_rebuilt(c) for c in node[2][:8]]
    if form in (_MAP, _OBJECT):
        return {k: _rebuilt(c) for k, c in list(zip(node[2], node[3]))[:8]}
    return set(node[2])


def _shown_node(node: tuple[Any, ...]) -> str:
    shown = _shown(_rebuilt(node))
    return f"{node[1].__qualname__}({shown})" if node[0] == _OBJECT else shown
