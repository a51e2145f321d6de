"""fxprep's ``torch.fx`` tracer: symbolic tracing that fails less and explains more.

Plain ``torch.fx.symbolic_trace`` crashes with Proxy errors on four everyday patterns; this tracer
handles each one deliberately instead:

* ``len(x)`` of a traced tensor is recorded as a ``len`` call (as if the user had written
  ``torch.fx.wrap('len')``), so ``x / sqrt(len(x))`` traces.
* Tensor constructors sized from traced values (``torch.zeros(x.size(0), 4)``, ``torch.arange(n,
  device=x.device)``, ``full``/``ones``/``empty``/``rand*``) are recorded as calls evaluated at run
  time, rather than failing or baking in one size.
* A custom ``torch.autograd.Function`` stays ONE call. Tracing through its ``forward`` would record
  only the forward ops, and its custom ``backward`` (a straight-through estimator, say) would be
  lost: gradients silently become those of ``round``, i.e. zero.
* Modules the :class:`LeafPolicy` names are called whole, never traced into.

What cannot be recorded (a Python ``if`` on a tensor, ``range(x.shape[0])``) still fails, and
:mod:`fxprep.reporting.diagnose` turns the failure into a located, categorised :class:`~fxprep.errors.TraceFailure`.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import inspect
import math
import operator
import re
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import PH

from ..core.frames import FRAMES, call_frames
from ..core.lazy import LazyGraphModule
from ..core.runs import StateChanges, preserved_state
from ..core.threads import confined, confined_fx_patches, on_owner_thread
from ..errors import TraceFailure
from ..ops import autograd_function_caller
from ..reporting.report import CaptureAttempt
from ..runtime.wrap import TENSOR_CONSTRUCTORS, find_proxy, record_as_call
from .common import CaptureResult, LeafPolicy
from .routes import Route

# ``x += y`` on a traced tensor must stay in place: fx.Proxy has no __iadd__, so Python falls back
# to ``x = x + y`` and a view taken earlier would miss the update.
INPLACE_OPERATORS = ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                     "imatmul", "ilshift", "irshift")


def _inplace_operator(op: Callable[..., Any], owner: int) -> Callable[..., Any]:
    def method(self: fx.Proxy, other: Any) -> Any:
        if not on_owner_thread(owner):
            return NotImplemented  # another thread's plain fx trace: Python falls back to ``x = x + y``
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


def _traced_len(obj: Any) -> Any:
    if isinstance(obj, fx.Proxy):
        return obj.tracer.create_proxy("call_function", builtins.len, (obj,), {})
    return builtins.len(obj)


@contextlib.contextmanager
def _tracing_patches(globals_dicts: list[dict[str, Any]]) -> Iterator[None]:
    """Install the recording wrappers for the duration of one trace and always undo them.

    Each one is confined to this thread (:func:`fxprep.core.threads.confined`): other threads keep
    running torch's own functions while this one traces."""
    restore: list[Callable[[], None]] = []
    owner = threading.get_ident()
    try:
        for name in TENSOR_CONSTRUCTORS:
            orig = getattr(torch, name, None)
            if orig is None:
                continue
            setattr(torch, name, confined(record_as_call(orig), orig, owner))
            restore.append(functools.partial(setattr, torch, name, orig))

        function_cls = torch.autograd.Function
        orig_apply = function_cls.__dict__["apply"]

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            proxy = find_proxy((args, kwargs)) if on_owner_thread(owner) else None
            if proxy is None:
                return orig_apply.__get__(None, cls)(*args, **kwargs)
            return proxy.tracer.create_proxy("call_function", autograd_function_caller(cls), args, kwargs)

        function_cls.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
        restore.append(functools.partial(setattr, function_cls, "apply", orig_apply))

        for name in INPLACE_OPERATORS:
            if f"__{name}__" in fx.Proxy.__dict__:
                continue
            setattr(fx.Proxy, f"__{name}__", _inplace_operator(getattr(operator, name), owner))
            restore.append(functools.partial(delattr, fx.Proxy, f"__{name}__"))

        seen: set[int] = set()
        for g in globals_dicts:
            # a module's own `len` is left alone; fx-generated code names builtins.len explicitly
            if id(g) in seen or g.get("len", builtins.len) is not builtins.len:
                continue
            seen.add(id(g))
            if "len" in g:
                restore.append(functools.partial(g.__setitem__, "len", g["len"]))
            else:
                restore.append(functools.partial(g.pop, "len", None))
            g["len"] = confined(_traced_len, g.get("len", builtins.len), owner)
        yield
    finally:
        for undo in reversed(restore):
            undo()


