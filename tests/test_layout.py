"""The layout rules of docs/architecture.md, checked: no import circles, one documented job per file."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fxprep"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fxprep modules ``name`` imports, at module level or inside functions."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parent = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for alias in node.names:
                child = f"{parent}.{alias.name}"
                found.add(child if child in modules else parent)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_file_has_one_documented_job() -> None:
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{name} has no module docstring saying what it owns"
        assert len(path.read_text().splitlines()) <= MAX_LINES, f"{name} is over {MAX_LINES} lines: split it"


def test_capture_passes_and_io_do_not_import_the_command_line() -> None:
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("fxprep.cli"):
            assert not {m for m in _imports(name, path, modules) if m.startswith("fxprep.cli")}, name


# The package grouped by role (issue 62, tools/regroup.py): these rules keep the layout true.

# The root: the public entry points, and the modules whose dotted names saves and prepared graphs
# carry (fxprep.ops.*, fxprep.cond.cond, fxprep.decisions.check_decision) or the docs name as
# public (fxprep.options.PrepareOptions). Anything else has a role below.
ROOT_FILES = {"__init__.py", "api.py", "errors.py", "options.py", "version.py", "ops.py", "cond.py", "decisions.py",
              "py.typed"}
ROLES = {
    "core",        # the user's model touched without changing it: inputs, runs, paths, threads, heap
    "reporting",   # the Report, notes, diagnose, progress
    "runtime",     # what a prepared module runs and carries
    "capture",     # tracers (dynamo/, rewrite/, shapes/)
    "families",    # model-family knowledge (transformers/)
    "passes",      # GraphModule -> GraphModule
    "verify",      # original vs prepared
    "pipeline",    # prepare_model's shared state and stages; check_traceability
    "big",         # weights after a meta prepare, checkpoints, stages, placement, run_sequential
    "io",          # save / load, ONNX and torch.export
    "compat",      # hand-off adapters
    "cli",         # the fxprep command
    "view",        # fxprep.show
}
# What the layers below the orchestrator never import (they are imported by it, or by the user).
UPPER = ("fxprep.api", "fxprep.pipeline", "fxprep.cli", "fxprep.compat", "fxprep.view")
LOWER = ("fxprep.core", "fxprep.reporting", "fxprep.runtime", "fxprep.capture", "fxprep.families", "fxprep.passes",
         "fxprep.verify", "fxprep.big", "fxprep.ops", "fxprep.cond", "fxprep.decisions", "fxprep.errors")
# Known exceptions, each to go: AIMET QuantSim's registration is called by api (and by io.load through
# api.register_with_toolkits) until compat has one adapter contract the pipeline does not import.
KNOWN_UPWARD = {("fxprep.api", "fxprep.compat.aimet_quantsim"), ("fxprep.io", "fxprep.api")}


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ((prefixes,) if isinstance(prefixes, str) else prefixes))


def test_the_package_root_holds_only_its_handful_of_files() -> None:
    files = {p.name for p in PACKAGE.iterdir() if p.is_file()}
    assert files <= ROOT_FILES, f"give these a role package (docs/architecture.md): {sorted(files - ROOT_FILES)}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= ROLES, f"a package with no role in docs/architecture.md: {sorted(folders - ROLES)}"


def test_no_transformers_file_outside_families() -> None:
    stray = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if (p.name.startswith(("hf_", "huggingface")) and "families" not in p.parts)]
    assert stray == [], f"transformers knowledge lives in families/transformers/: {stray}"


def _family_imports(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, module) for each import of a family's own module (``fxprep.families.<family>...``)
    from outside ``fxprep/families/``: the rest of fxprep asks the registry, ``fxprep.families``."""
    return {(name, m) for name, path in modules.items() if not _within(name, "fxprep.families")
            for m in _imports(name, path, modules) if _within(m, "fxprep.families") and m != "fxprep.families"}


def test_only_the_registry_knows_the_families() -> None:
    found = _family_imports(_modules())
    assert found == set(), f"ask the family registry (fxprep.families.family_for), not a family: {sorted(found)}"


def test_the_family_check_finds_a_direct_import(tmp_path: Path) -> None:
    stray = tmp_path / "cascade.py"
    stray.write_text("from ..families import family_for\nfrom ..families.transformers import model\n")
    assert _family_imports({**_modules(), "fxprep.capture.cascade": stray}) == {
        ("fxprep.capture.cascade", "fxprep.families.transformers.model")}


def test_the_registry_imports_no_family_and_names_each_one() -> None:
    """The registry (fxprep/families/__init__.py) is the contract the rest of fxprep imports: it
    imports nothing of fxprep (a family imports capture/ and big/ helpers, and they import it), and
    lists every family folder once (FAMILIES), each exporting FAMILY."""
    import fxprep.families as registry

    modules = _modules()
    assert _imports("fxprep.families", modules["fxprep.families"], modules) == set()
    folders = {p.name for p in (PACKAGE / "families").iterdir() if (p / "__init__.py").is_file()}
    assert set(registry.FAMILIES) == folders and len(registry.FAMILIES) == len(folders)
    assert all(isinstance(f, registry.Family) and f is not registry.NEUTRAL for f in registry.known())


