#!/usr/bin/env python3
"""Regroup ``src/fxprep`` by role (issue 62): every move a ``git mv``, every reference rewritten.

Run at the root of a clean checkout (after the branches that touch the moved files are merged)::

    python tools/regroup.py --dry-run   # what it would move and rewrite, nothing changed
    python tools/regroup.py             # git mv, new package docstrings, references, ruff's import sort

Idempotent: a second run finds every file at its new place and nothing left to rewrite. It refuses to
start (exit 2, listing them) when a module at the package root, or a ``capture/hf_*.py``, is in
neither :data:`MOVES` nor :data:`ROOT`: a module another branch added needs a place here first.

What it rewrites, in every tracked text file but ``CHANGELOG.md`` (history) and this one:

* Python imports, by their syntax tree: relative ones in ``src/`` (resolved from where the file was,
  written from where it is), absolute ``from fxprep... import`` anywhere; a moved *submodule* imported
  by name from its package (``from . import shape_general``) is imported from its new package, under
  its old name when it was renamed (``from .capture.shapes import general as shape_general``);
* dotted names ``fxprep.a.b`` anywhere (absolute imports, ``import fxprep.x``, strings such as
  ``monkeypatch.setattr("fxprep.x.y", ...)``, ``python -m fxprep.x``, mkdocstrings' ``::: fxprep.x``,
  Sphinx roles, mypy's override lists in pyproject.toml); ``fxprep.partition`` and ``fxprep.opaque``
  (public functions named like their old modules) only where they name the module (``.attr``
  following, an import, a whole string in a config file);
* relative Sphinx roles in docstrings (``:mod:`.hf_source```), like relative imports;
* file paths ``src/fxprep/x.py``, ``fxprep/x.py`` and ``capture/hf_x.py`` (a moved file's path from
  the package root, with its folder);
* ``fxprep/__init__.py``'s ``_LAZY`` table (public name -> submodule, relative);
* mkdocstrings' ``::: fxprep.report.Report`` of a moved module's public name as ``::: fxprep.Report``;
* the code that finds the package from its own file's folder (:data:`FIXUPS`); any other moved file
  using ``__file__`` is named at the end, to be looked at;
* then ``ruff check --fix --select I001`` on the Python files it changed (an import's sort order
  follows its module's name).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path("src/fxprep")

# What stays at the package root: the public entry points, and the modules whose dotted names a save
# or a prepared graph's code carries (fxprep.ops.*, fxprep.cond.cond, fxprep.decisions.check_decision:
# moving them changes the save format, docs/version-policy.md) or the docs name as public
# (fxprep.options.PrepareOptions).
ROOT = ("__init__.py", "api.py", "errors.py", "options.py", "version.py", "ops.py", "cond.py", "decisions.py")

# old path -> new path, both relative to src/fxprep
MOVES: dict[str, str] = {
    # core/: how fxprep touches the user's model without changing it; used by every layer
    "inputs.py": "core/inputs.py",
    "runs.py": "core/runs.py",
    "paths.py": "core/paths.py",
    "threads.py": "core/threads.py",
    "heap.py": "core/heap.py",
    "frames.py": "core/frames.py",  # issue 61
    # pipeline/: what prepare_model's stages share, the stages that are more than a call, and its
    # sibling entry point check_traceability
    "arguments.py": "pipeline/arguments.py",
    "preparation.py": "pipeline/state.py",
    "root_hooks.py": "pipeline/root_hooks.py",
    "verification_stage.py": "pipeline/verification.py",
    "check.py": "pipeline/traceability.py",
    # capture/: the shape-general capture and the batch probe run the routes (beside cascade.py);
    # capture/shapes/: the dims they declare, reasoned about without running Dynamo (Dynamo's own
    # capture imports these, so they import nothing of capture/dynamo/: guard_read, guard_log,
    # early_limit and branches read Dynamo's guards and stay there)
    "shape_general.py": "capture/shape_general.py",
    "batch.py": "capture/batch.py",
    "capture/dynamo/autodims.py": "capture/shapes/autodims.py",
    "capture/dynamo/shapes.py": "capture/shapes/dims.py",
    "capture/dynamo/violation.py": "capture/shapes/violation.py",
    "capture/dynamo/guard_range.py": "capture/shapes/guard_range.py",
    # one basename once: the model's branches on a size, read from Dynamo's guards (capture/rewrite/
    # has its own branches.py: torch.cond branches after capture)
    "capture/dynamo/branches.py": "capture/dynamo/size_branches.py",
    # families/transformers/: everything that knows transformers
    "capture/huggingface.py": "families/transformers/model.py",
    "capture/hf_attention.py": "families/transformers/attention.py",
    "capture/hf_checks.py": "families/transformers/compilable_checks.py",
    "capture/hf_source.py": "families/transformers/methods.py",
    "capture/hf_unpadded.py": "families/transformers/unpadded.py",
    "capture/recorders.py": "families/transformers/recorders.py",
    "hf_weights.py": "families/transformers/hub_layout.py",
    # runtime/: what a prepared module runs and carries
    "prepared.py": "runtime/prepared.py",
    "forward_code.py": "runtime/forward_code.py",
    "guard.py": "runtime/guard.py",
    "wrap.py": "runtime/wrap.py",
    "opaque.py": "runtime/opaque.py",
    "baked.py": "runtime/baked.py",  # issue 63
    "modes.py": "runtime/modes.py",  # issue 63
    # verify/: original vs prepared (which sizes to verify on is the pipeline's verification stage)
    "verify.py": "verify/__init__.py",
    "compare.py": "verify/compare.py",
    "locate_node.py": "verify/locate_node.py",
    "attention_calls.py": "verify/attention_calls.py",
    # big/: models bigger than the device (weights after a meta prepare, stages, placement)
    "weights.py": "big/weights.py",
    "checkpoint.py": "big/checkpoint.py",
    "recompute.py": "big/recompute.py",
    "stand_ins.py": "big/stand_ins.py",
    "partition.py": "big/partition.py",
    "sequential.py": "big/sequential.py",
    "placement.py": "big/placement.py",
    "onload.py": "big/onload.py",
    "weight_store.py": "big/weight_store.py",
    "activation_cache.py": "big/activation_cache.py",
    "ranks.py": "big/ranks.py",
    "devices.py": "big/devices.py",
    # reporting/: what a run says
    "report.py": "reporting/report.py",
    "notes.py": "reporting/notes.py",
    "diagnose.py": "reporting/diagnose.py",
    "progress.py": "reporting/progress.py",
    # io/: files out (the save format, ONNX, torch.export)
    "export.py": "io/export.py",
}

# Moved when present (files the other branches add); every other old path must exist or be moved.
OPTIONAL = {"frames.py", "baked.py", "modes.py"}

# New packages: their __init__.py, a docstring only.
PACKAGES: dict[str, str] = {
    "core": "The user's model, touched without changing it: example inputs and the calling convention, runs\n"
            "that restore what they change, dotted module paths, the capture lock, the heap freeze, a\n"
            "node's source frames. Every other layer uses these; they use nothing of fxprep's but errors.",
    "pipeline": "``prepare_model``'s pipeline, run by ``fxprep/api.py``: what its stages share (:mod:`.state`),\n"
                "AIMET's positional arguments checked (:mod:`.arguments`), the model's own hooks set aside\n"
                "(:mod:`.root_hooks`), the verification stage (:mod:`.verification`); and\n"
                "``check_traceability`` (:mod:`.traceability`), each tracer alone.",
    "capture/shapes": "The dims a shape-general capture declares, reasoned about without running Dynamo: proposed\n"
                      "from the inputs (:mod:`.autodims`), declared (:mod:`.dims`), what a constraint violation\n"
                      "(:mod:`.violation`) and a guard's range (:mod:`.guard_range`) say of them. The capture\n"
                      "itself is :mod:`fxprep.capture.shape_general`; Dynamo's guards are read in\n"
                      ":mod:`fxprep.capture.dynamo`.",
    "families": "Model-family knowledge: what fxprep does differently for a family's models. One sub-package\n"
                "per family (:mod:`.transformers`).",
    "families/transformers": "transformers: cache off, attention implementation, config inputs, output recorders,\n"
                             "methods rewritten for capture, hub checkpoints. Nothing here imports\n"
                             "``transformers`` unless the model is a transformers model.",
    "runtime": "What a prepared module runs and carries: its class (:mod:`.prepared`), forward code, input\n"
               "guard, baked values, modes, and the helpers its graph calls (:mod:`.wrap`, :mod:`.opaque`).\n"
               "The op modules (``fxprep.ops``), ``fxprep.cond`` and ``fxprep.decisions`` stay at the package\n"
               "root: saves name them.",
    "big": "Models bigger than the device: weights loaded after a meta prepare (:mod:`.weights`), checkpoints,\n"
           "the graph cut into stages (:mod:`.partition`) and run stage by stage (:mod:`.sequential`),\n"
           "device maps (:mod:`.placement`), where weights wait (:mod:`.weight_store`).",
    "reporting": "What a run says: the Report, its longer notes, exceptions diagnosed into located issues, and\n"
                 "the progress of long work.",
}

# Code that finds the package by its own file's place: (file after the move, text before, text after).
# Applied where the text before is found (so, once); a moved file using __file__ that is not listed
# here is named at the end of the run, to be looked at.
FIXUPS: list[tuple[str, str, str]] = [
    ("reporting/diagnose.py",
     "_FXPREP = os.path.normcase(os.path.dirname(__file__))",
     "_FXPREP = os.path.normcase(os.path.dirname(os.path.dirname(__file__)))  # the package (this is reporting/)"),
]

# Names fxprep/__init__.py exports that are spelled like an old module: fxprep.partition(gm) is the
# function, fxprep.partition.Stages (or an import of fxprep.partition) the module.
PUBLIC_LIKE_MODULES = {"partition", "opaque"}

# Text files rewritten (by suffix or name); CHANGELOG.md is history and stays as written.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".txt", ".sh"}
TEXT_NAMES = {"Makefile", "run"}
SKIP = {"CHANGELOG.md", "tools/regroup.py", "tools/README.md"}


def module_name(rel: str) -> str:
    """'capture/shapes/dims.py' -> 'fxprep.capture.shapes.dims'; 'verify/__init__.py' -> 'fxprep.verify'."""
    parts = ["fxprep", *Path(rel).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(old): module_name(new) for old, new in MOVES.items()}
PATHS = dict(MOVES)


def new_module(name: str) -> str:
    """A dotted name with its longest moved-module prefix replaced."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        prefix = ".".join(parts[:i])
        if prefix in MODULES:
            return ".".join([MODULES[prefix], *parts[i:]])
    return name