@contextlib.contextmanager
def restored_attributes(model: nn.Module, changed: list[str], updated: list[str] | None = None) -> Iterator[None]:
    """Undo whatever tracing wrote onto the user's modules (:func:`fxprep.core.runs.preserved_state`).

    Some forwards cache values on ``self`` (``self.scales = ...``); during tracing those values
    are Proxies, and leaving them there would break the user's model. Attributes, registries,
    buffer values and plain containers are all put back; the names of attributes that changed are
    added to ``changed``, those of buffers written in place to ``updated``.
    """
    changes = StateChanges()
    try:
        with preserved_state(model, changes=changes):
            yield
    finally:
        changed.extend(changes.attributes + changes.containers)
        if updated is not None:
            updated.extend(changes.buffers)


class FxprepTracer(fx.Tracer):
    """``torch.fx.Tracer`` with fxprep's leaf policy and recording patches; remembers what it
    decided and traced.

    Constructible without arguments (an empty policy) because ``torch.fx`` re-creates
    ``gm._tracer_cls()`` to re-trace the generated code when a GraphModule is unpickled
    (``pickle``, ``torch.load``): a prepared module names this class there, so the code it
    generated (``len`` calls, constructors sized from shapes) traces again the same way.
    """

    def __init__(self, policy: LeafPolicy | None = None, autowrap_functions: tuple[Callable[..., Any], ...] = ()):
        super().__init__(autowrap_modules=(math,), autowrap_functions=autowrap_functions)
        self.policy = policy if policy is not None else LeafPolicy()
        self.extra_leaves: dict[str, str] = {}
        self.traced_classes: dict[type, str] = {}
        self.wraps_functions = bool(autowrap_functions)
        self._attribute_paths: dict[int, str] | None = None  # id of a module attribute: its path

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """``fx.Tracer.trace`` with the recording patches installed for this trace only.

        ``autowrap_functions`` are looked up in the module of every ``forward``'s own function too:
        fx looks only in the globals of the ``forward`` it calls, which for a decorated ``forward``
        (every transformers model) are the decorator's module, so a function named there (the mask
        builders llm-compressor's ``tracing_ignore`` names) would be traced into."""
        classes = list({type(m): None for m in root.modules()}) if isinstance(root, nn.Module) else []
        self._attribute_paths = None
        if self.wraps_functions:
            search = getattr(self, "_autowrap_search", None)
            if isinstance(search, list):
                for cls in classes:
                    found = inspect.getmodule(inspect.unwrap(getattr(cls, "forward", cls)))
                    if found is not None and found not in search:
                        search.append(found)
        with confined_fx_patches(), _tracing_patches(_forward_globals(classes)):
            return super().trace(root, concrete_args=concrete_args)

    def create_arg(self, a: Any) -> Any:
        """A dataclass instance that is an attribute of one of the model's modules (a transformers
        config handed to a function fx calls whole) is read from there (``get_attr``), the same
        object; plain fx would write a call of its class rebuilding it from its fields at every run."""
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and isinstance(getattr(self, "root", None), nn.Module):
            path = self._attribute_path(a)
            if path is not None:
                return self.create_node("get_attr", path, (), {})
        return super().create_arg(a)

    def _attribute_path(self, value: Any) -> str | None:
        """The first path (modules in ``named_modules`` order, the root first) holding ``value``:
        every module's public attributes indexed once per trace, at the first lookup."""
        if self._attribute_paths is None:
            self._attribute_paths = {}
            for name, m in self.root.named_modules():
                for key, attr in vars(m).items():
                    if not key.startswith("_"):
                        self._attribute_paths.setdefault(id(attr), f"{name}.{key}" if name else key)
        path = self._attribute_paths.get(id(value))
        if path is None:
            return None
        owner, _, key = path.rpartition(".")
        held = vars(self.root.get_submodule(owner)).get(key)
        return path if held is value else None  # a forward may have rebound it since

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any | None = None) -> fx.Node:
        """``fx.Tracer.create_node``, recording the frames (file, function) that made each call: the
        modules fxprep adds are named after the function that made them (:mod:`fxprep.passes.naming`),
        as on the Dynamo route, whose nodes carry a stack trace. Not torch.fx's own stack traces
        (``record_stack_traces``): formatting one per node made an fx prepare of Swin-T 50% slower."""
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind in ("call_function", "call_method"):
            node.meta[FRAMES] = call_frames()
        return node

    def make_graph_module(self, graph: fx.Graph, class_name: str) -> fx.GraphModule:
        """Its code generated at first use: the capture's module is rewritten by the passes and
        recompiled once after them (:class:`~fxprep.core.lazy.LazyGraphModule`)."""
        return LazyGraphModule(self.root, graph, class_name)

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None) -> Any:
        """Trace the root's *instance* ``forward`` when one is bound (``control_flow="rewrite"``
        binds a rewritten forward there while capturing); plain fx always reads the class's."""
        bound = self.root.__dict__.get("forward") if is_module else None
        if getattr(bound, "__self__", None) is self.root and getattr(bound, "__func__", None) is not None:
            root_fn = bound.__func__  # type: ignore[union-attr]
        return super().create_args_for_root(through_wrapper(root_fn), is_module, concrete_args)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *rest: Any, **kw: Any) -> Any:
        """A split into a known number of pieces is a tuple of traced pieces, so ``list(x.split(
        sizes))`` and ``a, b = x.chunk(2)`` work (plain fx refuses to iterate the result)."""
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        pieces = _known_pieces(kind, target, args, kwargs)
        if pieces is None:
            return proxy
        return tuple(proxy[i] for i in range(pieces))

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A module made inside a forward (``nn.ReLU()(x)``: MRA's multiple-choice head) is no
        submodule of the model, so no ``call_module`` node can name it (plain fx raises NameError
        "module is not installed as a submodule"). Its forward is traced through instead, so its
        operations land in the graph as functions (later made modules like any functional call), as
        Dynamo inlines it."""
        try:
            self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        reason = self.policy.reason(m)
        if reason is not None:
            if module_qualified_name:  # the root itself can never be a leaf
                self.extra_leaves[module_qualified_name] = reason
                return True
        leaf = super().is_leaf_module(m, module_qualified_name)
        if not leaf:
            self.traced_classes.setdefault(type(m), module_qualified_name)
        return leaf


def _known_pieces(kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """How many tensors a split/chunk returns, when the call itself says so."""
    if kind == "call_method" and target in ("split", "split_with_sizes") or kind == "call_function" and target in (torch.split, torch.functional.split):
        sections = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_sizes"))
        if isinstance(sections, (list, tuple)):
            return len(sections)
    return None


def _forward_globals(classes: Iterable[type]) -> list[dict[str, Any]]:
    """The globals of every module class's ``forward`` (where ``len`` is looked up), torch's excluded."""
    out = []
    for cls in classes:
        fwd = getattr(cls, "forward", None)
        g = getattr(fwd, "__globals__", None)
        if isinstance(g, dict) and not g.get("__name__", "").startswith("torch."):
            out.append(g)
    return out


@functools.lru_cache(maxsize=512)
def _training_reads(cls: type) -> tuple[str, ...]:
    """``file:line`` of every ``self.training`` read in ``cls.forward`` (cached per class)."""
    fwd = getattr(cls, "forward", None)
    try:
        # the decorated function's own code: getsourcelines unwraps decorators, getsourcefile does not
        # (transformers 5.24's deprecate_kwarg put its own file beside the forward's line numbers)
        fwd = inspect.unwrap(fwd) if callable(fwd) else fwd
        lines, start = inspect.getsourcelines(fwd)  # type: ignore[arg-type]
        filename = inspect.getsourcefile(fwd)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ()
    return tuple(f"{filename}:{start + i}" for i, line in enumerate(lines) if "self.training" in line)


def mode_notes(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """Notes on traced-through code that reads ``self.training``: its branch is now fixed.

    Works for any tracer: a module whose object is called by the graph (a leaf) still reads its
    mode at run time; every other module of the user's own classes was traced into, so a
    ``self.training`` branch in its forward was resolved once, for the capture mode.
    """
    called = {id(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
    called |= {id(getattr(m, "owner", None)) for m in gm.modules()}
    mode = "train" if model.training else "eval"
    notes: list[str] = []
    seen: set[type] = set()
    visited: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:  # named_modules' order, not into a called module: it and everything in it run as they are
        qualname, m = stack.pop()
        if id(m) in visited or id(m) in called:
            continue
        visited.add(id(m))
        stack += reversed([(f"{qualname}.{k}" if qualname else k, c) for k, c in m._modules.items() if c is not None])
        cls: type = type(m)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        for where in _training_reads(cls):
            notes.append(
                f"{cls.__name__} ({qualname or 'root'}) reads self.training at {where}: that branch was "
                f"captured for {mode} mode and stays fixed; prepare the model in the mode you will use it in."
            )
    return notes


class _PyTreeCodeGenWithDefaults(fx.graph._PyTreeCodeGen):
    """fx's pytree code generator, plus defaults for arguments fixed by ``concrete_args``.

    When inputs are flattened (a list of images becomes one placeholder per image), fx writes
    ``def forward(self, images, targets)`` and a fixed ``targets=None`` turns into a required
    argument. This puts the default back so the prepared module is called like the original.
    """

    def __init__(self, pytree_info: Any, defaults: dict[str, Any]):
        super().__init__(pytree_info)
        self.defaults = defaults

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
        text = super().gen_fn_def(free_vars, maybe_return_annotation, **kwargs)
        head, sep, rest = text.partition("\n")
        for name, value in self.defaults.items():
            head = re.sub(rf"(?<=[(,\s]){name}(?=\s*[,)])", f"{name}={value!r}", head, count=1)
        # A required argument after a defaulted one (``images, targets=None, features``) is not
        # Python: make it keyword-only, as callers of such a forward pass it by name anyway.
        seen_default = False
        for name in getattr(self.pytree_info, "orig_args", ()):
            if name in self.defaults:
                seen_default = True
            elif seen_default:
                head = re.sub(rf"(?<=[(,\s]){name}(?=[\s:,)])", f"*, {name}", head, count=1)
                break
        return head + sep + rest


def flatten_container_inputs(model: nn.Module, example: Any, concrete_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """``concrete_args`` that give list/tuple/dict inputs one placeholder per tensor (fx ``PH``), so
    ``for img in images`` iterates real Python lists of traced tensors instead of failing; an input
    the example gives as None is fixed to None (as Dynamo does; the prepared module refuses another
    value, see :mod:`fxprep.runtime.guard`)."""
    if example is None:
        return concrete_args
    try:
        bound = inspect.signature(model.forward).bind_partial(*example.args, **example.kwargs)
    except (TypeError, ValueError):
        return concrete_args
    out = dict(concrete_args or {})
    for name, value in bound.arguments.items():
        if name in out:
            continue
        if value is None:  # an input given as None is None in the graph (``if extra is not None``)
            out[name] = None
            continue
        if not isinstance(value, (list, tuple, dict)):
            continue
        leaves = torch.utils._pytree.tree_leaves(value)
        if leaves and all(isinstance(v, torch.Tensor) for v in leaves):
            out[name] = torch.utils._pytree.tree_map(lambda _: PH, value)
    return out or concrete_args


def _name_concrete_placeholders(graph: fx.Graph, model: nn.Module, concrete_args: dict[str, Any]) -> None:
    """fx renames a concrete argument ``flag`` to a required ``flag_1``; give it back its name and
    make the concrete value its default, so ``gm(x)`` and ``gm(x, flag=True)`` both work. Done on the
    graph before its GraphModule is made, so its code is generated once."""
    params = inspect.signature(model.forward).parameters
    codegen = graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        defaults = {k: v for k, v in concrete_args.items()
                    if k in params and v is not PH and isinstance(v, (bool, int, float, str, type(None)))}
        graph._codegen = _PyTreeCodeGenWithDefaults(codegen.pytree_info, defaults)
        return
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        base, _, suffix = str(node.target).rpartition("_")
        if suffix.isdigit() and base in concrete_args and base in params:
            value = concrete_args[base]
            node.target = base
            if isinstance(value, (bool, int, float, str, type(None))):
                node.args = (value,)


def through_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or where it is a ``functools.wraps`` wrapper taking ``(*args, **kwargs)`` (transformers'
    ``can_return_tuple``, ``deprecate_kwarg``, ``check_model_inputs`` on every model's ``forward``) a
    function with the wrapped function's own parameters that calls the wrapper.

    Why: fx builds the traced signature from the outermost function's code and rewrites that code
    for the placeholders, and a wrapper's code has too few names for it ("co_varnames is too
    small"). Calling the wrapper, not the function inside, keeps what the decorator does (defaults
    read from the config, tuple returns) in the trace, as a user's ``model(**batch)`` runs it. The
    parameters are passed by keyword, as such a call passes them (decorators read ``kwargs``); a
    ``*args`` or ``**kwargs`` of the wrapped function is left out (fx can only pass it on as a proxy
    it cannot iterate)."""
    original = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if original is fn or code is None or not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        return fn
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return fn
    if not params or code.co_varnames[:len(params)] == tuple(p.name for p in params):
        return fn
    heads, calls, defaults, kwdefaults = [], [], [], {}
    kwonly_started = False
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):  # nothing a trace can take: fx would iterate a proxy
            continue
        if p.kind is p.KEYWORD_ONLY:
            if not kwonly_started:
                heads.append("*")
                kwonly_started = True
            if p.default is not p.empty:
                kwdefaults[p.name] = p.default
            calls.append(f"{p.name}={p.name}")
        else:
            if p.default is not p.empty:
                defaults.append(p.default)
            positional = i == 0 or p.kind is p.POSITIONAL_ONLY
            calls.append(p.name if positional else f"{p.name}={p.name}")
        heads.append(p.name)
    namespace: dict[str, Any] = {"__fxprep_wrapper__": fn}
    source = f"def {original.__name__}({', '.join(heads)}):\n    return __fxprep_wrapper__({', '.join(calls)})\n"
    exec(compile(source, f"<fxprep: {original.__qualname__} through its decorator>", "exec"), namespace)  # noqa: S102
    made = namespace[original.__name__]
    made.__defaults__ = tuple(defaults) or None
    made.__kwdefaults__ = kwdefaults or None
    made.__qualname__ = original.__qualname__
    return made


