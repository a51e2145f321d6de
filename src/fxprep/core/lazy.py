"""A ``GraphModule`` whose Python code is generated when it is first needed, not when it is made.

``torch.fx.GraphModule.__init__`` generates and compiles the graph's code (its ``forward``) at once.
fxprep often builds a GraphModule only to hand its graph on: the fx capture's module becomes the
prepared module (which the passes rewrite and then recompile once), and a partition makes a stage per
block that a runner may never call. Generating that code was a fifth of making a 7B's 33 stages and
three generations of the same graph on one fx capture. :class:`LazyGraphModule` defers it: calling
the module, reading its ``forward``, ``code`` or ``_code``, or ``recompile()`` generates it, so it
behaves as fx's own everywhere it is used.

torch has ``torch.fx._lazy_graph_module`` for this; it is private and its switch is process-wide.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx


class _GeneratedOnRead:
    """``forward`` until the code exists: reading it generates the code, which installs fx's own
    ``forward`` on the module's class (a non-data descriptor, so an instance's own ``forward`` still wins)."""

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        obj.recompile()
        return type(obj).forward.__get__(obj, type(obj))


class LazyGraphModule(fx.GraphModule):
    """A ``GraphModule`` that generates its code on first use (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # fx's __init__ generates the code through the ``graph`` setter, which calls recompile()
        self.__dict__["_making"] = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            del self.__dict__["_making"]

    def recompile(self) -> Any:
        if self.__dict__.get("_making"):
            return None
        return super().recompile()

    forward = _GeneratedOnRead()

    @property
    def generated(self) -> bool:
        """Whether the code has been generated."""
        return "_code" in self.__dict__

    def __getattr__(self, name: str) -> Any:
        if name == "_code" and "_making" not in self.__dict__ and "_graph" in self.__dict__:
            self.recompile()
            return self.__dict__["_code"]
        return super().__getattr__(name)