# ---------------------------------------------------------------------------------------------- checks


def uncovered() -> list[str]:
    """Root modules (and capture/hf_*.py) this mapping does not place."""
    placed = set(MOVES) | set(ROOT)
    out = [p.name for p in sorted(PACKAGE.glob("*.py")) if p.name not in placed]
    out += [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "capture").glob("hf_*.py"))
            if str(p.relative_to(PACKAGE)) not in placed]
    return out


@dataclass
class Plan:
    moves: list[tuple[str, str]] = field(default_factory=list)  # to do now
    done: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # optional, in neither place
    packages: list[str] = field(default_factory=list)  # __init__.py to write
    errors: list[str] = field(default_factory=list)


def plan() -> Plan:
    p = Plan()
    for old, new in MOVES.items():
        was, now = (PACKAGE / old).exists(), (PACKAGE / new).exists()
        if was and now:
            p.errors.append(f"both {old} and {new} exist")
        elif was:
            p.moves.append((old, new))
        elif now:
            p.done.append(old)
        elif old in OPTIONAL:
            p.absent.append(old)
        else:
            p.errors.append(f"{old} is missing and {new} does not exist")
    for pkg in PACKAGES:
        if not (PACKAGE / pkg / "__init__.py").exists():
            p.packages.append(pkg)
    return p