class DecoratedForward(TypeError):
    """torch.fx cannot trace a ``forward`` wrapped by a decorator that takes ``(*args, **kwargs)``."""


def _explained(err: Exception, model: nn.Module) -> Exception:
    """``err``, or what it means in words where torch.fx's own text says nothing a person can use:
    fx builds the traced signature from the outermost function's code, and a ``functools.wraps``
    wrapper taking ``(*args, **kwargs)`` (transformers 5.24's ``deprecate_kwarg`` on every
    Llama-family ``forward``) has too few names for it ("code: co_varnames is too small"). The
    explanation points at the decorated ``forward``'s own ``def`` line."""
    forward = getattr(type(model).forward, "__wrapped__", None)
    if not (isinstance(err, ValueError) and "co_varnames is too small" in str(err) and forward is not None):
        return err
    explained = DecoratedForward(
        f"torch.fx cannot trace {type(model).__name__}.forward: it is wrapped by a decorator taking "
        f"(*args, **kwargs), and fx builds the traced signature from the wrapper's code (fx: {err})")
    explained.__cause__ = err
    original = inspect.unwrap(forward)
    code = getattr(original, "__code__", None)
    if code is not None:
        explained.innermost_user_frame_summary = traceback.FrameSummary(  # type: ignore[attr-defined]
            code.co_filename, code.co_firstlineno, code.co_name)
    return explained


