"""A prepared graph described for a person: what each node is, what fxprep did to it, and what flows.

The page (:mod:`.html`) needs one plain, JSON-able description of the graph, from a live
``GraphModule`` or from a saved directory (read from its JSON files only: nothing imported or run).
Each node gets a ``kind`` (:data:`KINDS`: what fxprep did there), a ``scope`` (the module the page
folds it into) and ``values`` (shape and dtype of what it computes).

See docs/pictures.md ("Under the hood").
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

# kind -> (legend label, what it means). The page draws each kind in its own colour and shape.
KINDS: dict[str, tuple[str, str]] = {
    "input": ("input / output", "the graph's inputs and output"),
    "module": ("your module", "one of your model's own modules (the same object, the same parameters)"),
    "added": ("added by fxprep", "a functional op (F.relu, x + y, torch.cat ...) that fxprep turned into a module"),
    "unrolled": ("unrolled", "a module called several times: one module per call site, parameters shared"),
    "opaque": ("opaque part", "could not be traced: runs your original code eagerly as one call"),
    "left": ("left functional", "a computing op that stayed a function (the report says why)"),
    "functional": ("view / metadata op", "reshapes, indexing, shape reads: allowed to stay functions"),
    "attr": ("constant / attribute", "a tensor or value read from the module"),
}


def _describe_value(value: Any) -> list[dict[str, Any]] | None:
    """Shape and dtype of each tensor in ``value`` (a tensor, a fake tensor, a tuple of them...)."""
    if value is None:
        return None
    found = []
    for leaf in pytree.tree_leaves(value):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is not None and isinstance(dtype, torch.dtype):
            found.append({"shape": [d if isinstance(d, int) else str(d) for d in shape],
                          "dtype": str(dtype).removeprefix("torch.")})
        if len(found) >= 8:
            break
    return found or None


def _meta_values(node: fx.Node) -> list[dict[str, Any]] | None:
    for key in ("example_value", "val", "tensor_meta"):
        if key in node.meta:
            described = _describe_value(node.meta[key])
            if described:
                return described
    return None


# --- a run on example inputs, recording every node's value ----------------------------------------
class _Recorder:
    """What each node computed; its bound ``record`` is called from the probe graph (an object, not
    an argument, so fx's code generation does not print it as a literal)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def record(self, name: str, value: Any) -> None:
        self.values[name] = _describe_value(value)


def record_values(gm: fx.GraphModule, example_inputs: Any) -> dict[str, list[dict[str, Any]] | None]:
    """Run ``gm`` once on ``example_inputs`` and return what each node computed (shape, dtype).

    The run is the module's own generated code (a copy of its graph with a recording call after each
    node), so it is called exactly as ``gm`` is (keyword inputs, lists of images...); buffers and the
    RNG are restored afterwards. Any failure returns what was recorded so far: a view is still worth
    having without shapes.
    """
    from ..core.inputs import normalize_example_inputs
    from ..core.runs import preserved_state

    example = normalize_example_inputs(example_inputs)
    recorder = _Recorder()
    if example is None:
        return recorder.values
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.op == "output":
            continue
        with graph.inserting_after(node):
            graph.call_function(recorder.record, (node.name, node))
    try:
        probe = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
        fresh = example.fresh_copy()
        with preserved_state(gm), torch.no_grad():
            probe(*fresh.args, **fresh.kwargs)
    except Exception:  # noqa: BLE001 - shapes are a help, never a reason to fail the view
        pass
    return recorder.values


# --- scopes ---------------------------------------------------------------------------------------
def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _common(scopes: list[str]) -> str:
    if not scopes:
        return ""
    parts = [s.split(".") if s else [] for s in scopes]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def assign_scopes(nodes: list[dict[str, Any]], stacks: dict[str, str] | None = None) -> None:
    """Set each node's ``scope``: a module call belongs to the module holding it; any other node to
    the innermost module the tracer recorded (``stacks``), else to the deepest module holding all
    of its neighbours that are module calls (the ``add`` between two convolutions of ``layer1.0``
    belongs to ``layer1.0``)."""
    stacks = stacks or {}
    by_name = {n["name"]: n for n in nodes}
    users: dict[str, list[str]] = {n["name"]: [] for n in nodes}
    for n in nodes:
        for src in n["inputs"]:
            if src in users:
                users[src].append(n["name"])
    for n in nodes:
        if n["op"] == "call_module":
            n["scope"] = _parent(n["module"])
        elif n["op"] in ("placeholder", "output"):
            n["scope"] = ""
        elif n["name"] in stacks:
            n["scope"] = stacks[n["name"]]
        else:
            n["scope"] = None
    for n in nodes:  # in graph order: inputs first, so chains of functional ops follow their module
        if n["scope"] is not None:
            continue
        around = [by_name[s]["scope"] for s in n["inputs"] if s in by_name and by_name[s]["scope"] is not None
                  and by_name[s]["op"] != "placeholder"]
        around += [by_name[u]["scope"] for u in users[n["name"]] if by_name[u]["op"] == "call_module"]
        n["scope"] = _common(around)


# --- kinds ----------------------------------------------------------------------------------------
def assign_kinds(nodes: list[dict[str, Any]], report: dict[str, Any] | None) -> None:
    """Set each node's ``kind`` and ``detail`` from the report (what fxprep did, and why)."""
    report = report or {}
    added = {a["name"]: a for a in report.get("added", [])}
    copies: dict[str, tuple[str, int, int]] = {}
    for u in report.get("unrolled", []):
        calls = [u["original"], *u["copies"]]
        for i, name in enumerate(calls):
            copies[name] = (u["original"], i + 1, len(calls))
    leaves = {}
    for name, why in report.get("leaves", {}).items():
        leaves[name] = why
        leaves[name.replace(".", "_")] = why  # an opaque method's module: rpn.filter_proposals -> rpn_filter_proposals
    left = {x["node"]: x for x in report.get("left_functional", [])}
    for n in nodes:
        op, module = n["op"], n.get("module") or ""
        if op in ("placeholder", "output"):
            n["kind"], n["detail"] = "input", ""
        elif op == "get_attr":
            n["kind"], n["detail"] = "attr", ""
        elif op == "call_module" and module in leaves and str(leaves[module]).startswith("opaque"):
            n["kind"], n["detail"] = "opaque", str(leaves[module]).removeprefix("opaque: ")
        elif op == "call_module" and module in leaves:  # excluded on request: the user's module, called whole
            n["kind"], n["detail"] = "module", f"kept whole ({leaves[module]})"
        elif op == "call_module" and module in copies:
            original, k, total = copies[module]
            n["kind"] = "unrolled"
            n["detail"] = f"call {k} of {total} of {original}" + ("" if k == 1 else f": a copy sharing {original}'s parameters")
        elif op == "call_module" and module in added:
            n["kind"], n["detail"] = "added", str(added[module].get("reason", ""))
        elif op == "call_module":
            n["kind"], n["detail"] = "module", ""
        elif n["name"] in left:
            n["kind"], n["detail"] = "left", str(left[n["name"]].get("reason", ""))
        else:
            n["kind"], n["detail"] = "functional", ""


# --- a live GraphModule ---------------------------------------------------------------------------
def _target_text(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if callable(target):
        try:
            return fx.node._get_qualified_name(target).replace("_operator.", "operator.")
        except Exception:  # noqa: BLE001 - a callable without an importable name
            return getattr(target, "__qualname__", None) or repr(target)
    return str(target)


def _innermost(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    value = list(stack.values())[-1]
    path = value[0] if isinstance(value, tuple) else str(value)
    return path.split("@")[0] if isinstance(path, str) else None


def _stack_classes(node: fx.Node) -> list[tuple[str, str]]:
    out = []
    for value in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            cls = value[1]
            out.append((value[0].split("@")[0], getattr(cls, "__name__", None) or str(cls).rpartition(".")[2]))
    return out


def live_nodes(gm: fx.GraphModule, values: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The nodes of ``gm`` (and each module's class name) for :func:`describe`."""
    nodes, stacks, classes = [], {}, {}
    for name, module in gm.named_modules():
        if name:
            classes[name] = type(module).__name__
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op, "inputs": [a.name for a in node.all_input_nodes]}
        if node.op == "call_module":
            entry["module"] = str(node.target)
            entry["label"] = classes.get(str(node.target), "?")
        elif node.op in ("call_function", "call_method"):
            entry["label"] = _target_text(node)
        else:
            entry["label"] = str(node.target)
        entry["values"] = values.get(node.name) or _meta_values(node)
        inner = _innermost(node)
        if inner is not None and node.op != "call_module":
            stacks[node.name] = inner
        for path, cls in _stack_classes(node):
            if classes.get(path) in (None, "Module"):
                classes[path] = cls  # fx rebuilt the containers as plain Modules; the capture knew better
        nodes.append(entry)
    assign_scopes(nodes, stacks)
    return nodes, classes


def describe(gm: fx.GraphModule, example_inputs: Any = None) -> dict[str, Any]:
    """The description of a live prepared module (its report from ``gm.fxprep_report`` if any)."""
    from ..version import __version__

    values = record_values(gm, example_inputs) if example_inputs is not None else {}
    nodes, classes = live_nodes(gm, values)
    report = getattr(gm, "fxprep_report", None)
    report_dict = report.to_dict() if report is not None and hasattr(report, "to_dict") else None
    assign_kinds(nodes, report_dict)
    return _view(str(getattr(report, "model", None) or type(gm).__name__), nodes, classes, report, report_dict,
                 {"fxprep_version": __version__, "torch_version": torch.__version__, "source": "live module"})


def _view(title: str, nodes: list[dict[str, Any]], classes: dict[str, str], report: Any,
          report_dict: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    text = report.to_text(verbose=True) if report is not None and hasattr(report, "to_text") else ""  # every module, by name
    return {"title": title, "nodes": nodes, "modules": classes, "report": report_dict, "report_text": text,
            "kinds": {k: {"label": label, "meaning": meaning} for k, (label, meaning) in KINDS.items()}, "meta": meta}


# --- a saved directory ----------------------------------------------------------------------------
def _saved_values(entry: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Shapes a save recorded for a node (``"values": [{"shape": [...], "dtype": "float32"}]``,
    at the node or under its ``"meta"``), if it did."""
    meta = entry.get("meta")
    for holder in (entry, meta if isinstance(meta, dict) else {}):
        values = holder.get("values")
        if isinstance(values, list) and all(isinstance(v, dict) and "shape" in v for v in values):
            return [{"shape": list(v["shape"]), "dtype": str(v.get("dtype", ""))} for v in values]
    return None


def describe_saved(directory: Any) -> dict[str, Any]:
    """The description of a directory written by :func:`fxprep.save`, from its JSON files only."""
    from pathlib import Path

    from ..io import GRAPH, inspect_saved
    from ..io.format import read_json
    from ..reporting.report import Report

    directory = Path(directory)
    view = inspect_saved(directory)
    manifest = view.get("manifest") or {}
    raw = read_json(directory / GRAPH)
    entries = {e.get("name"): e for e in raw.get("nodes", []) if isinstance(e, dict)} if isinstance(raw, dict) else {}
    inputs = [i for i in (manifest.get("inputs") or []) if isinstance(i, dict)]
    nodes, classes = [], {}
    placeholders = 0
    for row in view["nodes"]:
        entry: dict[str, Any] = {"name": str(row["name"]), "op": str(row["op"]), "inputs": [str(i) for i in row["inputs"]]}
        target = str(row["what"])
        if row["op"] == "call_module":
            module, _, cls = target.partition(": ")
            entry["module"], entry["label"] = module, cls
            classes[module] = cls
        else:
            entry["label"] = target
        entry["values"] = _saved_values(entries.get(row["name"], {}))
        if row["op"] == "placeholder":
            spec = next((i for i in inputs if i.get("name") in (row["name"], target)), None)
            if spec is None and placeholders < len(inputs) and inputs[placeholders].get("name") is None:
                spec = inputs[placeholders]
            if entry["values"] is None and spec is not None and "shape" in spec:
                entry["values"] = [{"shape": list(spec["shape"]), "dtype": str(spec.get("dtype", ""))}]
            placeholders += 1
        nodes.append(entry)
    assign_scopes(nodes)
    report_dict = manifest.get("report") if isinstance(manifest.get("report"), dict) else None
    report = None
    if report_dict is not None:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            report = Report.from_dict(report_dict)
    assign_kinds(nodes, report_dict)
    meta = {k: manifest.get(k) for k in ("fxprep_version", "torch_version")}
    meta["source"] = f"saved directory {directory}"
    title = str((report_dict or {}).get("model") or view.get("class_name") or "graph")
    return _view(title, nodes, classes, report, report_dict, meta)

