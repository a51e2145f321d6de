"""One capture request: what every capture route needs, travelling as one object.

A capture needs the model, the example it runs on, which modules stay leaves, the concrete
arguments, a handful of options (``autowrap_functions``, ``dynamic``, block reuse and the pass run
on each reused block) and, in the opaque-part fallback, the eager recordings its captures share.
Passed loose, each of these was a parameter of every function on the way from ``prepare_model`` to
the tracer (``capture_dynamo`` took eleven), and a new option meant editing every signature on the
way. They travel as one frozen :class:`CaptureRequest` instead: created once in ``prepare_model``
(:mod:`fxprep.api`) or ``check_traceability`` (:mod:`fxprep.pipeline.traceability`), handed to the routes of
:mod:`fxprep.capture.cascade`, which return a :class:`~fxprep.capture.common.CaptureResult`; a
route that tries a variant (another example size, other dynamic dimensions, Dynamo deciding values
from data) makes it with :meth:`CaptureRequest.replace`, leaving the caller's request as it was.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.inputs import ExampleInputs, split_calls
from ..families import Family, family_for
from .common import LeafPolicy

# The fields that decide what an eager recording of an opaque part holds: a variant changing one of
# them must not reuse the recordings made for the original (a recording is the run on *this* example).
_RECORDED_ON = ("model", "example", "concrete_args")


class ScanStop(enum.Enum):
    """Where a capture under the scan search stops (``CaptureRequest.scan_search``)."""

    FIRST = "at the first guard that limits a declared dimension"
    # a first try run on past a guard that bounds the dimension (BERT's position table): the next guard,
    # one that specialises it, stops it before a chunked scan behind it is traced unrolled (Lara-mini)
    PAST_BOUNDS = "at the first guard that does more than bound a declared dimension by a constant"


@dataclass
class Learned:
    """What a Dynamo capture of this model learned that every later capture of it in the same
    ``prepare_model`` call can start from, instead of failing the same way first: the model's
    forward mutates the ``**kwargs`` it is called with, so Dynamo traces it from a fresh-kwargs
    root (:func:`fxprep.capture.dynamo.export.fresh_kwargs_root`). Llava-NeXT's default prepare
    made eight captures, each failing twice on that before the retry (16 of 32 traces)."""

    fresh_kwargs: bool = False
    # the repeated blocks (by object identity) whose stand-in output a capture had to compute, its
    # guess not holding (:class:`fxprep.capture.dynamo.stubs.OtherOutput`): later captures compute it
    # from the start instead of tracing the whole model once more (CPM-Ant: 7 traces -> 6)
    computed_blocks: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class CaptureRequest:
    """What to capture and how; immutable (make variants with :meth:`replace`).

    ``model``: the module to capture (never mutated). ``policy``: the modules kept as leaves.
    ``example``: the normalized example inputs (None: fx only, or inputs built from a transformers
    config, :func:`fxprep.capture.cascade.dynamo_call`). ``concrete_args``: arguments baked into the
    graph (:func:`fxprep.core.inputs.split_calls`). ``autowrap_functions``: functions fx calls without
    tracing into. ``dynamic``: Dynamo's dynamic dimensions (``"batch"``, ``{arg: {dim: name}}``, False
    for static, None for Dynamo's default). ``reuse``: Dynamo captures each repeated block once
    (:mod:`fxprep.capture.dynamo.reuse`); ``block_pass(block_gm, first_instance)`` then runs once on
    each such block. ``handled(err)``: asked first about each failure of the opaque-part fallback
    (``control_flow="rewrite"`` rewrote the failing ``if``: True means capture again). ``records``:
    the opaque parts' eager recordings shared by the captures of one fallback (None: each capture
    records its own). ``dims_must_hold``: a failure because ``dynamic`` declared a dimension the
    model's code specialises ends the opaque-part fallback (making parts opaque cannot make it
    dynamic; the shape-general capture then tries static shapes) instead of making a part opaque.
    ``opaque``: sites (:class:`~fxprep.capture.sites.Site`) Dynamo calls without tracing into from the
    start, on every Dynamo route (a scan kept out of the graph so that the length it loops over stays
    dynamic: :mod:`fxprep.capture.dynamo.scans`). ``scan_search``: the capture (the model's, or a repeated
    block's own under block reuse) stops at the first guard that limits a declared dimension
    (:attr:`ScanStop.FIRST`), or that does more than bound it (:attr:`ScanStop.PAST_BOUNDS`), for
    the shape-general capture to look for a scan from that guard
    (:mod:`fxprep.capture.dynamo.early_limit`), instead of tracing on and capturing the whole model.
    ``family``: the model's family (:func:`fxprep.families.family_for`, looked up when not given),
    asked for its capture context, config inputs and own tracer; variants keep it.
    ``learned``: shared by the variants for the same model (:class:`Learned`).
    """

    model: nn.Module
    policy: LeafPolicy = field(default_factory=LeafPolicy)
    example: ExampleInputs | None = None
    concrete_args: dict[str, Any] | None = None
    autowrap_functions: tuple[Callable[..., Any], ...] = ()
    dynamic: Any = None
    reuse: bool = False
    block_pass: Callable[..., Any] | None = None
    handled: Callable[[BaseException], bool] | None = None
    records: dict[Any, Any] | None = field(default=None, compare=False)
    dims_must_hold: bool = False
    opaque: tuple[Any, ...] = ()
    scan_search: ScanStop | None = None
    learned: Learned = field(default_factory=Learned, compare=False)
    family: Family = field(default=None, compare=False)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.family is None:
            object.__setattr__(self, "family", family_for(self.model))

    def replace(self, **changes: Any) -> CaptureRequest:
        """A copy with ``changes`` (``dataclasses.replace``). A copy for another model, example or
        concrete arguments starts without recordings unless ``records`` is given: the recordings were
        made by running this request's model on this request's example."""
        if "records" not in changes and any(k in changes and changes[k] is not getattr(self, k) for k in _RECORDED_ON):
            changes["records"] = None if self.records is None else {}
        if "learned" not in changes and "model" in changes and changes["model"] is not self.model:
            changes["learned"] = Learned()  # what was learned is about this model's code
        return dataclasses.replace(self, **changes)

    def calls(self) -> tuple[ExampleInputs, ExampleInputs]:
        """``(capture_call, prepared_call)`` of the example (:func:`fxprep.core.inputs.split_calls`): what
        the tracer runs the model on (``concrete_args`` included) and how the prepared module is called."""
        assert self.example is not None, "a capture call needs example inputs"
        return split_calls(self.model, self.example, self.concrete_args)


__all__ = ["CaptureRequest", "Learned"]
