"""A griffe extension for the API reference: Sphinx roles in docstrings rendered as links.

fxprep's docstrings cross-reference in Sphinx's roles (``:class:`~fxprep.errors.FxprepError```,
``:func:`fxprep.save```, ``:mod:`.selfcheck```), the way torch's do; mkdocstrings renders Markdown
and printed them as written (23 raw roles on the API page). Each role becomes a Markdown
cross-reference (``[`FxprepError`][fxprep.errors.FxprepError]``, resolved by mkdocs-autorefs) where
its target is rendered on the API page (``docs/reference/api.md``'s ``:::`` entries, their members,
and the names ``fxprep`` re-exports), and inline code otherwise: a link to a page that does not
exist would fail the strict build, and a private module's name is still worth reading.
Loaded by ``mkdocs.yml`` (mkdocstrings' ``extensions`` option); ``tests/test_docs_site.py`` checks
the built page holds no raw role.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from griffe import Extension, Object

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj):`(?P<target>[^`]+)`")


def _public_names(path: Path, *, classes_only: bool = False) -> dict[str, list[str]]:
    """Top-level public classes and functions of a source file, each class with its public methods
    that have a docstring (mkdocstrings renders no other, so no other has an anchor to link to)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            out[node.name] = [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                              and not n.name.startswith("_") and ast.get_docstring(n)]
        elif not classes_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            out[node.name] = []
    return out


def _source(dotted: str) -> Path | None:
    base = ROOT / "src" / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _aliases() -> dict[str, str]:
    """canonical path -> the path ``fxprep`` re-exports it under (``fxprep.api.prepare_model`` -> ``fxprep.prepare_model``)."""
    out = {}
    for node in ast.walk(ast.parse((ROOT / "src" / "fxprep" / "__init__.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[f"fxprep.{node.module}.{alias.name}"] = f"fxprep.{alias.name}"
    return out


def _rendered() -> set[str]:
    """The identifiers the API page renders (each ``::: x`` entry and its public members)."""
    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    found: set[str] = set()
    for ident in re.findall(r"^::: ([\w.]+)", page, flags=re.M):
        found.add(ident)
        module_file = _source(ident)
        if module_file is not None:  # a module: its classes and functions
            for name, members in _public_names(module_file).items():
                found.add(f"{ident}.{name}")
                found.update(f"{ident}.{name}.{m}" for m in members)
            continue
        parent, _, name = ident.rpartition(".")
        parent_file = _source(parent)
        if parent_file is not None:  # a class: its methods
            found.update(f"{ident}.{m}" for m in _public_names(parent_file, classes_only=True).get(name, []))
    return found


class SphinxRoles(Extension):
    """Rewrite ``:role:`target``` in every docstring (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered = _rendered()
        self.aliases = _aliases()
        self.canonical = {alias: path for path, alias in self.aliases.items()}

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(lambda m: self._render(m, obj), obj.docstring.value)

    def _render(self, m: re.Match[str], obj: Object) -> str:
        text = m["target"].strip()
        short = text.startswith("~")
        target = text.lstrip("~")
        shown = target.rsplit(".", 1)[-1] if short or target.startswith(".") else target
        anchor = self._anchor(target, obj)
        return f"[`{shown}`][{anchor}]" if anchor is not None else f"`{shown}`"

    def _anchor(self, target: str, obj: Object) -> str | None:
        module = obj if obj.is_module else obj.module
        package = module.path if module.is_package else module.path.rpartition(".")[0]
        candidates = []
        if target.startswith("."):
            up = len(target) - len(target.lstrip("."))
            base = package.split(".")
            candidates.append(".".join(base[: len(base) - up + 1] + [target.lstrip(".")]))
        elif "." in target:
            candidates.append(target)
        else:  # a bare name: a member of the class, or a name the module defines or imports
            for scope in (obj, obj.parent, module):
                member = scope.members.get(target) if scope is not None else None
                if member is not None:
                    candidates.append(member.target_path if member.is_alias else member.path)
            candidates.append(f"fxprep.{target}")
        for candidate in candidates:
            for name in (candidate, self.aliases.get(candidate, ""), self.canonical.get(candidate, "")):
                if name in self.rendered:
                    return name
        return None