# ------------------------------------------------------------------------------------ import rewriting


def _relative(target: str, package: str) -> str:
    """The relative spec for importing ``target`` from a module in ``package``."""
    t, pk = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(pk)) and t[common] == pk[common]:
        common += 1
    return "." * (len(pk) - common + 1) + ".".join(t[common:])


def _is_module(name: str, known: set[str]) -> bool:
    return name in known or name in MODULES


def _alias_text(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname and asname != name else name


def rewrite_from(package: str | None, level: int, module: str | None, names: list[tuple[str, str | None]],
                 own_package: str | None, known: set[str]) -> list[tuple[str, list[str]]] | None:
    """A ``from X import names`` statement's new form: [(spec, [alias text])], or None when unchanged.

    ``package`` is the package the statement was written relative to (None for absolute imports);
    ``own_package`` the package the file is in now (relative specs are written from there)."""
    if level:
        base = package.split(".") if package else []
        if level - 1 > len(base):
            return None
        base = base[: len(base) - level + 1]
        source = ".".join(base + ([module] if module else []))
    else:
        source = module or ""
    if not (source == "fxprep" or source.startswith("fxprep.")):
        return None
    groups: dict[str, list[str]] = {}
    changed = False
    for name, asname in names:
        full = f"{source}.{name}"
        submodule = name != "*" and _is_module(full, known) and not (
            not level and source == "fxprep" and name in PUBLIC_LIKE_MODULES)
        if submodule:
            target = new_module(full)
            target_pkg, target_name = target.rsplit(".", 1)
            bound = asname or (name if target_name != name else None)
            text = _alias_text(target_name, bound)
        else:
            target_pkg, text = new_module(source), _alias_text(name, asname)
        if target_pkg != source or text != _alias_text(name, asname):
            changed = True
        groups.setdefault(target_pkg, []).append(text)
    spec_of = (lambda t: _relative(t, own_package)) if level and own_package else (lambda t: t)
    specs = [(spec_of(t), names) for t, names in groups.items()]
    if not changed and (not level or len(specs) == 1 and specs[0][0] == ("." * level + (module or ""))):
        return None
    return specs


def _byte_col(line: str, col: int) -> int:
    return len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))


