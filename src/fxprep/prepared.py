"""The GraphModule fxprep returns, and what keeps it whole through copies and pickling.

A prepared module is a ``torch.fx.GraphModule`` (a :class:`PreparedModule`, a plain subclass) that
also carries fxprep's attributes: its report (``gm.fxprep_report``) and the state-dict alias table
that makes ``state_dict()`` match the original's keys. Two kinds of copy would lose them or worse:

* ``copy.deepcopy`` rebuilds a GraphModule from its graph and keeps only what torch knows about
  (hooks, ``meta``); deep copies are common (``prepare_fx(copy.deepcopy(gm), ...)``, AIMET's
  QuantSim). torch restores the attributes named in ``gm.meta["_user_preserved_attributes"]``, so
  fxprep registers its own there (:func:`set_preserved`).
* ``pickle`` / ``torch.save`` of a plain GraphModule stores the generated code and re-traces it with
  ``torch.fx`` on loading. That loses the calling convention (a ``ModelOutput`` comes back as a
  dict, keyword arguments as positional ones), turns constructor calls into constants, and needs the
  tracer class to be constructible without arguments. :meth:`PreparedModule.__reduce__` pickles the
  graph itself instead (node metadata that holds tracer internals, such as fake tensors, is left
  out), so the loaded module is the same graph. For files meant to outlive a torch version, use
  :func:`fxprep.save`, whose format does not depend on torch internals.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn
from torch.fx import graph_module

REPORT = "fxprep_report"
_PRESERVED = getattr(graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")
# Node metadata that pickles and means something without the tracer that wrote it.
_PICKLED_META = ("nn_module_stack", "stack_trace")


def set_preserved(gm: fx.GraphModule, name: str, value: Any) -> None:
    """``setattr(gm, name, value)``, and keep it when ``gm`` is deep-copied."""
    setattr(gm, name, value)
    gm.meta.setdefault(_PRESERVED, {})[name] = value


class PreparedModule(fx.GraphModule):
    """A ``torch.fx.GraphModule`` that pickles its graph exactly (see the module docstring)."""

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__dict__.copy()
        graph = state.pop("_graph")
        return (_rebuild, (state, _picklable_graph(graph)))


def as_prepared(gm: fx.GraphModule) -> PreparedModule:
    """``gm`` as a :class:`PreparedModule` sharing its modules and tensors (nothing is copied).

    Call it before anything else is attached to ``gm`` (hooks, attributes): like any GraphModule
    built from a root, it takes over only what the graph references, and ``meta``."""
    if isinstance(gm, PreparedModule):
        return gm
    out = PreparedModule(gm, gm.graph, type(gm).__name__)
    out.meta.update(gm.meta)
    out.training = gm.training
    return out


def _picklable_graph(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    copy._codegen = graph._codegen
    for node in copy.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k in _PICKLED_META or
                     (k.startswith("fxprep_") and isinstance(v, (str, bool, int, float)))}
    return copy


def _rebuild(state: dict[str, Any], graph: fx.Graph) -> PreparedModule:
    gm = PreparedModule(nn.Module(), fx.Graph())
    gm.__dict__.update(state)
    gm.graph = graph  # sets the owning module and regenerates forward
    return gm
