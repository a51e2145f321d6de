"""The layout rules of docs/architecture.md, checked: no import circles, one documented job per file."""

from __future__ import annotations

import ast
import re
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
# Known exceptions, each to go (none left: AIMET QuantSim's registration is the adapter's hook, run by
# runtime/toolkits.py, since compat has one adapter contract, fxprep/compat/contract.py).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# What may import an adapter: compat itself and the command above it.
ADAPTER_USERS = ("fxprep.compat", "fxprep.cli")
# The one place outside them that names an adapter, as data: the toolkit hooks' table, read by
# prepare_model and load; the adapter is imported only once its toolkit is (tests/test_compat_contract.py).
ADAPTERS_NAMED = {("fxprep.runtime.toolkits", "fxprep.compat.aimet_quantsim")}


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


def _adapter_names(source: str) -> set[str]:
    """String literals that are the dotted name of ``fxprep.compat`` or a module in it (an import by
    name: ``importlib.import_module("fxprep.compat.nncf")``); a docstring mentioning one is not."""
    return {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and re.fullmatch(r"fxprep\.compat(\.\w+)*", node.value)}


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
    found = {(name, m) for name, path in modules.items() if not _within(name, ADAPTER_USERS)
             for m in _imports(name, path, modules) if _within(m, "fxprep.compat")}
    assert found <= KNOWN_UPWARD, f"an adapter imported from the pipeline: {sorted(found - KNOWN_UPWARD)}"
    named = {(name, m) for name, path in modules.items() if not _within(name, ADAPTER_USERS)
             for m in _adapter_names(path.read_text())}
    assert named == ADAPTERS_NAMED, f"an adapter named outside compat/ (a hook goes in runtime/toolkits.HOOKED): {named}"


def test_the_adapter_check_finds_imports_by_name() -> None:
    source = ('"""Mentions fxprep.compat.aimet in prose."""\nimport importlib\n'
              'importlib.import_module("fxprep.compat.nncf")\nx = "fxprep.compat"\ny = "fxprep.compatible"\n')
    assert _adapter_names(source) == {"fxprep.compat.nncf", "fxprep.compat"}


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


# --- the public API's docstrings: Google-style sections (issue 62) -------------------------------------
# Every public function says its arguments (``Args:``, each parameter by name), what it returns
# (``Returns:``, unless it returns None) and what it raises (``Raises:``: required for everything
# ``fxprep`` exports, and naming each fxprep error a function raises itself). mkdocs renders the
# sections (``docstring_style: google``). Public: ``fxprep.__all__`` (its errors aside), each adapter's
# ``__all__`` in ``fxprep.compat``, and the names the docs call public besides.
PUBLIC_BESIDES = [("fxprep.options", "PrepareOptions"), ("fxprep.passes.to_functional", "run"),
                  ("fxprep.io", "inspect_saved"), ("fxprep.compat.contract", "Adapter"),
                  ("fxprep.compat.llmcompressor.reproduce", "compare_subgraphs")]
# Public classes a user constructs: their constructor's parameters (or dataclass fields) under Args:.
# The others (Report, Stages, SequentialRun, TraceReport, ...) are results fxprep makes.
CONSTRUCTED = {"PrepareOptions", "Ranks", "AsModule", "Adapter"}
_SECTION = re.compile(r"^(Args|Returns|Raises):\s*$")
_ENTRY = re.compile(r"^ {4}(\*{0,2}\w+)\s*(?:\([^)]*\))?:")


def _sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's ``Args`` / ``Returns`` / ``Raises`` sections: each one's entry names
    (``Returns``: its lines)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        if (header := _SECTION.match(line)) is not None:
            current = out.setdefault(header.group(1), [])
        elif line and not line.startswith(" "):
            current = None
        elif current is not None and line.strip():
            entry = _ENTRY.match(line)
            if entry is not None or current is out.get("Returns"):
                current.append(entry.group(1).lstrip("*") if entry else line.strip())
    return out


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if n not in ("self", "cls")]


