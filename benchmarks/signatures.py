"""Measure the shape of fxprep's function signatures (issue 30, "one capture request").

Reads the source with :mod:`ast` only (no import of fxprep, so it runs on any checkout, e.g. an old
one in a temporary directory) and prints:

- the longest parameter lists (``self``/``cls`` excluded; ``*args``/``**kwargs`` count as one each),
- how many functions take more than 5 and more than 8 parameters,
- the functions longer than 80 lines,
- how many functions under ``capture/`` take a parameter named ``example``, ``example_inputs`` or
  ``request`` (the capture's inputs travelling loose vs. as one request).

Usage::

    python benchmarks/signatures.py [SRC_ROOT]     # default: src/fxprep next to this script
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

CARRIER_NAMES = ("example", "example_inputs", "request")


@dataclass(frozen=True)
class Signature:
    """One function definition: where it is, its parameter names and its length in lines."""

    path: str
    name: str
    line: int
    params: tuple[str, ...]
    length: int


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = node.args  # in the order a signature declares them
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return tuple(n for n in names if n not in ("self", "cls"))


def signatures(root: Path) -> list[Signature]:
    """Every function and method defined under ``root`` (a package directory)."""
    found: list[Signature] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append(Signature(rel, node.name, node.lineno, _params(node), length))
    return found


def report(root: Path, top: int = 15) -> str:
    sigs = signatures(root)
    lines = [f"source: {root}  ({len(sigs)} functions)"]
    longest = sorted(sigs, key=lambda s: (-len(s.params), s.path, s.line))[:top]
    lines.append(f"longest parameter lists (top {top}):")
    lines += [f"  {len(s.params):3d}  {s.path}:{s.line} {s.name}" for s in longest]
    lines.append(f"functions with > 5 parameters: {sum(len(s.params) > 5 for s in sigs)}")
    lines.append(f"functions with > 8 parameters: {sum(len(s.params) > 8 for s in sigs)}")
    capture = [s for s in sigs if s.path.startswith("capture/")]
    lines.append(
        "capture/ functions with > 5 parameters: "
        f"{sum(len(s.params) > 5 for s in capture)}, max {max((len(s.params) for s in capture), default=0)}"
    )
    long = sorted((s for s in sigs if s.length > 80), key=lambda s: -s.length)
    lines.append(f"functions over 80 lines: {len(long)}")
    lines += [f"  {s.length:4d}  {s.path}:{s.line} {s.name}" for s in long]
    for name in CARRIER_NAMES:
        count = sum(name in s.params for s in capture)
        lines.append(f"capture/ functions with a parameter named {name!r}: {count}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src" / "fxprep"
    print(report(root))


if __name__ == "__main__":
    main(sys.argv)
