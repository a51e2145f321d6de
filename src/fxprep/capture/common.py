"""What every tracer shares: the leaf policy and the shape of a capture result (each tracer's try
is the report's record, :class:`~fxprep.reporting.report.CaptureAttempt`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ..families import recorders_only
from ..runtime.opaque import is_opaque_module


@dataclass
class LeafPolicy:
    """Which modules are called as a whole instead of being traced into.

    ``torch.nn`` / ``torch.ao`` layers are leaves by default (as in ``torch.fx``). On top of that:
    the user's ``modules_to_exclude`` (by identity) and ``module_classes_to_exclude`` (subclasses
    included), modules marked with :func:`fxprep.opaque`, TorchScript modules (nothing can trace
    into them), and modules carrying forward hooks or pre-hooks: tracing into those would silently
    drop the hooks, so they stay calls and their hooks keep running (transformers' own output
    recorders aside: tracing reproduces them, :func:`fxprep.families.recorders_only`).
    """

    modules: tuple[nn.Module, ...] = ()
    classes: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        self._ids = {id(m) for m in self.modules}

    def reason(self, module: nn.Module) -> str | None:
        """Why ``module`` must be a leaf beyond torch's default rule, or None."""
        if id(module) in self._ids:
            return "modules_to_exclude"
        if self.classes and isinstance(module, self.classes):
            return "module_classes_to_exclude"
        if is_opaque_module(module):
            return "marked with fxprep.opaque"
        if isinstance(module, torch.jit.ScriptModule):
            return "TorchScript module"
        if module._forward_pre_hooks:
            return "has forward hooks"
        if module._forward_hooks:
            if not recorders_only(module._forward_hooks.values()):
                return "has forward hooks"
        return None

    def is_leaf(self, module: nn.Module, default: bool) -> bool:
        return default or self.reason(module) is not None


@dataclass
class CaptureResult:
    """A captured graph plus what the tracer learnt while capturing it."""

    gm: torch.fx.GraphModule
    tracer: str
    # Human-readable notes on anything the tracer had to specialise (mode, shapes, branches).
    notes: list[str] = field(default_factory=list)
    # Qualified names of modules kept as leaves beyond torch's default rule, with the reason.
    extra_leaves: dict[str, str] = field(default_factory=dict)


def graph_module(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose Python code is generated when first needed
    (torch's own lazy GraphModule, where this torch has it).

    Why: a capture's graph is rewritten by every pass after it and compiled once at the end
    (``prepare_model``); generating and compiling the code of an 80-layer LLM graph costs ~0.3 s,
    which a capture that never runs its module would pay for nothing. Called or asked for its
    ``code``, the module generates it then, as an eager GraphModule would have."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # another torch: the eager GraphModule
        return fx.GraphModule(root, graph, class_name)
    return _LazyGraphModule(root, graph, class_name)
