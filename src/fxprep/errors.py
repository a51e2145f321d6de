"""The exceptions fxprep raises.

Every failure a user can cause ends in a :class:`FxprepError` subclass whose message says what went
wrong, where, and what to do about it. Exceptions from torch are never left to escape raw: they are
chained (``raise ... from err``) so the original traceback is still there for whoever wants it.

Each public function's ``Raises:`` names the ones it raises; they are public API (docs/version-policy.md).
"""

from __future__ import annotations

from typing import Any


class FxprepError(Exception):
    """Base class of every error fxprep raises on purpose."""


class InvalidInput(FxprepError, TypeError):
    """The arguments given to an fxprep function are of the wrong kind (model, inputs, options)."""


class InputMismatch(InvalidInput):
    """A prepared module was called with inputs structured unlike those it was captured for (list
    lengths, dict keys, None-ness, specialised values or static shapes); the graph would silently
    compute something else, so the call is refused and the message names each difference."""


class UnknownOption(InvalidInput):
    """An option name fxprep does not know; the message lists the known ones."""


class ModelError(FxprepError):
    """The user's own model failed when run eagerly on the example inputs.

    This is not fxprep's failure: the message quotes the model's own error so it can be fixed at
    the source (wrong input shape, wrong dtype, ...).
    """


class TraceFailure(FxprepError):
    """No tracer could capture the model (or the part of it that was asked for).

    ``issues`` holds the diagnosed :class:`fxprep.reporting.diagnose.Issue` objects when there are any.
    """

    def __init__(self, message: str, issues: list[Any] | None = None, attempts: list[Any] | None = None):
        super().__init__(message)
        self.issues = list(issues or [])
        self.attempts = list(attempts or [])


class PassFailure(FxprepError):
    """A preparation pass could not transform the graph. This is a bug in fxprep: please report it."""


class EquivalenceError(FxprepError):
    """The prepared module does not compute what the original does on the example inputs.

    ``max_abs_diff`` is the largest absolute difference found, ``module`` the qualified name of the
    first module whose inputs agree with eager's and whose output does not (an op module such as
    ``...self_attn.sdpa_attention_forward.scaled_dot_product_attention`` included), else of the first leaf module whose
    output diverged (when it could be localised); ``node`` the graph node found that way (a function
    call's node name when it is not a module), ``output_path`` which output differed.
    """

    def __init__(
        self,
        message: str,
        *,
        max_abs_diff: float | None = None,
        module: str | None = None,
        output_path: str | None = None,
        node: str | None = None,
    ):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.module = module
        self.output_path = output_path
        self.node = node


class SerializationError(FxprepError):
    """A saved fxprep directory cannot be written or read back safely."""


class WeightsError(FxprepError):
    """The checkpoint does not fit the prepared module (keys, shapes, dtypes), its index is malformed
    or names a file outside its directory, or a tensor that no checkpoint holds could not be
    recomputed (raised by :func:`fxprep.load_weights`)."""


class ExportError(FxprepError):
    """Exporting a prepared module (ONNX, torch.export) failed."""


class RankFailed(FxprepError):
    """Another rank of a data-parallel :func:`fxprep.run_sequential` failed in a stage (its batches,
    ``on_stage`` or write-back); this rank undid the stage too. The failing rank raises its own error."""


class MissingDependency(FxprepError, ImportError):
    """An optional part of fxprep was used without the package it needs; the message names the
    ``pip install`` line (the extra) that brings it."""


class FxprepWarning(UserWarning):
    """Warnings about behaviour that is valid but likely not what the user wants."""
