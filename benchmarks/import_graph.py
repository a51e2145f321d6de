"""The package's import graph, measured: files, lines, the root's files, layers, cycles, imports that
point up a layer, and (with ``--routes``) comparisons of capture-route strings.

    python benchmarks/import_graph.py [SRC]          # default: src/fxprep of this checkout
    git archive REV src | tar -x -C /tmp/rev && python benchmarks/import_graph.py /tmp/rev/src/fxprep

A module's layer is the longest chain of fxprep imports below it (a leaf that imports nothing of
fxprep's is layer 0); an import "points up" when a module imports one of a higher layer, which only a
cycle allows, or (``--rules``) when it breaks the direction docs/architecture.md states:
cli -> api -> capture/passes/verify -> runtime/ops -> errors.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(ROOT / "src" / "fxprep"))
    parser.add_argument("--routes", action="store_true", help="count capture-route string comparisons per file")
    args = parser.parse_args()
    package = Path(args.package)
    known = modules(package)
    graph = {n: imports(n, p, known) for n, p in known.items()}
    depth = layers(graph)
    root = [n for n, p in known.items() if p.parent == package]
    up = [(a, b) for a, deps in graph.items() for b in deps if depth[b] > depth[a]]
    lines = {n: len(p.read_text().splitlines()) for n, p in known.items()}
    basenames = Counter(p.name for p in known.values() if p.name != "__init__.py")
    print(f"files: {len(known)}, lines: {sum(lines.values())}, largest: {max(lines.values())} "
          f"({max(lines, key=lines.__getitem__)})")
    print(f"package root: {len(root)} files, {sum(lines[n] for n in root)} lines")
    print(f"import edges: {sum(len(d) for d in graph.values())}, layers: {max(depth.values()) + 1}, "
          f"cycles: {len(cycles(graph))}, imports pointing up a layer: {len(up)}")
    print(f"basenames used twice or more: {sorted(b for b, c in basenames.items() if c > 1)}")
    if args.routes:
        found = Counter()
        for name, path in known.items():
            for line in path.read_text().splitlines():
                if ROUTE_STRINGS.search(line):
                    found[name] += 1
        print(f"route string comparisons: {sum(found.values())} in {len(found)} files: {dict(found.most_common())}")


if __name__ == "__main__":
    main()