def capture_fx(
    model: nn.Module,
    policy: LeafPolicy,
    concrete_args: dict[str, Any] | None = None,
    autowrap_functions: tuple[Callable[..., Any], ...] = (),
    tracer: FxprepTracer | None = None,
) -> tuple[CaptureResult | None, CaptureAttempt]:
    """Trace ``model`` with :class:`FxprepTracer` (or the given subclass instance). Never raises for a trace failure: the failure is
    returned in the :class:`CaptureAttempt` so the cascade can go on and the report can show it."""
    start = time.perf_counter()
    tracer = tracer or FxprepTracer(policy, autowrap_functions)
    tracer.traced_classes[type(model)] = ""  # the root is traced without asking is_leaf_module
    changed: list[str] = []
    updated: list[str] = []
    try:
        with restored_attributes(model, changed, updated):
            graph = tracer.trace(model, concrete_args=concrete_args)
            if isinstance(graph._codegen, fx.graph._PyTreeCodeGen):
                for node in graph.nodes:  # fx writes `x = None,` into the unpacking line otherwise
                    if node.op == "placeholder":
                        node.args = ()
            if concrete_args:
                _name_concrete_placeholders(graph, model, concrete_args)
            # Built before the user's attributes are restored: fx parks the tensor constants it
            # creates (``_tensor_constant0``) on the root, and the GraphModule must copy them.
            gm = tracer.make_graph_module(graph, model.__class__.__name__)
        changed = [c for c in changed if not c.rpartition(".")[2].startswith("_tensor_constant")]
        _reread_restored(gm, model, changed)
    except Exception as err:  # noqa: BLE001 - every tracer failure is reported, not raised
        return None, CaptureAttempt.failed(Route.FX, _explained(err, model), start)
    notes = []
    if changed:
        notes.append(
            f"forward() wrote to module attributes while being traced ({', '.join(sorted(set(changed))[:8])}); "
            f"fxprep restored them. Values cached this way are not part of the graph."
        )
    if updated:
        notes.append(
            f"WARNING: forward() updated buffer(s) {', '.join(sorted(set(updated))[:8])} in place outside what fx "
            f"records (the update ran once on the real tensor while tracing; fxprep restored it): the prepared "
            f"module does NOT perform this update. Keep such state outside forward(), or use tracer='dynamo'."
        )
    result = CaptureResult(gm, Route.FX, notes=notes, extra_leaves=dict(tracer.extra_leaves))
    return result, CaptureAttempt(Route.FX, True, time.perf_counter() - start)


