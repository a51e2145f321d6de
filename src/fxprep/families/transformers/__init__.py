"""transformers: cache off, attention implementation, config inputs, output recorders,
methods rewritten for capture, hub checkpoints. Nothing here imports
``transformers`` unless the model is a transformers model. ``FAMILY`` is what the
registry (:mod:`fxprep.families`) hands out for one.
"""

from .family import FAMILY

__all__ = ["FAMILY"]
