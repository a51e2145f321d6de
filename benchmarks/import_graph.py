"""The package's import graph, measured: files, lines, the root's files, layers, cycles, imports that
point up a layer, and (with ``--routes``) comparisons of capture-route strings.

    python benchmarks/import_graph.py [SRC]          # default: src/fxprep of this checkout
    git archive REV src | tar -x -C /tmp/rev && python benchmarks/import_graph.py /tmp/rev/src/fxprep
    python benchmarks/import_graph.py BEFORE AFTER   # two packages side by side (issue 62's regroup)

A module's layer is the longest chain of fxprep imports below it (a leaf that imports nothing of
fxprep's is layer 0); an import "points up" when a module imports one of a higher layer, which only a
cycle allows. The same is measured between packages (a module's package is its folder): a package
cycle is a set of folders importing each other, which the module graph alone does not show.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parent = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for alias in node.names:
                child = f"{parent}.{alias.name}"
                found.add(child if child in known else parent)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    depth: dict[str, int] = {}

    def of(v: str, seen: frozenset[str]) -> int:
        if v in depth:
            return depth[v]
        below = [of(w, seen | {v}) for w in graph[v] if w not in seen]
        depth[v] = 1 + max(below) if below else 0
        return depth[v]

    for v in graph:
        of(v, frozenset())
    return depth


ROUTE_STRINGS = re.compile(r"""(==|!=|startswith\(|split\(["']\+["']\))\s*["']?(dynamo|fx)[a-z+]*["']?|["'](dynamo|fx)(\+[a-z]+)?["']\s*(==|!=|in\b)""")


def folder(name: str, path: Path, package: Path) -> str:
    """A module's package: itself for an ``__init__.py`` or a file at the package root (the root is
    no group), else its parent."""
    return name if path.name == "__init__.py" or path.parent == package else name.rpartition(".")[0]


def measure(package: Path) -> dict[str, object]:
    known = modules(package)
    graph = {n: imports(n, p, known) for n, p in known.items()}
    depth = layers(graph)
    root = [n for n, p in known.items() if p.parent == package]
    up = [(a, b) for a, deps in graph.items() for b in deps if depth[b] > depth[a]]
    lines = {n: len(p.read_text().splitlines()) for n, p in known.items()}
    basenames = Counter(p.name for p in known.values() if p.name != "__init__.py")
    packages: dict[str, set[str]] = {}
    for a, deps in graph.items():
        pa = folder(a, known[a], package)
        packages.setdefault(pa, set()).update(
            folder(b, known[b], package) for b in deps if folder(b, known[b], package) != pa)
    for deps in list(packages.values()):
        for d in deps:
            packages.setdefault(d, set())
    package_cycles = cycles(packages)
    routes = Counter()
    for name, path in known.items():
        for line in path.read_text().splitlines():
            if ROUTE_STRINGS.search(line):
                routes[name] += 1
    largest = max(lines, key=lines.__getitem__)
    return {
        "files": len(known),
        "lines": sum(lines.values()),
        "largest file": f"{lines[largest]} ({largest})",
        "package root: files": len(root),
        "package root: lines": sum(lines[n] for n in root),
        "packages": len([p for p in known.values() if p.name == "__init__.py"]),
        "import edges": sum(len(d) for d in graph.values()),
        "layers": max(depth.values()) + 1,
        "module cycles": len(cycles(graph)),
        "imports pointing up a layer": len(up),
        "package cycles (root modules count alone)": len(package_cycles),
        "packages in a package cycle": sum(len(c) for c in package_cycles),
        "basenames used twice or more": len([b for b, c in basenames.items() if c > 1]),
        "route string comparisons (files)": f"{sum(routes.values())} ({len(routes)})",
        "_basenames": sorted(b for b, c in basenames.items() if c > 1),
        "_package_cycles": package_cycles,
        "_routes": dict(routes.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="*", default=[str(ROOT / "src" / "fxprep")],
                        help="one package folder, or two (before, after) side by side")
    parser.add_argument("--routes", action="store_true", help="list capture-route string comparisons per file")
    parser.add_argument("--cycles", action="store_true", help="list the package cycles")
    args = parser.parse_args()
    found = [measure(Path(p)) for p in args.package]
    width = max(len(k) for k in found[0])
    if len(found) > 1:
        print(f"{'':{width}}  " + "  ".join(f"{Path(p).parent.parent.name or p:>16}" for p in args.package))
    for key in found[0]:
        if not key.startswith("_"):
            print(f"{key:{width}}  " + "  ".join(f"{str(f[key]):>16}" for f in found))
    for f, p in zip(found, args.package, strict=True):
        print(f"{p}: basenames used twice or more: {f['_basenames']}")
        if args.cycles:
            for c in f["_package_cycles"]:
                print(f"  package cycle: {c}")
        if args.routes:
            print(f"  route string comparisons: {f['_routes']}")


if __name__ == "__main__":
    main()
