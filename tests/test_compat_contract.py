"""The adapter contract (fxprep/compat/contract.py): every adapter under ``fxprep.compat`` defines
``ADAPTER``, says what to install as ``pyproject.toml`` does, and the toolkit hooks the pipeline runs
(fxprep/runtime/toolkits.py) are the adapters' own, so AIMET QuantSim takes a prepared or loaded
module with no adapter imported by the user."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fxprep.compat.contract import Adapter
from fxprep.runtime import toolkits

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "src" / "fxprep" / "compat"
NOT_ADAPTERS = {"__init__.py", "contract.py"}


def _adapter_sources() -> dict[str, Path]:
    """``fxprep.compat.<name>`` -> its source (a package's ``__init__.py``): every adapter, found on disk."""
    out = {}
    for path in sorted(COMPAT.iterdir()):
        if path.is_file() and path.suffix == ".py" and path.name not in NOT_ADAPTERS:
            out[f"fxprep.compat.{path.stem}"] = path
        elif path.is_dir() and (path / "__init__.py").is_file():
            out[f"fxprep.compat.{path.name}"] = path / "__init__.py"
    return out


def _declared(path: Path) -> tuple[dict[str, object], set[str], list[str] | None]:
    """The module-level ``ADAPTER = Adapter(...)``'s keyword arguments (literals; a name as ``<name>``),
    the names the module defines or imports at module level, and its ``__all__``."""
    tree = ast.parse(path.read_text())
    fields: dict[str, object] = {}
    names: set[str] = set()
    exported = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
            names |= targets
            if "__all__" in targets:
                exported = ast.literal_eval(node.value)
            if "ADAPTER" in targets and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "Adapter":
                for keyword in node.value.keywords:
                    value = keyword.value
                    fields[str(keyword.arg)] = f"<{value.id}>" if isinstance(value, ast.Name) else ast.literal_eval(value)
    return fields, names, exported


def test_every_adapter_declares_the_contract() -> None:
    adapters = _adapter_sources()
    assert {"fxprep.compat.aimet", "fxprep.compat.nncf", "fxprep.compat.llmcompressor"} <= set(adapters)
    required = {"toolkit", "module", "requires", "entry_points", "page"}
    for name, path in adapters.items():
        fields, names, exported = _declared(path)
        assert fields, f"{name}: no module-level `ADAPTER = Adapter(...)` (fxprep/compat/contract.py)"
        assert required <= set(fields), f"{name}: ADAPTER lacks {sorted(required - set(fields))}"
        missing = [entry for entry in fields["entry_points"] if entry not in names]  # type: ignore[union-attr]
        assert not missing, f"{name}: ADAPTER names entry points the module does not define: {missing}"
        assert exported is None or "ADAPTER" in exported, f"{name}: put ADAPTER in __all__"
        assert (REPO / "docs" / str(fields["page"])).is_file(), f"{name}: no docs page {fields['page']}"


def test_what_an_adapter_requires_is_what_pyproject_states() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    stated = {requirement for group in extras.values() for requirement in group}
    for name, path in _adapter_sources().items():
        requires = _declared(path)[0]["requires"]
        assert requires == "" or requires in stated, f"{name}: requires {requires!r}, pyproject.toml states none such"


def test_the_hooks_the_pipeline_runs_are_the_adapters_own() -> None:
    """runtime/toolkits.HOOKED lists exactly the adapters whose ADAPTER has a hook, by their toolkit."""
    hooked = {str(fields["module"]): name for name, path in _adapter_sources().items()
              if "hook" in (fields := _declared(path)[0])}
    assert hooked == toolkits.HOOKED


# llm-compressor pins its own torch and transformers: its adapter is checked in its environment
# (tests/llmcompressor/test_adapter.py, `make test-llmcompressor`); every other toolkit is a test dependency here
OWN_ENVIRONMENT = {"fxprep.compat.llmcompressor"}


@pytest.mark.parametrize("name", sorted(set(_adapter_sources()) - OWN_ENVIRONMENT))
def test_an_adapter_exposes_its_adapter(name: str) -> None:
    """``name``'s toolkit imports, and its ADAPTER says so and lists entry points it has."""
    importlib.import_module(str(_declared(_adapter_sources()[name])[0]["module"]))
    adapter = importlib.import_module(name).ADAPTER
    assert isinstance(adapter, Adapter)
    assert adapter.available()
    for entry in adapter.entry_points:
        assert callable(getattr(importlib.import_module(name), entry)), (name, entry)


def test_available_says_whether_the_toolkit_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Adapter("t", "fxprep_no_such_toolkit", "", (), "index.md").available() is False
    assert Adapter("t", "fxprep_no_such.package", "", (), "index.md").available() is False
    monkeypatch.setitem(sys.modules, "json", None)  # a module blocked the way tests block aimet_torch
    assert Adapter("t", "json", "", (), "index.md").available() is False


def test_run_hooks_runs_a_hook_only_while_its_toolkit_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    adapter = types.ModuleType("fake_adapter")
    adapter.ADAPTER = Adapter("Fake", "fake_toolkit", "", (), "index.md", hook=lambda: calls.append("hook"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_adapter", adapter)
    monkeypatch.setattr(toolkits, "HOOKED", {"fake_toolkit": "fake_adapter"})
    toolkits.run_hooks()
    assert calls == []
    monkeypatch.setitem(sys.modules, "fake_toolkit", types.ModuleType("fake_toolkit"))
    toolkits.run_hooks()
    assert calls == ["hook"]


QUANTSIM = """
import sys, torch
import aimet_torch
from aimet_torch.quantsim import QuantizationSimModel
import fxprep
from fxprep.cli.demo import ModelWithElementwiseAddOp as M
x = (torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8))
assert not [m for m in sys.modules if m.startswith("fxprep.compat")]
{make}
QuantizationSimModel(gm, dummy_input=x)
print("accepted", "fxprep.compat.aimet_quantsim" in sys.modules)
"""


def test_quantsim_takes_a_prepared_and_a_loaded_module_with_no_adapter_imported(tmp_path: Path) -> None:
    """docs/handoff/aimet.md's flow: ``aimet_torch`` and ``fxprep`` imported, no adapter; prepare_model
    (and load) run AIMET's hook through runtime/toolkits.py, else QuantSim refuses fxprep's op classes."""
    import aimet_torch  # noqa: F401 - a test dependency: this test runs where it is installed
    save = "import torch, fxprep\nfrom fxprep.cli.demo import ModelWithElementwiseAddOp as M\n" \
           f"fxprep.save(fxprep.prepare_model(M().eval(), example_inputs=(torch.randn(1, 3, 8, 8),) * 2), {str(tmp_path / 's')!r})\n"
    done = subprocess.run([sys.executable, "-c", save], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for make in ("gm = fxprep.prepare_model(M().eval(), example_inputs=x)", f"gm = fxprep.load({str(tmp_path / 's')!r})"):
        out = subprocess.run([sys.executable, "-c", QUANTSIM.format(make=make)], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (make, out.stderr[-2000:])
        assert out.stdout.split()[-2:] == ["accepted", "True"], out.stdout