def test_the_pipeline_never_imports_an_adapter() -> None:
    modules = _modules()
    found = {(name, m) for name, path in modules.items() if not _within(name, "fxprep.compat")
             for m in _imports(name, path, modules) if _within(m, "fxprep.compat")}
    assert found <= KNOWN_UPWARD, f"an adapter imported from the pipeline: {sorted(found - KNOWN_UPWARD)}"


def test_lower_layers_do_not_import_upper_ones() -> None:
    modules = _modules()
    found = {(name, m) for name, path in modules.items() if _within(name, LOWER)
             for m in _imports(name, path, modules) if _within(m, UPPER)}
    found |= {(name, m) for name, path in modules.items() if _within(name, "fxprep.io")
              for m in _imports(name, path, modules) if _within(m, UPPER)}
    assert found <= KNOWN_UPWARD, f"imports pointing up: {sorted(found - KNOWN_UPWARD)}"


def test_core_and_the_graph_vocabulary_use_nothing_above_them() -> None:
    modules = _modules()
    allowed = {
        "fxprep.core": ("fxprep.core", "fxprep.errors"),
        "fxprep.errors": (),
        "fxprep.cond": (),
        "fxprep.decisions": ("fxprep.errors",),
        "fxprep.ops": ("fxprep.runtime.wrap",),
        "fxprep.runtime": ("fxprep.runtime", "fxprep.reporting", "fxprep.core", "fxprep.errors", "fxprep.decisions",
                           "fxprep.ops", "fxprep.cond"),
    }
    for name, path in modules.items():
        for owner, ok in allowed.items():
            if _within(name, owner):
                bad = {m for m in _imports(name, path, modules) if not _within(m, ok) and m != "fxprep"}
                assert not bad, f"{name} imports {sorted(bad)}: {owner} depends on {ok or 'nothing of fxprep'}"


def test_the_regroup_script_and_these_rules_agree_on_the_root() -> None:
    """tools/regroup.py moves everything but its ROOT out of the package root: the same set as above."""
    tree = ast.parse((PACKAGE.parents[1] / "tools" / "regroup.py").read_text())
    root = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "ROOT" for t in node.targets))
    assert set(root) | {"py.typed"} == ROOT_FILES


# Route names (capture/routes.py) compared as strings: `tracer == "dynamo"`, `tracer in ("fx", ...)`,
# `tracer.startswith("dynamo")`, `tracer.split("+")`. A route is asked what it is instead
# (`Route(tracer).dynamo`), so a new route is one member of Route plus its capture function.
ROUTES_FILE = PACKAGE / "capture" / "routes.py"
_STRING_METHODS = {"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "replace", "removeprefix",
                   "removesuffix"}


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for element in node.elts for s in _literals(element)}
    return set()


def _route_name_uses(source: str, names: set[str]) -> list[int]:
    """Lines comparing with a route's name, or taking one apart by string methods (``"+"`` included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_literals(side) & names for side in [node.left, *node.comparators]):
            found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STRING_METHODS
              and any(_literals(arg) & (names | {"+"}) for arg in node.args)):
            found.append(node.lineno)
    return found


def test_route_names_are_compared_only_in_the_route_table() -> None:
    from fxprep.capture.routes import Route

    names = {route.value for route in Route}
    found = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py") if path != ROUTES_FILE
             if (lines := _route_name_uses(path.read_text(), names))}
    assert found == {}, f"ask the route (capture/routes.Route: .dynamo, .leaves, .values), not its name: {found}"


def test_the_route_check_finds_comparisons() -> None:
    names = {"dynamo", "fx"}
    source = ("a = t == 'dynamo'\nb = t in ('fx', 'x')\nc = t.startswith('dynamo')\nd = t.split('+')[0]\n"
              "e = t == other\nf = t.startswith('torch.')\n")
    assert _route_name_uses(source, names) == [1, 2, 3, 4]


def test_the_input_guard_spells_dynamo_rules_as_the_route_does() -> None:
    """runtime/ does not import capture/: its saved spelling of Dynamo's rules is kept equal here."""
    from fxprep.capture.routes import Route
    from fxprep.runtime.guard import DYNAMO_RULES

    assert DYNAMO_RULES == Route.DYNAMO.value


# --- lint that checks what it says ---------------------------------------------------------------------
REPO = PACKAGE.parents[1]
LINTED = ("src", "tests", "benchmarks", "tools")


