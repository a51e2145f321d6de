"""Capture: turn a model into one torch-level, module-level GraphModule.

Each tracer lives in its own module, takes a :class:`CaptureRequest` (the model, example, leaf
policy and options, as one object) and returns a :class:`CaptureResult`; ``api.py`` runs the
cascade (:mod:`.cascade`). Whatever the tracer, the result's leaf ``call_module`` nodes point at the user's own module
objects and its ``get_attr`` nodes at the user's own tensors.
"""

from ..reporting.report import CaptureAttempt
from .common import CaptureResult, LeafPolicy
from .request import CaptureRequest

__all__ = ["CaptureAttempt", "CaptureRequest", "CaptureResult", "LeafPolicy", "dynamo_available"]


def dynamo_available() -> bool:
    """Whether the Dynamo capture can run in this torch (its import is deferred: it is large)."""
    try:
        from . import dynamo  # noqa: F401
    except ImportError:
        return False
    return True
