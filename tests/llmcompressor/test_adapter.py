"""The llm-compressor adapter's contract, checked where llm-compressor is installed (its own
environment; tests/test_compat_contract.py checks the other adapters in the main one)."""

from __future__ import annotations

import fxprep.compat.llmcompressor as adapter_module
from fxprep.compat.contract import Adapter


def test_the_llmcompressor_adapter_exposes_its_adapter() -> None:
    adapter = adapter_module.ADAPTER
    assert isinstance(adapter, Adapter)
    assert adapter.available()
    for entry in adapter.entry_points:
        assert callable(getattr(adapter_module, entry)), entry
