"""Hand-off to NNCF: :func:`quantize`, NNCF's ``nncf.quantize`` for a prepared graph.

NNCF sends any ``torch.fx.GraphModule`` to its ``torch.export`` backend, which expects aten graphs.
:func:`quantize` hands it the prepared graph inside a plain ``nn.Module``, so NNCF uses the torch
backend that quantizes the original model (module paths under ``graph.``), and returns what NNCF
returns; the prepared graph is not changed.

See docs/handoff/nncf.md.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch.fx as fx
from torch import nn

from ..errors import InvalidInput
from .contract import Adapter

__all__ = ["ADAPTER", "quantize", "AsModule"]

ADAPTER = Adapter(toolkit="NNCF", module="nncf", requires="nncf>=3.4", entry_points=("quantize", "AsModule"),
                  page="handoff/nncf.md")


class AsModule(nn.Module):
    """A prepared graph seen as a plain ``nn.Module``, so NNCF chooses its torch backend.

    Its ``forward`` has the graph's own signature, so NNCF quantizes the inputs as on the original
    (docs/handoff/nncf.md).

    Args:
        graph: The prepared ``GraphModule`` (held as the ``graph`` submodule).
    """

    def __init__(self, graph: fx.GraphModule):
        super().__init__()
        self.graph = graph
        # A partial, not a closure: copy.deepcopy (NNCF copies the model) must rebind it to the copy.
        bound = functools.partial(AsModule._call_graph, self)
        bound.__signature__ = inspect.signature(graph.forward)  # type: ignore[attr-defined]  # read by inspect
        self.forward = bound  # type: ignore[method-assign]  # per instance: shadows the class's forward below

    def _call_graph(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # replaced per instance in __init__
        return self.graph(*args, **kwargs)


def quantize(gm: fx.GraphModule, calibration_dataset: Any, **nncf_options: Any) -> nn.Module:
    """``nncf.quantize`` on the prepared graph ``gm``, through NNCF's torch backend; ``gm`` is not changed.

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        calibration_dataset: An ``nncf.Dataset``.
        **nncf_options: NNCF's options (``subset_size``, ``preset``, ``ignored_scope``: names as in docs/handoff/nncf.md).

    Returns:
        NNCF's quantized module.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``.
    """
    import nncf

    if not isinstance(gm, fx.GraphModule):
        raise InvalidInput(f"fxprep.compat.nncf.quantize expects the GraphModule from fxprep.prepare_model, not "
                           f"{type(gm).__name__}; call nncf.quantize on other models directly.")
    return nncf.quantize(AsModule(gm), calibration_dataset, **nncf_options)
