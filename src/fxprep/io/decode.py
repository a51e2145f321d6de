"""Load side: a module tree and a graph rebuilt from the saved JSON, checked at every step.

Nothing is ``exec``-ed, ``eval``-ed or unpickled: modules are built from their saved kind (a
constructor call on ``meta``, an ``fxprep.ops`` op, a trusted class with plain attributes), tensors
are put in their slots by key (one object per key, so tied weights stay tied), and the graph is
created node by node. Every name goes through :mod:`.trust` first; every malformed entry is a
:class:`~fxprep.errors.SerializationError` saying which.
"""

from __future__ import annotations

import builtins
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .. import ops
from ..errors import SerializationError
from ..report import Report
from .format import CONTAINERS, GRAPH, MANIFEST, MODULE_INTERNALS, MODULES, TYPES, WEIGHTS, own_attrs
from .trust import TrustPolicy, check_member, class_name, load_class, load_function


@dataclass
class Decoder:
    policy: TrustPolicy
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self(x) for x in v]
        if not isinstance(v, dict) or "$" not in v:
            raise SerializationError(f"malformed value in saved file: {str(v)[:80]}")
        tag, x = v["$"], v.get("v")
        try:
            return self._tagged(tag, x)
        except SerializationError:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed entry is a file problem
            raise SerializationError(f"malformed {tag!r} value in saved file: {str(x)[:80]} ({err})") from err

    def _tagged(self, tag: str, x: Any) -> Any:
        if tag == "node":
            if x not in self.nodes:
                raise SerializationError(f"graph refers to node {x!r} before it is defined (or never).")
            return self.nodes[x]
        if tag == "tuple":
            return tuple(self(i) for i in x)
        if tag == "dict":
            return {self(k): self(i) for k, i in x}
        if tag == "slot":
            return ops.Slot(int(x))
        if tag == "slice":
            return slice(*(self(i) for i in x))
        if tag == "float":
            if x not in ("inf", "-inf", "nan"):
                raise SerializationError(f"bad float {x!r}")
            return float(x)
        if tag == "size":
            return torch.Size(int(i) for i in x)
        if tag == "ellipsis":
            return Ellipsis
        if tag == "complex":
            return complex(float(x[0]), float(x[1]))
        if tag in ("dtype", "memory_format", "layout"):
            value = getattr(torch, str(x), None)
            kinds = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}
            if not isinstance(value, kinds[tag]):
                raise SerializationError(f"unknown {tag} {x!r}")
            return value
        if tag == "device":
            return torch.device(str(x))
        if tag == "tensor":
            if x not in self.tensors:
                raise SerializationError(f"tensor {x!r} is missing from {WEIGHTS}.")
            return self.tensors[x]
        if tag == "type":
            if x not in TYPES:
                raise SerializationError(f"unknown type {x!r}")
            return TYPES[x]
        if tag == "fn":
            return load_function(str(x), self.policy)
        raise SerializationError(f"unknown value tag {tag!r} in saved file.")


def _is_atom(name: Any) -> bool:
    """A name nn.Module accepts for a child, parameter or buffer: a non-empty string without dots."""
    return isinstance(name, str) and bool(name) and "." not in name


