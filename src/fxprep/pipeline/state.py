"""One ``prepare_model`` call as its stages see it: the user's arguments and the preparation object.

:func:`fxprep.api._prepare` runs its stages as functions of one :class:`Preparation` (the capture
request made once, and what the stages learn on the way); kept apart from the orchestration so that
the verification stage (:mod:`fxprep.pipeline.verification`) takes the same object without importing
``api``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import nn

from ..capture.common import CaptureResult
from ..capture.request import CaptureRequest
from ..capture.shapes import autodims
from ..core.inputs import ExampleInputs, split_calls
from ..families import Family
from ..options import PrepareOptions
from ..reporting.report import Report
from ..verify import Reference


class UserArguments(NamedTuple):
    """``prepare_model``'s positional arguments and its example, as the user gave them."""

    modules_to_exclude: Any
    module_classes_to_exclude: Any
    concrete_args: Any
    example_inputs: Any


@dataclass
class Preparation:
    """One ``prepare_model`` call, as its stages fill it in (:func:`fxprep.api._prepare`).

    ``request`` is the capture request, created once (:func:`fxprep.api._start`); the other fields are what the
    stages learn: the calls of the original and of the prepared module on the example, the
    reference run's output and state, the shape-general proposal, the control-flow rewrite session,
    the capture and whether it has dynamic shapes."""

    request: CaptureRequest
    opts: PrepareOptions
    report: Report
    absent: dict[str, str]  # outputs fxprep turned off for the capture (past_key_values)
    start: float
    original_call: ExampleInputs | None = None
    prepared_call: ExampleInputs | None = None
    reference: Reference | None = None
    proposal: autodims.Proposal | None = None  # the dimensions captured with: proposed, then the capture's kept
    rewrite: Any = None
    result: CaptureResult | None = None
    dynamic: Any = None
    batch_baked: bool = False  # the batch probe found the example's batch baked into the static graph
    assumed: list[str] = field(default_factory=list)  # values the graph holds and no call checks (fxprep.runtime.baked)

    @property
    def model(self) -> nn.Module:
        return self.request.model

    @property
    def family(self) -> Family:
        return self.request.family

    def calls(self, example: ExampleInputs) -> tuple[ExampleInputs, ExampleInputs]:
        """``(original call, prepared call)`` of ``example``: the original is called as the user calls
        it (``use_cache`` as given, or its default), the prepared module as it was captured."""
        concrete = self.request.concrete_args
        original = split_calls(self.model, example, self.family.without_added(concrete, self.absent))[0]
        return original, split_calls(self.model, example, concrete)[1]
