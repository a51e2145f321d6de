"""The one contract every hand-off adapter keeps: a module-level ``ADAPTER = Adapter(...)``.

Each module or package directly under ``fxprep.compat`` says in it which toolkit it serves, what
to install, its entry points, and the hook :mod:`fxprep.runtime.toolkits` runs after
``prepare_model`` and ``load`` once the toolkit is imported (the pipeline imports no adapter).
``tests/test_compat_contract.py`` checks every adapter against it.

See docs/architecture.md ("Where to add things": a new toolkit adapter).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Adapter:
    """What one adapter hands graphs to, and how.

    Args:
        toolkit: The toolkit's name as its users say it (``"NNCF"``).
        module: The toolkit's import name (``"nncf"``); ``"torch"`` for an adapter needing nothing more.
        requires: What to install, a pip requirement with the supported range (``"nncf>=3.4"``, as
            ``pyproject.toml`` states it); empty where torch is enough.
        entry_points: The adapter's public functions and classes, by name.
        page: The docs page of the hand-off, relative to ``docs/``.
        hook: Run after ``prepare_model`` and ``load`` while the toolkit is imported (listed in
            :data:`fxprep.runtime.toolkits.HOOKED`); idempotent.
    """

    toolkit: str
    module: str
    requires: str
    entry_points: tuple[str, ...]
    page: str
    hook: Callable[[], object] | None = None

    def available(self) -> bool:
        """Whether the toolkit can be imported here, found without importing it.

        Returns:
            True when ``module`` is installed (and not blocked by ``sys.modules[module] = None``).
        """
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module without a spec
            return False