def field_of(entry: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
        raise SerializationError(f"malformed entry in {MODULES}: {str(entry)[:120]} (field {key!r})")
    return entry[key]


def set_attrs(module: nn.Module, attrs: dict[str, Any], decode: Decoder) -> None:
    """Plain attributes (private ones included: ``_reversed_padding_repeated_twice``); never a dunder,
    never nn.Module's own bookkeeping, and values are only what the decoder can build."""
    for k, v in attrs.items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("__"):
            raise SerializationError(f"refusing to load: attribute name {k!r} of {type(module).__name__}.")
        if k in MODULE_INTERNALS:
            raise SerializationError(f"refusing to overwrite nn.Module internal {k!r}.")
        object.__setattr__(module, k, decode(v))


def build_modules(tree: dict[str, Any], decode: Decoder, policy: TrustPolicy) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {}
    for entry in field_of(tree, "modules", list):
        path = field_of(entry, "path", str)
        kind = field_of(entry, "kind", str)
        if path in modules or (path == "") != (kind == "root"):
            raise SerializationError(f"malformed module tree in {MODULES} at {path!r}.")
        parent_path, _, atom = path.rpartition(".")
        if path and (parent_path not in modules or not atom or "." in atom):
            raise SerializationError(f"module {path!r} in {MODULES} has no parent entry before it.")
        if kind == "same_as":
            of = field_of(entry, "of", str)
            if of not in modules:
                raise SerializationError(f"module {path!r} refers to unknown module {of!r}.")
            module = modules[of]
        elif kind == "owned":
            module = modules[parent_path]._modules.get(atom)  # type: ignore[assignment]
            expected = field_of(entry, "class", str)
            if module is None or class_name(type(module)) != expected:
                raise SerializationError(
                    f"module {path!r}: the parent's constructor did not create a {expected} there "
                    f"(saved with another torch version?)."
                )
        elif kind == "root":
            module = nn.Module()
        elif kind == "graph":  # its graph is built once the whole tree and its tensors exist
            name = str(field_of(entry, "graph", dict).get("class_name", "GraphModule"))
            module = fx.GraphModule(nn.Module(), fx.Graph(), name if name.isidentifier() else "GraphModule")
        else:
            module = _build_one(entry, kind, decode, policy)
        module.training = bool(entry.get("training", False))
        if path and kind != "owned":
            modules[parent_path]._modules[atom] = module
        modules[path] = module
    return modules


def _build_one(entry: dict[str, Any], kind: str, decode: Decoder, policy: TrustPolicy) -> nn.Module:
    name = field_of(entry, "class", str)
    cls = load_class(name, policy)
    path = entry["path"]
    if kind == "container":
        if cls not in CONTAINERS:
            raise SerializationError(f"module {path!r}: {name} is not a plain container class.")
        return cls()
    if kind == "bound_op":
        if not issubclass(cls, ops.BoundOp):
            raise SerializationError(f"module {path!r}: {name} is not an fxprep.ops.BoundOp.")
        fn = load_function(field_of(entry, "fn", str), policy)
        args, kwargs = _call_args(entry, decode, f"module {path!r}")
        if fn is builtins.getattr and len(args) >= 2:
            check_member(args[1], "attribute")
        return cls(fn, args, kwargs)
    if kind == "init":
        kwargs = {k: decode(v) for k, v in field_of(entry, "init", dict).items()}
        if not all(k.isidentifier() for k in kwargs):
            raise SerializationError(f"module {path!r}: malformed constructor arguments.")
        try:
            with torch.device("meta"):
                module = cls(**kwargs)
        except Exception as err:  # noqa: BLE001
            raise SerializationError(f"module {path!r}: {name}(**{kwargs}) failed: {err}") from err
        for sub, attrs in field_of(entry, "patch", dict).items():
            try:
                target = module.get_submodule(sub)
            except AttributeError as err:
                raise SerializationError(f"module {path!r}: no submodule {sub!r} to patch.") from err
            set_attrs(target, field_of({"a": attrs}, "a", dict), decode)
        return module
    if kind == "state":
        field_of(entry, "attrs", dict)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        return module  # attributes are set once the tensors they may refer to exist
    raise SerializationError(f"module {path!r}: unknown kind {kind!r} in {MODULES}.")


def assign_tensors(tree: dict[str, Any], modules: dict[str, nn.Module], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put every saved tensor in its slot(s); one object per key, so tied weights stay tied.
    Returns key → the object now in the tree."""
    objects: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def tensor(key: str, parameter: bool, requires_grad: bool) -> torch.Tensor:
        if key not in weights:
            raise SerializationError(f"tensor {key!r} is missing from {WEIGHTS}.")
        used.add(key)
        obj = objects.get(key)
        if obj is None:
            obj = nn.Parameter(weights[key], requires_grad=requires_grad) if parameter else weights[key]
            objects[key] = obj
        elif isinstance(obj, nn.Parameter) != parameter:
            raise SerializationError(f"tensor {key!r} is used both as a parameter and as a buffer.")
        return obj

    for slot in field_of(tree, "tensors", list):
        path = field_of(slot, "module", str)
        name = field_of(slot, "name", str)
        role = field_of(slot, "role", str)
        module = modules.get(path)
        if module is None or role not in ("parameter", "buffer") or not _is_atom(name):
            raise SerializationError(f"malformed tensor slot in {MODULES}: {str(slot)[:120]}")
        key = slot.get("key")
        slots = module._parameters if role == "parameter" else module._buffers
        if key is None:
            if name in slots and slots[name] is not None:
                raise SerializationError(f"{path}.{name} was saved as None but the constructor created it.")
            slots[name] = None
            continue
        value = tensor(str(key), role == "parameter", bool(slot.get("requires_grad", True)))
        existing = slots.get(name)
        if existing is not None and existing.shape != value.shape:
            raise SerializationError(
                f"{path}.{name}: saved shape {tuple(value.shape)} does not fit the module, which expects "
                f"{tuple(existing.shape)}; {WEIGHTS} does not belong to this module tree."
            )
        if name in slots:
            setattr(module, name, value)  # keeps subclasses' bookkeeping (RNN flat weights) in step
        elif role == "parameter":
            module.register_parameter(name, value)  # type: ignore[arg-type]
        else:
            module.register_buffer(name, value)
        if role == "buffer":
            if slot.get("persistent", True):
                module._non_persistent_buffers_set.discard(name)
            else:
                module._non_persistent_buffers_set.add(name)
    for c in field_of(tree, "constants", list):
        target = field_of(c, "path", str)
        owner_path, _, name = target.rpartition(".")
        if not _is_atom(name) or name.startswith("__"):
            raise SerializationError(f"bad constant name {target!r} in {MODULES}.")
        if owner_path not in modules:
            raise SerializationError(f"constant {target!r} has no owner module.")
        key = field_of(c, "key", str)
        setattr(modules[owner_path], name, objects.get(key, weights.get(key)))
        if key not in weights:
            raise SerializationError(f"tensor {key!r} is missing from {WEIGHTS}.")
        used.add(key)
    unused = set(weights) - used - _attr_keys(tree)
    if unused:
        raise SerializationError(f"{WEIGHTS} holds tensors no module uses ({sorted(unused)[:5]}): files do not belong together.")
    return {**weights, **objects}


def _attr_keys(tree: dict[str, Any]) -> set[str]:
    keys: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if v.get("$") == "tensor":
                keys.add(str(v.get("v")))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for entry in tree.get("modules", []):
        walk(entry.get("attrs"))
    return keys


def check_no_meta(root: nn.Module) -> None:
    for path, module in root.named_modules():
        for name, t in [*module._parameters.items(), *module._buffers.items(), *own_attrs(module).items()]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise SerializationError(
                    f"{path or 'root'}.{name} ({type(module).__name__}) has no saved value: its constructor "
                    f"creates a tensor fxprep did not save. Please report this with the module class."
                )


def build_graph(graph_json: dict[str, Any], root: nn.Module, decode: Decoder, policy: TrustPolicy) -> fx.Graph:
    graph = fx.Graph()
    for entry in field_of(graph_json, "nodes", list):
        name = field_of(entry, "name", str)
        op = field_of(entry, "op", str)
        if not name.isidentifier() or name in decode.nodes:
            raise SerializationError(f"bad node name {name!r} in {GRAPH}.")
        target: Any = entry.get("target")
        if op == "call_function":
            target = load_function(field_of(target, "fn", str) if isinstance(target, dict) else "", policy)
        elif op in ("call_module", "get_attr"):
            if not isinstance(target, str):
                raise SerializationError(f"node {name!r}: malformed target.")
            # any module name nn.Module accepts ("block1-0" in regnet); only the tree is searched
            if not all(_is_atom(part) and not part.startswith("__") for part in target.split(".")):
                raise SerializationError(f"node {name!r}: malformed {op} target {target!r}.")
            try:
                (root.get_submodule if op == "call_module" else _get_attr_checker(root))(target)
            except AttributeError as err:
                raise SerializationError(f"node {name!r}: {op} target {target!r} does not exist in the module tree.") from err
        elif op == "call_method":
            check_member(target, "method")
        elif op in ("placeholder", "output"):
            if not isinstance(target, str) or (op == "placeholder" and not target.lstrip("*").isidentifier()):
                raise SerializationError(f"node {name!r}: malformed target.")
        else:
            raise SerializationError(f"node {name!r}: unknown op {op!r}.")
        args, kwargs = _call_args(entry, decode, f"node {name!r}")
        if op == "call_function" and target is builtins.getattr and len(args) >= 2:
            check_member(args[1], "attribute")
        type_expr = TYPES.get(entry["type"]) if isinstance(entry.get("type"), str) else None
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise SerializationError(f"node name {name!r} cannot be reproduced (got {node.name!r}).")
        decode.nodes[name] = node
    codegen = graph_json.get("codegen")
    if codegen is not None:
        graph._codegen = _pytree_codegen(codegen)
    try:
        graph.lint()
    except Exception as err:  # noqa: BLE001
        raise SerializationError(f"{GRAPH} does not describe a valid graph: {err}") from err
    return graph


def _call_args(entry: dict[str, Any], decode: Decoder, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = entry.get("args", []), entry.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(k.isidentifier() for k in kwargs):
        raise SerializationError(f"{where}: malformed args/kwargs in saved file.")
    return tuple(decode(a) for a in args), {k: decode(v) for k, v in kwargs.items()}


def _get_attr_checker(root: nn.Module) -> Callable[[str], Any]:
    def check(target: str) -> Any:
        owner_path, _, name = target.rpartition(".")
        owner = root.get_submodule(owner_path)
        if name not in owner._parameters and name not in owner._buffers and name not in owner._modules \
                and not isinstance(owner.__dict__.get(name), torch.Tensor):
            raise AttributeError(target)
        return owner
    return check


# Modules that only define output containers (registered with pytree when imported).
_CONTAINER_MODULES = ("transformers.modeling_outputs", "collections")


def _import_pytree_types(spec: dict[str, Any]) -> None:
    """Import the modules that register the calling convention's container types (a transformers
    ``ModelOutput``), so a fresh process can load the module; only known container modules."""
    names: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if isinstance(v.get("type"), str):
                names.add(v["type"])
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for key in ("in_spec", "out_spec"):
        if isinstance(spec.get(key), str):
            try:
                walk(json.loads(spec[key]))
            except json.JSONDecodeError:
                continue
    for name in names:
        module = name.rpartition(".")[0]
        if module in _CONTAINER_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:
                pass


def _pytree_codegen(spec: Any) -> fx.graph.CodeGen:
    if not isinstance(spec, dict) or spec.get("kind") != "pytree":
        raise SerializationError(f"unknown calling convention in {GRAPH}: {str(spec)[:80]}")
    orig_args = spec.get("orig_args")
    if not isinstance(orig_args, list) or not all(isinstance(a, str) and a.isidentifier() for a in orig_args):
        raise SerializationError(f"malformed argument names in {GRAPH}.")
    _import_pytree_types(spec)
    try:
        in_spec = None if spec.get("in_spec") is None else pytree.treespec_loads(spec["in_spec"])
        out_spec = None if spec.get("out_spec") is None else pytree.treespec_loads(spec["out_spec"])
    except Exception as err:  # noqa: BLE001
        raise SerializationError(
            f"cannot read the calling convention (pytree spec) in {GRAPH}: {err}. If it names a container "
            f"type from a library (transformers ModelOutput), import that library before fxprep.load."
        ) from err
    return fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(orig_args, in_spec, out_spec))


def report_from_dict(data: Any, directory: Path) -> Report:
    """The report saved in the manifest, plus a note saying where it was loaded from."""
    if not isinstance(data, dict):
        report = Report("unknown")
    else:
        try:
            report = Report.from_dict(data)
        except (KeyError, TypeError, ValueError) as err:
            raise SerializationError(f"the report in {MANIFEST} is malformed: {err}") from err
    report.note(f"loaded from {directory} (fxprep.load)")
    return report