_FROM_SPEC = re.compile(r"^(from\s+)([.\w]+)(\s+import\b)")


def rewrite_python_imports(text: str, written_in: tuple[str, bool] | None, now_in: tuple[str, bool] | None,
                           known: set[str]) -> str:
    """Import statements of one Python file rewritten. ``written_in``/``now_in``: (module, is_package)
    the file's relative imports were written from / the file is now (None outside the package)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text

    def pkg_of(where: tuple[str, bool] | None) -> str | None:
        if where is None:
            return None
        name, is_pkg = where
        return name if is_pkg else name.rsplit(".", 1)[0]

    written_pkg, own_pkg = pkg_of(written_in), pkg_of(now_in)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and written_pkg is None:
            continue
        names = [(a.name, a.asname) for a in node.names]
        specs = rewrite_from(written_pkg, node.level, node.module, names, own_pkg, known)
        if specs is None:
            continue
        l0, l1 = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        c0, c1 = _byte_col(lines[l0], node.col_offset), _byte_col(lines[l1], node.end_col_offset or 0)
        segment = "".join(lines[l0:l1 + 1])[c0: len("".join(lines[l0:l1])) + c1]
        original = [_alias_text(n, a) for n, a in names]
        if len(specs) == 1 and specs[0][1] == original:
            spec = specs[0][0]
            new = _FROM_SPEC.sub(lambda m, spec=spec: m.group(1) + spec + m.group(3), segment, count=1)
        else:
            indent = " " * c0 if lines[l0][:c0].strip() == "" else ""
            sep = "\n" + indent if indent or lines[l0][:c0].strip() == "" else "; "
            new = sep.join(f"from {spec} import {', '.join(n)}" for spec, n in specs)
        edits.append((l0, c0, l1, c1, new))
    for l0, c0, l1, c1, new in sorted(edits, reverse=True):
        head, tail = lines[l0][:c0], lines[l1][c1:]
        lines[l0: l1 + 1] = [head + new + tail]
    return "".join(lines)


_TEXT_FROM = re.compile(r"^(?P<indent>\s*)from (?P<module>fxprep[\w.]*) import (?P<names>[\w ,]+?)(?P<tail>\s*(#.*)?)$",
                        re.MULTILINE)


def rewrite_text_imports(text: str, known: set[str]) -> str:
    """``from fxprep... import a, b`` lines of non-Python text (docs' code blocks)."""
    def one(m: re.Match[str]) -> str:
        names = []
        for part in m.group("names").split(","):
            bits = part.split()
            if not bits:
                continue
            names.append((bits[0], bits[2] if len(bits) == 3 and bits[1] == "as" else None))
        specs = rewrite_from(None, 0, m.group("module"), names, None, known)
        if specs is None:
            return m.group(0)
        return "\n".join(f"{m.group('indent')}from {s} import {', '.join(n)}" for s, n in specs) + m.group("tail")

    return _TEXT_FROM.sub(one, text)


# ------------------------------------------------------------------------------- names and paths in text

_DOTTED = re.compile(r"(?<![\w.])fxprep((?:\.[A-Za-z_]\w*)+)")


def rewrite_dotted(text: str, config: bool = False) -> str:
    """Dotted ``fxprep.`` names; in a config file (``config``) a whole quoted ``"fxprep.partition"`` is a
    module (mypy's lists), elsewhere the public function's name (``"mark it fxprep.opaque"``)."""
    def one(m: re.Match[str]) -> str:
        parts = m.group(1)[1:].split(".")
        if parts[0] in PUBLIC_LIKE_MODULES and len(parts) == 1:
            before, after = text[max(0, m.start() - 7): m.start()], text[m.end(): m.end() + 1]
            quoted = config and m.start() > 0 and text[m.start() - 1] in "\"'" and after in ("\"", "'")
            if not (before.endswith(("from ", "import ")) or quoted):
                return m.group(0)
        return new_module(m.group(0))

    return _DOTTED.sub(one, text)


_PATH = re.compile(r"(?<![\w/.-])(?P<prefix>(?:src/)?fxprep/)?(?P<rel>[\w/]+\.py)\b")


def rewrite_paths(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        rel = m.group("rel")
        if rel not in PATHS or (not m.group("prefix") and "/" not in rel):
            return m.group(0)
        return (m.group("prefix") or "") + PATHS[rel]

    return _PATH.sub(one, text)


_LAZY_ENTRY = re.compile(r"""(?P<key>["']\w+["']\s*:\s*)(?P<q>["'])(?P<mod>[\w.]+)(?P=q)""")


def rewrite_lazy_table(text: str) -> str:
    """fxprep/__init__.py's ``_LAZY = {public name: submodule}`` (issue 61), values relative to fxprep."""
    m = re.search(r"^_LAZY\b[^=]*=\s*\{(?P<body>.*?)^\}", text, re.MULTILINE | re.DOTALL)
    if not m:
        return text
    body = _LAZY_ENTRY.sub(lambda e: e.group("key") + e.group("q") + new_module("fxprep." + e.group("mod"))[7:]
                           + e.group("q"), m.group("body"))
    return text[: m.start("body")] + body + text[m.end("body"):]


# ----------------------------------------------------------------------------------------------- driver


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], check=True, capture_output=True, text=True).stdout
    files = []
    for name in filter(None, out.split("\0")):
        path = Path(name)
        if name in SKIP or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
            files.append(path)
    return files