def _raised_errors(node: ast.AST, errors: set[str]) -> set[str]:
    """The fxprep errors ``node``'s own body raises by name (``raise InvalidInput(...)``)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Raise) and sub.exc is not None:
            call = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
            name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", None)
            if name in errors:
                found.add(name)
    return found


def _docstring_problems(node: ast.AST, *, raises_required: bool, errors: set[str],
                        exceptions: set[str]) -> list[str]:
    """What the docstring of a public function or class lacks (empty: nothing)."""
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    if not doc:
        return ["no docstring"]
    sections = _sections(doc)
    if isinstance(node, ast.ClassDef):
        if node.name not in CONSTRUCTED:
            return []
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        wanted = _parameters(init) if init is not None else [
            n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)]
        missing = [p for p in wanted if p not in sections.get("Args", [])]
        return [f"Args: lacks {missing}"] if missing else []
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    problems = []
    wanted = _parameters(node)
    documented = sections.get("Args", [])
    if wanted and "Args" not in sections:
        problems.append("no Args: section")
    elif missing := [p for p in wanted if p not in documented]:
        problems.append(f"Args: lacks {missing}")
    if stale := [p for p in documented if p not in wanted]:
        problems.append(f"Args: names {stale}, not parameters")
    if node.returns is not None and ast.unparse(node.returns) != "None" and not sections.get("Returns"):
        problems.append("no Returns: section")
    raised = _raised_errors(node, errors)
    if (raises_required or raised) and not sections.get("Raises"):
        problems.append(f"no Raises: section{f' (it raises {sorted(raised)})' if raised else ''}")
    elif missing := sorted(raised - set(sections.get("Raises", []))):
        problems.append(f"Raises: lacks {missing}")
    if unknown := [e for e in sections.get("Raises", []) if e not in exceptions]:
        problems.append(f"Raises: names {unknown}, not exceptions")
    return problems


def _definition(module: str, name: str, modules: dict[str, Path]) -> tuple[str, ast.AST] | None:
    """Where ``module.name`` is defined: ``(module, node)``, following ``from .x import name``."""
    path = modules[module]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
        if isinstance(node, ast.ImportFrom) and node.level and any(a.name == name and not a.asname for a in node.names):
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            return _definition(source, name, modules) if source in modules else None
    return None


def _public_api(modules: dict[str, Path]) -> dict[str, tuple[str, ast.AST, bool]]:
    """``dotted name -> (defining module, definition, Raises: required)`` of every public callable."""
    init = ast.parse(modules["fxprep"].read_text())
    values = {t.id: node.value for node in init.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
    lazy, exported = ast.literal_eval(values["_LAZY"]), ast.literal_eval(values["__all__"])
    wanted = [(f"fxprep.{lazy[name]}", name, True) for name in exported if name in lazy]
    wanted += [(module, name, False) for module, name in PUBLIC_BESIDES]
    for module in sorted(modules):
        if module.count(".") == 2 and module.startswith("fxprep.compat.") and module != "fxprep.compat.contract":
            assigned = {t.id: node.value for node in ast.parse(modules[module].read_text()).body
                        if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
            wanted += [(module, name, False) for name in ast.literal_eval(assigned.get("__all__", ast.List([])))]
    out = {}
    for module, name, raises_required in wanted:
        found = _definition(module, name, modules)
        if found is not None:  # a constant (ADAPTER, PIPELINE) has no definition to check
            out[f"{module}.{name}"] = (*found, raises_required)
    return out


def test_public_functions_say_their_arguments_returns_and_raises() -> None:
    import builtins

    from fxprep import errors

    modules = _modules()
    error_names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.FxprepError)}
    exceptions = error_names | {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    api = _public_api(modules)
    assert {"fxprep.api.prepare_model", "fxprep.io.load", "fxprep.big.partition.partition", "fxprep.view.show",
            "fxprep.compat.nncf.quantize", "fxprep.compat.llmcompressor.fxprep_subgraphs",
            "fxprep.options.PrepareOptions", "fxprep.passes.to_functional.run"} <= set(api), sorted(api)
    problems = {name: found for name, (_, node, required) in api.items()
                if (found := _docstring_problems(node, raises_required=required, errors=error_names,
                                                 exceptions=exceptions))}
    assert problems == {}, f"give these Google-style sections (Args:, Returns:, Raises:): {problems}"


def test_the_docstring_section_check_finds_what_is_missing() -> None:
    source = '''
def f(a, b, *rest, flag=False, **options) -> int:
    """Sum.

    Args:
        a: One.
        *rest: More.
        flag: A flag.
        c: Not a parameter.
    """
    raise InvalidInput("no")

def g(x) -> None:
    """Nothing back.

    Args:
        x: X.

    Raises:
        ValueError: Never.
        Bogus: Not an exception.
    """

class Ranks:
    """Built by users.

    Args:
        source: Here.
    """
    def __init__(self, source, group=None):
        pass
'''
    f, g, ranks = ast.parse(source).body
    exceptions = {"InvalidInput", "ValueError"}
    assert _docstring_problems(f, raises_required=False, errors={"InvalidInput"}, exceptions=exceptions) == [
        "Args: lacks ['b', 'options']", "Args: names ['c'], not parameters", "no Returns: section",
        "no Raises: section (it raises ['InvalidInput'])"]
    assert _docstring_problems(g, raises_required=True, errors=set(), exceptions=exceptions) == [
        "Raises: names ['Bogus'], not exceptions"]
    assert _docstring_problems(ranks, raises_required=False, errors=set(), exceptions=exceptions) == [
        "Args: lacks ['group']"]


def test_the_public_modules_link_their_docs_page() -> None:
    """A module defining public API says where its story is: a ``docs/`` page named in its docstring."""
    modules = _modules()
    public = {module for module, _, _ in _public_api(modules).values()}
    public |= {m for m in modules if _within(m, "fxprep.compat")}
    unlinked = sorted(m for m in public if "docs/" not in (ast.get_docstring(ast.parse(modules[m].read_text())) or ""))
    assert unlinked == [], f"name the docs page (concept, guide or hand-off) in these module docstrings: {unlinked}"