def _reread_restored(gm: fx.GraphModule, model: nn.Module, changed: list[str]) -> None:
    """The GraphModule copies what its ``get_attr`` nodes read while the model still holds what the
    trace wrote (so that fx's parked constants are copied): an attribute the forward overwrote
    (CTRL's ``self.pos_encoding = self.pos_encoding.to(device)``) would be copied as the trace's
    Proxy. Those reads take the model's restored value instead."""
    restored = set(changed)
    for node in gm.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        if target not in restored:
            continue
        owner_path, _, name = target.rpartition(".")
        source = model.get_submodule(owner_path) if owner_path else model
        if not hasattr(source, name):
            continue
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if owner is source:
            continue  # the model's own module, restored already
        value = getattr(source, name)
        for registry in (owner.__dict__, owner._parameters, owner._buffers, owner._modules):
            registry.pop(name, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            owner.register_buffer(name, value)  # as fx's own copy of an attribute does
        else:
            setattr(owner, name, value)


def trace_failure(attempts: list[CaptureAttempt], model: nn.Module | None = None) -> TraceFailure:
    """The error raised when every tracer failed: each attempt, located and explained."""
    from ..reporting.diagnose import diagnose

    issues = [i for a in attempts if a.exception is not None for i in diagnose(a.exception, a.tracer, model)]
    lines = ["fxprep could not capture the model:"]
    for a in attempts:
        lines.append(f"  - {a.tracer}: {a.error}")
    for issue in issues:
        lines.append("")
        lines.append(issue.to_text())
    return TraceFailure("\n".join(lines), issues=issues, attempts=attempts)