def package_position(path: Path) -> tuple[str, bool] | None:
    try:
        rel = path.relative_to(PACKAGE)
    except ValueError:
        return None
    return module_name(str(rel)), rel.name == "__init__.py"


def public_names() -> set[str]:
    """``fxprep.__all__``, read from the source."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return set()


_MKDOCSTRINGS = re.compile(r"^(?P<head>:::\s+)fxprep\.(?P<module>[\w.]+)\.(?P<name>\w+)[ \t]*$", re.MULTILINE)


def rewrite_mkdocstrings(text: str, public: set[str]) -> str:
    """``::: fxprep.report.Report`` -> ``::: fxprep.Report``: a moved module's public name is shown (and
    found) by the name users import it by, not by the module it happens to live in."""
    def one(m: re.Match[str]) -> str:
        moved = f"fxprep.{m.group('module')}" in MODULES or f"fxprep.{m.group('module')}" in MODULES.values()
        if moved and m.group("name") in public:
            return f"{m.group('head')}fxprep.{m.group('name')}"
        return m.group(0)

    return _MKDOCSTRINGS.sub(one, text)


_SPHINX_RELATIVE = re.compile(r"(?P<head>:(?:mod|func|class|data|meth|attr|exc|obj):`~?)(?P<ref>\.+[\w.]*)(?P<tail>`)")


def rewrite_sphinx_relative(text: str, written_in: tuple[str, bool] | None, now_in: tuple[str, bool] | None,
                            known: set[str]) -> str:
    """Relative Sphinx roles in docstrings (``:mod:`.hf_source```, ``:class:`~.autodims.Proposal```), resolved
    like a relative import from where the file was and written relative to where it is."""
    if written_in is None or now_in is None:
        return text
    written_pkg = written_in[0] if written_in[1] else written_in[0].rsplit(".", 1)[0]
    own_pkg = now_in[0] if now_in[1] else now_in[0].rsplit(".", 1)[0]

    def one(m: re.Match[str]) -> str:
        ref = m.group("ref")
        level = len(ref) - len(ref.lstrip("."))
        base = written_pkg.split(".")
        if level - 1 >= len(base):
            return m.group(0)
        full = ".".join(base[: len(base) - level + 1] + ([ref.lstrip(".")] if ref.lstrip(".") else []))
        parts = full.split(".")
        if not any(".".join(parts[:i]) in known for i in range(len(parts), 1, -1)):
            return m.group(0)  # not an fxprep module (or an attribute of one) read this way: left as written
        target = new_module(full)
        spec = _relative(target, own_pkg)
        return m.group("head") + spec + m.group("tail") if spec != ref else m.group(0)

    return _SPHINX_RELATIVE.sub(one, text)


def rewrite_file(path: Path, text: str, written_in: tuple[str, bool] | None, known: set[str],
                 public: set[str] | None = None) -> str:
    new = text
    if path.suffix == ".py":
        new = rewrite_python_imports(new, written_in, package_position(path), known)
        new = rewrite_sphinx_relative(new, written_in, package_position(path), known)
        if path == PACKAGE / "__init__.py":
            new = rewrite_lazy_table(new)
        new = rewrite_text_imports(new, known)  # code in strings (a script a test writes and runs)
    else:
        new = rewrite_text_imports(new, known)
        if path.suffix == ".md":
            new = rewrite_mkdocstrings(new, public or set())
    new = rewrite_dotted(new, config=path.suffix in (".toml", ".cfg", ".ini", ".yml", ".yaml"))
    return rewrite_paths(new)


def known_modules() -> set[str]:
    return {module_name(str(p.relative_to(PACKAGE))) for p in PACKAGE.rglob("*.py")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
    parser.add_argument("--no-ruff", action="store_true", help="skip ruff's import sort of the changed files")
    args = parser.parse_args()
    if not PACKAGE.is_dir() or not Path(".git").exists():
        print("regroup: run me at the repository root (src/fxprep and .git here)", file=sys.stderr)
        return 2
    missing = uncovered()
    if missing:
        print("regroup: these modules have no place in tools/regroup.py's mapping (MOVES or ROOT); add them first:\n  "
              + "\n  ".join(missing), file=sys.stderr)
        return 2
    p = plan()
    if p.errors:
        print("regroup: the checkout is in neither the old nor the new layout:\n  " + "\n  ".join(p.errors),
              file=sys.stderr)
        return 2
    known = known_modules() | set(MODULES)
    public = public_names()
    print(f"regroup: {len(p.moves)} moves to do, {len(p.done)} done before, {len(p.absent)} optional absent "
          f"({', '.join(p.absent) or '-'}), {len(p.packages)} package docstrings to write")
    for old, new in p.moves:
        print(f"  git mv src/fxprep/{old} src/fxprep/{new}")
    moved_now = {Path(PACKAGE / new): module_name(old) for old, new in p.moves}
    old_init = {Path(PACKAGE / new): old.endswith("__init__.py") for old, new in p.moves}

    if not args.dry_run:
        for pkg in p.packages:
            init = PACKAGE / pkg / "__init__.py"
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{PACKAGES[pkg]}\n"""\n')
            subprocess.run(["git", "add", str(init)], check=True)
        for old, new in p.moves:
            (PACKAGE / new).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(PACKAGE / old), str(PACKAGE / new)], check=True)

    changed: list[tuple[Path, int]] = []
    for path in tracked_text_files() if not args.dry_run else _dry_files(p):
        read_from = path
        if args.dry_run:
            read_from = _dry_source(path, p)
        text = read_from.read_text(encoding="utf-8")
        if path in moved_now:
            written_in: tuple[str, bool] | None = (moved_now[path], old_init[path])
        else:
            written_in = package_position(path)
        new = rewrite_file(path, text, written_in, known, public)
        if new != text:
            n = sum(1 for line in difflib.ndiff(text.splitlines(), new.splitlines()) if line.startswith("- "))
            changed.append((path, n))
            if not args.dry_run:
                path.write_text(new, encoding="utf-8")
    print(f"regroup: {len(changed)} files {'would change' if args.dry_run else 'rewritten'}"
          f" ({sum(n for _, n in changed)} lines)")
    for path, n in changed:
        print(f"  {path}: {n}")

    for rel, before, after in FIXUPS:
        target = PACKAGE / rel
        source = _dry_source(target, p) if args.dry_run else target
        if source.exists() and before in (text := source.read_text(encoding="utf-8")):
            print(f"regroup: {'would fix' if args.dry_run else 'fixed'} {target}: {after.split('#')[0].strip()}")
            if not args.dry_run:
                target.write_text(text.replace(before, after), encoding="utf-8")
                if target not in [path for path, _ in changed]:
                    changed.append((target, 1))
    fixed = {PACKAGE / rel for rel, _, _ in FIXUPS}
    by_file = [PACKAGE / new for old, new in MOVES.items() if (PACKAGE / new).exists() or (PACKAGE / old).exists()]
    look = [f for f in by_file if f not in fixed and "__file__" in _read_either(f, p, args.dry_run)]
    if look:
        print("regroup: moved files that use __file__ (a path that depends on the file's folder?), check them:\n  "
              + "\n  ".join(map(str, look)), file=sys.stderr)

    py = [str(path) for path, _ in changed if path.suffix == ".py"]
    if py and not args.dry_run and not args.no_ruff:
        beside = Path(sys.executable).with_name("ruff")
        ruff = str(beside) if beside.exists() else shutil.which("ruff")
        if ruff is None:
            print("regroup: ruff not found: run `ruff check --fix --select I001` on the files above", file=sys.stderr)
        else:
            subprocess.run([ruff, "check", "--fix", "--select", "I001", "--quiet", *py], check=False)
    if not args.dry_run:
        print("regroup: done; review with `git status` and `git diff --stat -M`")
    return 0


def _read_either(path: Path, p: Plan, dry: bool) -> str:
    source = _dry_source(path, p) if dry else path
    return source.read_text(encoding="utf-8") if source.exists() else ""


def _dry_files(p: Plan) -> list[Path]:
    """In a dry run, the files as they would be named after the moves."""
    forward = {PACKAGE / old: PACKAGE / new for old, new in p.moves}
    return [forward.get(path, path) for path in tracked_text_files()]


def _dry_source(path: Path, p: Plan) -> Path:
    back = {PACKAGE / new: PACKAGE / old for old, new in p.moves}
    return back.get(path, path)


if __name__ == "__main__":
    sys.exit(main())
