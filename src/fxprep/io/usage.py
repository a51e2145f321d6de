"""The callables a save names, read from its JSON files (nothing imported, nothing run).

Answers "what does this save name?" for the script that measures the default allow-list
(``benchmarks/allowlist_usage.py``) and for the test that the list and the measurement agree
(``tests/test_io_allowlist.py``). It reads only what :mod:`.encode` writes: functions, Tensor
methods, aten ops and module classes, nested graphs included.

See docs/security.md ("Under the hood").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .format import GRAPH, MODULES, read_json

ATEN_PREFIX = "torch.ops.aten."


@dataclass
class Names:
    """What one save (or many, merged) names, by kind."""

    functions: set[str] = field(default_factory=set)
    methods: set[str] = field(default_factory=set)
    aten: set[str] = field(default_factory=set)
    classes: set[str] = field(default_factory=set)
    other: set[str] = field(default_factory=set)  # custom ops, trusted packages' code, autograd functions

    def add_function(self, name: Any) -> None:
        if not isinstance(name, str):
            return
        if name.startswith("Tensor."):
            self.methods.add(name.removeprefix("Tensor."))
        elif name.startswith(ATEN_PREFIX):
            self.aten.add(name.removeprefix(ATEN_PREFIX))
        elif name.startswith(("torch.ops.", "autograd:")):
            self.other.add(name)
        else:
            self.functions.add(name)

    def update(self, other: Names) -> None:
        for kind in ("functions", "methods", "aten", "classes", "other"):
            getattr(self, kind).update(getattr(other, kind))

    def as_dict(self) -> dict[str, list[str]]:
        return {kind: sorted(getattr(self, kind)) for kind in ("functions", "methods", "aten", "classes", "other")}


def _values(value: Any) -> Iterator[dict[str, Any]]:
    """Every tagged value (``{"$": ...}``) in a JSON tree, walked without recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("$"), str):
                yield v
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _graph(graph: Any, names: Names) -> None:
    for node in graph.get("nodes", []) if isinstance(graph, dict) else []:
        if not isinstance(node, dict):
            continue
        target = node.get("target")
        if node.get("op") == "call_function" and isinstance(target, dict):
            names.add_function(target.get("fn"))
        elif node.get("op") == "call_method" and isinstance(target, str):
            names.methods.add(target)
        for tagged in _values([node.get("args"), node.get("kwargs")]):
            if tagged.get("$") == "fn":
                names.add_function(tagged.get("v"))


def _tree(tree: Any, names: Names) -> None:
    for entry in tree.get("modules", []) if isinstance(tree, dict) else []:
        if not isinstance(entry, dict):
            continue
        kind = entry.get("kind")
        if kind == "graph":
            _graph(entry.get("graph"), names)
            continue
        if kind not in ("root", "same_as", "opaque_method", "opaque_function") and isinstance(entry.get("class"), str):
            names.classes.add(entry["class"])
        if kind == "bound_op":
            names.add_function(entry.get("fn"))
        elif kind == "opaque_function":
            names.other.add(str(entry.get("fn")))
        for key in ("args", "kwargs", "init", "patch", "attrs"):
            for tagged in _values(entry.get(key)):
                if tagged.get("$") == "fn":
                    names.add_function(tagged.get("v"))


def names_of_module(gm: Any) -> Names:
    """What saving ``gm`` (a prepared module) would name, read from the module itself: the names
    :mod:`.encode` gives its callables and classes. Callables with no saved name (a save would
    refuse them) are left out. Agrees with :func:`names_in` of its save (a test checks it)."""
    import torch.fx as fx
    from torch import nn

    from .. import ops
    from ..errors import SerializationError
    from .encode import function_name
    from .objects import class_name, opaque_code_name

    names = Names()

    def function(fn: Any) -> None:
        try:
            names.add_function(function_name(fn))
        except SerializationError:
            pass

    def values(value: Any) -> None:
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, slice):
                stack.extend((v.start, v.stop, v.step))
            elif callable(v) and not isinstance(v, (type, nn.Module, fx.Node)):
                function(v)

    seen: set[int] = set()
    for module in gm.modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function":
                    function(node.target)
                elif node.op == "call_method" and isinstance(node.target, str):
                    names.methods.add(node.target)
                values((node.args, node.kwargs))
            if module is gm:
                continue
        if opaque_code_name(module) is not None:
            continue
        if not isinstance(module, fx.GraphModule):
            names.classes.add(class_name(type(module)))
        if isinstance(module, ops.BoundOp):
            function(module.fn)
            values((module.args, module.kwargs))
    return names


def names_of(graph: Any, tree: Any) -> Names:
    """What a save's ``graph.json`` and ``modules.json`` (as JSON data) name."""
    names = Names()
    _graph(graph, names)
    _tree(tree, names)
    return names


def names_in(directory: str | Path) -> Names:
    """What the save in ``directory`` names (its JSON files only; checksums are not checked)."""
    directory = Path(directory)
    return names_of(read_json(directory / GRAPH), read_json(directory / MODULES))