def _unexplained_broad_excepts(text: str) -> list[int]:
    """Lines silencing ruff's blind-except rule without saying why (``# noqa: BLE001 - why``)."""
    marker = "# noqa: " + "BLE001"  # spelled apart: this file names the marker without being one
    return [n for n, line in enumerate(text.splitlines(), 1)
            if marker in line and not line.split(marker, 1)[1].startswith(" - ")]


def test_broad_excepts_are_checked_by_ruff_and_each_is_explained() -> None:
    import tomllib

    lint = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "BLE" in lint["select"]  # else every `noqa: BLE001` silences a rule that is not run
    bad = [f"{path.relative_to(REPO)}:{n}" for folder in LINTED for path in sorted((REPO / folder).rglob("*.py"))
           for n in _unexplained_broad_excepts(path.read_text())]
    assert not bad, f"say why each broad except is needed (`# noqa: BLE001 - why`), or narrow it: {bad}"


def test_the_broad_except_check_finds_one_without_a_reason() -> None:
    marker = "# noqa: " + "BLE001"
    assert _unexplained_broad_excepts(f"try:\n    x()\nexcept Exception:  {marker}\n    pass\n") == [3]
    assert _unexplained_broad_excepts(f"except Exception:  {marker} - best effort\n") == []

# Docstrings that read fast (issue 62): a module docstring says what the file is for and why, in a
# short paragraph, and points at the docs page with the full story (design, examples, timings,
# history live in docs/, not in code). No docstring at all is an essay.
MAX_MODULE_DOC_WORDS = 150
MAX_DOC_WORDS = 300
# Files other branches were editing when the rule came in; their docstrings are shortened there.
# Empty this set as they are: an entry that is short enough already fails the test below.
LONG_DOCSTRINGS_ALLOWED: set[tuple[str, str]] = set()


def _long_docstrings(source: str, module_limit: int = MAX_MODULE_DOC_WORDS,
                     limit: int = MAX_DOC_WORDS) -> list[tuple[str, int]]:
    """(name, words) of the module docstring over ``module_limit`` words and any docstring over ``limit``."""
    tree = ast.parse(source)
    found = []
    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc.split()) > min(module_limit, limit):
        found.append(("<module>", len(module_doc.split())))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) > limit:
                found.append((node.name, len(doc.split())))
    return found


def test_docstrings_are_short() -> None:
    found = {(str(path.relative_to(PACKAGE)), name): words for path in PACKAGE.rglob("*.py")
             for name, words in _long_docstrings(path.read_text())}
    new = {key: words for key, words in found.items() if key not in LONG_DOCSTRINGS_ALLOWED}
    assert new == {}, (f"docstrings over {MAX_MODULE_DOC_WORDS} words (module) or {MAX_DOC_WORDS} (any): {new}; "
                       "say what the file is for and move the story to its docs/ page")
    assert LONG_DOCSTRINGS_ALLOWED <= set(found), f"short now, drop from the allow-set: {LONG_DOCSTRINGS_ALLOWED - set(found)}"


def test_the_docstring_check_finds_long_ones() -> None:
    essay = " ".join(["word"] * 151)
    source = f'"""{essay}"""\n\ndef f():\n    """{essay} {essay}"""\n\nclass C:\n    """short"""\n'
    assert _long_docstrings(source) == [("<module>", 151), ("f", 302)]
    assert _long_docstrings('"""A short one."""\n') == []
# --- test files share helpers through helper modules, never through each other -----------------------------
REPO = PACKAGE.parents[1]


def _test_module_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of each import of a ``tests`` test module (``test_*.py``) in ``source``, a module
    of ``package`` (``tests``, ``tests.llmcompressor``, ``benchmarks``), at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names
                  if name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_")]
    return found


def test_no_file_imports_a_test_module() -> None:
    """A helper two test files share lives in tests/helpers*.py (fixtures in tests/conftest.py, model
    lists in tests/zoo_models.py): importing a test module couples the files and runs its module-level
    code (and hands over its autouse fixtures) wherever it is imported."""
    found = {}
    for path in [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        package = ".".join(path.parent.relative_to(REPO).parts)
        if lines := _test_module_imports(path.read_text(), package):
            found[str(path.relative_to(REPO))] = lines
    assert found == {}, f"move what these import into tests/helpers*.py or tests/conftest.py: {found}"


def test_the_test_import_check_finds_them() -> None:
    source = ("from .test_io import _edit\nfrom tests.test_io import Tied\nfrom tests import test_zoo, zoo_models\n"
              "import tests.test_cli\nfrom . import test_docs\nfrom .helpers_io import _edit\nfrom tests import helpers\n"
              "def f():\n    from ..test_docs import run_page\n    import test_utils\n")
    assert _test_module_imports(source, "tests.llmcompressor") == [
        (1, "tests.llmcompressor.test_io"), (2, "tests.test_io"), (3, "tests.test_zoo"), (4, "tests.test_cli"),
        (5, "tests.llmcompressor.test_docs"), (9, "tests.test_docs")]
