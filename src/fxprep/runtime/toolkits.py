"""The toolkits' hooks a prepared module's making runs: after ``prepare_model`` and ``load``.

AIMET's QuantSim finds a quantized twin by a module's exact class, so fxprep's op classes must be
registered with it before a prepared module reaches it, and its documented flow imports only
``aimet_torch`` and ``fxprep``. The pipeline imports no adapter: :data:`HOOKED` names, as data, each
adapter whose ``ADAPTER.hook`` must run then (:mod:`fxprep.compat.contract`), and it is imported
only once its toolkit is (importing a toolkit costs seconds).

See docs/architecture.md (the ``compat/`` row).
"""

from __future__ import annotations

import importlib
import sys

#: toolkit import name -> the adapter module whose ``ADAPTER.hook`` runs while that toolkit is imported
HOOKED: dict[str, str] = {
    "aimet_torch": "fxprep.compat.aimet_quantsim",  # fxprep's op classes registered with QuantSim
}


def run_hooks() -> None:
    """Run the hook of every adapter in :data:`HOOKED` whose toolkit is imported; import no toolkit."""
    for toolkit, adapter in HOOKED.items():
        if sys.modules.get(toolkit) is not None:
            hook = importlib.import_module(adapter).ADAPTER.hook
            if hook is not None:
                hook()
