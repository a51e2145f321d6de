"""The GraphModule fxprep returns, and what keeps it whole through copies and pickling.

A :class:`PreparedModule` is a plain ``torch.fx.GraphModule`` subclass carrying fxprep's report, the
state-dict alias table and the input spec (:mod:`fxprep.runtime.guard`). :func:`set_preserved`
registers them so ``copy.deepcopy`` keeps them, and :meth:`PreparedModule.__reduce__` pickles the
graph itself rather than re-tracing its code. For files meant to outlive a torch version, use
:func:`fxprep.save`.

See docs/concepts/sharing.md ("Under the hood").
"""

from __future__ import annotations

import threading
from typing import Any

import torch.fx as fx
from torch import nn
from torch.fx import graph_module
from torch.fx.experimental import _config as fx_experimental_config
from torch.fx.graph import PythonCode

from fxprep.runtime.forward_code import (
    CALL_HELPER,
    FAST_HELPER,
    HELPER,
    call_module,
    child,
    fast_calls,
    fast_source,
)

from .. import decisions
from ..errors import InvalidInput
from ..reporting.report import Report
from . import baked as baked_values
from . import guard, modes

REPORT = "fxprep_report"
INPUT_SPEC = "fxprep_input_spec"  # a guard.InputSpec: what each call is checked against
BAKED = "fxprep_baked_values"  # a baked.BakedValues: module attributes / globals the graph holds as constants
# the process modes the graph can switch (autocast's device types, "grad": fxprep.runtime.modes), found at each
# recompile; a call of a module whose graph switches none pays one dict read
MODES = "_fxprep_modes"
_PRESERVED = getattr(graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")
# Set while as_prepared(..., compiled=False) builds a module: its code is generated later, once.
_DEFER = threading.local()
# Node metadata that pickles and means something without the tracer that wrote it.
_PICKLED_META = ("nn_module_stack", "stack_trace")


def set_preserved(gm: fx.GraphModule, name: str, value: Any) -> None:
    """``setattr(gm, name, value)``, and keep it when ``gm`` is deep-copied."""
    setattr(gm, name, value)
    gm.meta.setdefault(_PRESERVED, {})[name] = value


class PreparedModule(fx.GraphModule):
    """A ``torch.fx.GraphModule`` that pickles its graph exactly (see the module docstring) and
    checks each call's inputs against those it was captured for (:mod:`fxprep.runtime.guard`; a value the
    capture decided from the example's data is checked in the graph, :mod:`fxprep.decisions`) and runs a
    forward whose submodule lookups are dict reads (:mod:`fxprep.runtime.forward_code`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.__dict__.get(INPUT_SPEC)
        baked = self.__dict__.get(BAKED)
        # compile/export/fx re-trace: symbolic inputs, and the tracer reads the values themselves
        if (spec is not None or baked) and not guard.tracing(args, kwargs):
            if spec is not None:
                guard.check_inputs(self, spec, args, kwargs)
            if baked:
                baked_values.check_baked(baked)
        entered = self.__dict__.get(MODES)
        if not entered:
            return self._run(args, kwargs)
        # a region the graph enters (autocast) is left even when an op inside it raises (fxprep.runtime.modes)
        state = modes.snapshot(entered)
        try:
            return self._run(args, kwargs)
        except BaseException:
            modes.restore(state)
            raise

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as err:  # a value decided from the example, which this input decides otherwise
            mismatch = decisions.failed_check(self, err)
            if mismatch is None:
                raise
            raise mismatch from err

    def recompile(self) -> PythonCode:
        if getattr(_DEFER, "active", False):
            return None  # type: ignore[return-value]  # as_prepared(compiled=False): the caller recompiles
        self.__dict__[MODES] = modes.entered(self)
        compile_forward = getattr(graph_module, "_forward_from_src", None)
        if compile_forward is None or getattr(fx_experimental_config, "enrich_profiler_metadata", False):
            return super().recompile()  # another torch, or fx rewrites the code for the profiler: fx's forward
        with _COMPILING:
            graph_module._forward_from_src = _FastForward(self, compile_forward)
            try:
                return super().recompile()
            finally:
                graph_module._forward_from_src = compile_forward

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__dict__.copy()
        graph = state.pop("_graph")
        return (_rebuild, (state, _picklable_graph(graph)))


# fx's recompile generates the code and compiles it in one step; fxprep swaps in its faster forward
# source at that step (below), so the 5,000-line forward of an 80-layer LLM is compiled once, not twice.
_COMPILING = threading.RLock()


class _FastForward:
    """``graph_module._forward_from_src`` for the one call ``GraphModule.recompile`` makes to compile
    ``gm``'s forward, in the thread recompiling it: compiles :func:`fast_source` of fx's code instead.
    Any other call (another thread's GraphModule, a submodule recompiled after it) is passed through
    unchanged, so nothing else ever runs fxprep's rewriting."""

    def __init__(self, gm: fx.GraphModule, compile_forward: Any):
        self.gm = gm
        self.compile_forward = compile_forward
        self.thread = threading.get_ident()
        self.used = False

    def __call__(self, src: str, globals: dict[str, Any], co_fields: dict[str, Any] | None = None) -> Any:
        if self.used or threading.get_ident() != self.thread:
            return self.compile_forward(src, globals, co_fields)
        self.used = True
        source = fast_source(self.gm, src)
        if source != src:
            globals = {**globals, HELPER: child, CALL_HELPER: call_module, FAST_HELPER: fast_calls}
        return self.compile_forward(source, globals, co_fields)


def as_prepared(gm: fx.GraphModule, *, compiled: bool = True) -> PreparedModule:
    """``gm`` as a :class:`PreparedModule` sharing its modules and tensors (nothing is copied).

    Call it before anything else is attached to ``gm`` (hooks, attributes): like any GraphModule
    built from a root, it takes over only what the graph references, and ``meta``.

    ``compiled=False`` leaves out generating and compiling its Python code (a ``forward``), for a
    caller that rewrites the graph and calls :meth:`~PreparedModule.recompile` itself before the
    module is called: on an 80-layer LLM graph each generation costs ~0.3 s."""
    if isinstance(gm, PreparedModule):
        return gm
    _DEFER.active = not compiled
    try:
        out = PreparedModule(gm, gm.graph, type(gm).__name__)
    finally:
        _DEFER.active = False
    out.meta.update(gm.meta)
    out.training = gm.training
    return out


class _Ref:
    """A node named in a pickled node list (nodes are rebuilt in order, so every ref is defined)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Ref, (self.name,))


def _picklable_graph(graph: fx.Graph) -> tuple[list[tuple[Any, ...]], Any]:
    """The graph as a flat node list plus its code generator.

    Not the ``fx.Graph`` itself: its nodes are a linked list, which pickle walks recursively (a
    graph of a few thousand nodes, efficientnet's, exceeds the recursion limit). Node metadata that
    holds tracer internals (fake tensors) is left out."""
    nodes = []
    for node in graph.nodes:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(n.name))
        meta = {k: v for k, v in node.meta.items() if k in _PICKLED_META or
                (k.startswith("fxprep_") and isinstance(v, (str, bool, int, float)))}
        nodes.append((node.name, node.op, node.target, args, kwargs, node.type, meta))
    return nodes, graph._codegen


def _unpickled_graph(nodes: list[tuple[Any, ...]], codegen: Any) -> fx.Graph:
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}

    def resolve(value: Any) -> Any:
        if isinstance(value, _Ref):
            return made[value.name]
        if isinstance(value, list):  # fx's immutable_list included
            return [resolve(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if type(value) is slice:
            return slice(resolve(value.start), resolve(value.stop), resolve(value.step))
        return value

    for name, op, target, args, kwargs, type_expr, meta in nodes:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name, type_expr=type_expr)
        node.meta = meta
        made[name] = node
    graph._codegen = codegen
    return graph


def _rebuild(state: dict[str, Any], graph: tuple[list[tuple[Any, ...]], Any]) -> PreparedModule:
    gm = PreparedModule(nn.Module(), fx.Graph())
    gm.__dict__.update(state)
    gm.graph = _unpickled_graph(*graph)  # sets the owning module and regenerates forward
    return gm


def get_report(gm: nn.Module) -> Report:
    """The :class:`Report` of a module returned by :func:`fxprep.prepare_model` or :func:`fxprep.load`.

    Args:
        gm: The prepared module.

    Returns:
        Its report (also at ``gm.fxprep_report``).

    Raises:
        InvalidInput: ``gm`` was not made by fxprep.
    """
    report = getattr(gm, REPORT, None)
    if not isinstance(report, Report):
        raise InvalidInput("this module was not produced by fxprep.prepare_model (it has no fxprep report).")
    return report
