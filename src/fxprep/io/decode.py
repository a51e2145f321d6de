"""Load side: a module tree and a graph rebuilt from the saved JSON, checked at every step.

Nothing is ``exec``-ed, ``eval``-ed or unpickled: modules are built from their saved kind (a
constructor call on ``meta``, an ``fxprep.ops`` op, a trusted class with plain attributes, an
opaque part naming trusted code), tensors are put in their slots by key (one object per key, so
tied weights stay tied) after their dtype and shape are checked, and the graph is created node by
node. Every class and function goes through :mod:`.trust` first; every attribute name a file sets
is checked not to replace the class's own code; every malformed entry is a
:class:`~fxprep.errors.SerializationError` saying which.
"""

from __future__ import annotations

import builtins
import importlib
import json
import math
import re
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
from ..reporting.report import Report
from . import allowlist, parametrized
from .format import (
    CONTAINERS,
    GRAPH,
    LIMITS,
    MANIFEST,
    MODULES,
    TYPES,
    WEIGHTS,
    check_shape,
    entries,
    training_flag,
)
from .objects import ObjectReader, bare_instance, class_name, method_function
from .regions import check_state_regions
from .trust import TrustPolicy, check_attribute, check_getattr, check_member, is_atom

_DTYPES = allowlist.dtype_table(torch.dtype)
_ENUMS = {"dtype": _DTYPES, "memory_format": allowlist.dtype_table(torch.memory_format),
          "layout": allowlist.dtype_table(torch.layout)}
_LIST_TAGS = frozenset({"tuple", "dict", "slice", "size", "complex", "set", "frozenset"})


@dataclass
class Decoder:
    """Tagged JSON → Python values. What a value may be depends on where it is read: ``tensors``
    (keys into the weights) only where tensors are saved, ``objects`` only for opaque parts and
    trusted modules' attributes, ``types_ok`` only in graph and op arguments."""

    policy: TrustPolicy
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] | None = None
    objects: ObjectReader | None = None
    types_ok: bool = False

    def __call__(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self(x) for x in v]
        if not isinstance(v, dict) or not isinstance(v.get("$"), str):
            raise SerializationError(f"malformed value in saved file: {str(v)[:80]}")
        tag, x = v["$"], v.get("v")
        if tag in _LIST_TAGS and not isinstance(x, list):
            raise SerializationError(f"malformed {tag!r} value in saved file: {str(x)[:80]}")
        try:
            return self._tagged(tag, x, v)
        except SerializationError:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed entry is a file problem
            raise SerializationError(f"malformed {tag!r} value in saved file: {str(x)[:80]} ({err})") from err

    def _tagged(self, tag: str, x: Any, whole: dict[str, Any]) -> Any:
        if tag == "node":
            if not isinstance(x, str) or x not in self.nodes:
                raise SerializationError(f"graph refers to node {str(x)[:80]!r} before it is defined (or never).")
            return self.nodes[x]
        if tag == "tuple":
            return tuple(self(i) for i in x)
        if tag == "dict":
            return {self(k): self(i) for k, i in x}
        if tag in ("set", "frozenset"):  # numbers and strings only: nothing a hash could run code for
            if not all(i is None or type(i) in (bool, int, float, str) for i in x):
                raise SerializationError(f"a saved {tag} may hold only numbers and strings: {str(x)[:80]}")
            return set(x) if tag == "set" else frozenset(x)
        if tag == "slot":
            if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < 100_000:
                raise SerializationError(f"bad op input slot {str(x)[:20]}")
            return ops.Slot(x)
        if tag == "slice":
            return slice(*(self(i) for i in x))
        if tag == "float":
            if x not in ("inf", "-inf", "nan"):
                raise SerializationError(f"bad float {str(x)[:20]!r}")
            return float(x)
        if tag == "size":
            return torch.Size(int(i) for i in x)
        if tag == "ellipsis":
            return Ellipsis
        if tag == "complex":
            return complex(float(x[0]), float(x[1]))
        if tag in _ENUMS:
            if not isinstance(x, str) or x not in _ENUMS[tag]:
                raise SerializationError(f"unknown {tag} {str(x)[:40]!r}")
            return _ENUMS[tag][x]
        if tag == "device":
            return torch.device(str(x))
        if tag == "tensor":
            if self.tensors is None:
                raise SerializationError("a tensor value where a saved file has none.")
            if not isinstance(x, str) or x not in self.tensors:
                raise SerializationError(f"tensor {str(x)[:80]!r} is missing from {WEIGHTS}.")
            return self.tensors[x]
        if tag == "type":
            if not self.types_ok or not isinstance(x, str) or x not in TYPES:
                raise SerializationError(f"refusing to load: type {str(x)[:40]!r} here.")
            return TYPES[x]
        if tag == "fn":
            return self.policy.function(x)
        if tag in ("object", "ref", "module") and self.objects is not None:
            if tag == "object":
                return self.objects.build(whole, self)
            return self.objects.ref(x) if tag == "ref" else self.objects.module(x)
        raise SerializationError(f"unknown value tag {tag[:40]!r} in saved file (or not allowed here).")


def field_of(entry: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
        raise SerializationError(f"malformed entry in {MODULES}: {str(entry)[:120]} (field {key!r})")
    return entry[key]


def set_attrs(module: nn.Module, attrs: dict[str, Any], decode: Decoder) -> None:
    """Plain attributes (private ones included: ``_reversed_padding_repeated_twice``); never a
    dunder, never nn.Module's own bookkeeping, never a name the class defines as code."""
    for k, v in attrs.items():
        check_attribute(type(module), k)
        object.__setattr__(module, k, decode(v))


def build_modules(tree: dict[str, Any], decode: Decoder, policy: TrustPolicy) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {}
    for entry in entries(tree, "modules", MODULES):
        path = field_of(entry, "path", str)
        kind = field_of(entry, "kind", str)
        if path in modules or (path == "") != (kind == "root"):
            raise SerializationError(f"malformed module tree in {MODULES} at {path[:120]!r}.")
        parent_path, _, atom = path.rpartition(".")
        if path and (parent_path not in modules or not is_atom(atom) or atom.startswith("__")):
            raise SerializationError(f"module {path[:120]!r} in {MODULES} has no parent entry before it.")
        if kind == "same_as":
            of = field_of(entry, "of", str)
            if of not in modules or of == "" or path.startswith(of + "."):  # no cycles
                raise SerializationError(f"module {path!r} refers to unknown module {of[:120]!r}.")
            module = modules[of]
        elif kind == "owned":
            module = modules[parent_path]._modules.get(atom)  # type: ignore[assignment]
            expected = field_of(entry, "class", str)
            if module is None or class_name(type(module)) != expected:
                raise SerializationError(
                    f"module {path!r}: the parent's constructor did not create a {expected[:120]} there "
                    f"(saved with another torch version?)."
                )
        elif kind == "root":
            module = nn.Module()
        elif kind == "graph":  # its graph is built once the whole tree and its tensors exist
            name = str(field_of(entry, "graph", dict).get("class_name", "GraphModule"))
            module = fx.GraphModule(nn.Module(), fx.Graph(), name if name.isidentifier() else "GraphModule")
        else:
            module = _build_one(entry, kind, decode, policy)
        module.training = training_flag(entry)
        if path and kind != "owned":
            modules[parent_path]._modules[atom] = module
        modules[path] = module
    return modules


def _build_one(entry: dict[str, Any], kind: str, decode: Decoder, policy: TrustPolicy) -> nn.Module:
    from ..capture.leaves import OpaqueFunction, OpaqueMethod

    path = entry["path"]
    if kind == "opaque_function":
        fn = policy.function(field_of(entry, "fn", str))
        if not policy.trusted_code(fn):
            raise SerializationError(f"refusing to load: opaque part {path!r} names {fn!r}, outside trusted_modules.")
        return OpaqueFunction(fn)
    if kind == "opaque_method":
        method = field_of(entry, "method", str)
        if not method.isidentifier() or method.startswith("__"):
            raise SerializationError(f"refusing to load: opaque part {path!r} calls method {method[:80]!r}.")
        module = OpaqueMethod.__new__(OpaqueMethod)
        nn.Module.__init__(module)
        module.method, module.owner_path = method, str(entry.get("owner_path", ""))
        field_of(entry, "owner", dict)
        return module  # the owner is rebuilt once the whole tree and its tensors exist
    cls = policy.module_class(field_of(entry, "class", str))
    if kind == "container":
        if cls not in CONTAINERS:
            raise SerializationError(f"module {path!r}: {class_name(cls)} is not a plain container class.")
        return cls()
    if kind == "bound_op":
        if not issubclass(cls, ops.BoundOp):
            raise SerializationError(f"module {path!r}: {class_name(cls)} is not an fxprep.ops.BoundOp.")
        fn = policy.function(field_of(entry, "fn", str))
        args, kwargs = _call_args(entry, Decoder(policy, types_ok=True), f"module {path!r}")
        if fn is builtins.getattr:
            check_getattr(args[1] if len(args) >= 2 else None)
        return cls(fn, args, kwargs)
    if kind == "init":
        kwargs = {k: decode(v) for k, v in field_of(entry, "init", dict).items()}
        # device / dtype are never saved: the constructor runs on meta, weights come from the file
        if not all(k.isidentifier() and k not in ("device", "dtype") for k in kwargs) or issubclass(cls, ops.BoundOp):
            raise SerializationError(f"module {path!r}: malformed constructor arguments.")
        try:
            with torch.device("meta"):
                module = cls(**kwargs)
        except Exception as err:  # noqa: BLE001 - a class refusing its saved arguments is a SerializationError
            raise SerializationError(f"module {path!r}: {class_name(cls)}(**{str(kwargs)[:200]}) failed: {err}") from err
        if "parametrize" in entry:  # torch's own weight_norm applied again (io/parametrized.py)
            with torch.device("meta"):
                parametrized.apply(module, entry["parametrize"], f"module {path!r}")
        for sub, attrs in field_of(entry, "patch", dict).items():
            if sub and not all(is_atom(p) and not p.startswith("__") for p in sub.split(".")):
                raise SerializationError(f"module {path!r}: malformed submodule name {sub[:80]!r} to patch.")
            try:
                target = module.get_submodule(sub)
            except AttributeError as err:
                raise SerializationError(f"module {path!r}: no submodule {sub[:80]!r} to patch.") from err
            set_attrs(target, field_of({"a": attrs}, "a", dict), decode)
        return module
    if kind == "state":
        field_of(entry, "attrs", dict)
        module = bare_instance(cls)
        nn.Module.__init__(module)
        return module  # attributes are set once the tensors they may refer to exist
    raise SerializationError(f"module {path!r}: unknown kind {kind[:40]!r} in {MODULES}.")


def finish_modules(tree: dict[str, Any], modules: dict[str, nn.Module], live: dict[str, torch.Tensor],
                   policy: TrustPolicy) -> None:
    """Second pass, once every module and tensor exists: attributes of "state" modules (they may
    refer to tensors: RNN flat weights) and the owners of opaque methods (they refer to modules)."""
    decode = Decoder(policy, tensors=live, objects=ObjectReader(policy, modules, live))
    for entry in tree["modules"]:
        kind, module = entry.get("kind"), modules[entry["path"]]
        if kind == "state":
            set_attrs(module, entry["attrs"], decode)
        elif kind == "opaque_method":
            owner = decode(entry["owner"])
            fn = method_function(type(owner), module.method)  # type: ignore[arg-type]
            if fn is None or not policy.trusted_code(fn):
                raise SerializationError(
                    f"refusing to load: opaque part {entry['path']!r} calls {class_name(type(owner))}."
                    f"{module.method}, which is not a function defined in a trusted package "
                    f"(trusted_modules={list(policy.modules)})."
                )
            object.__setattr__(module, "owner", owner)


def _dtype_kind(t: torch.Tensor) -> str:
    """Floating dtypes stand for each other (a half-precision model); others must match exactly."""
    return "floating" if t.is_floating_point() else "complex" if t.is_complex() else str(t.dtype)


def _check_tensor(where: str, value: torch.Tensor, slot: dict[str, Any], expected: torch.Tensor | None) -> None:
    """The saved tensor is what the module built for that slot expects, and what the file says it is."""
    dtype = str(value.dtype).removeprefix("torch.")
    if expected is not None:
        if expected.shape != value.shape:
            raise SerializationError(
                f"{where}: saved shape {tuple(value.shape)} does not fit the module, which expects "
                f"{tuple(expected.shape)}; {WEIGHTS} does not belong to this module tree."
            )
        if _dtype_kind(expected) != _dtype_kind(value):
            raise SerializationError(
                f"{where}: saved dtype {dtype} does not fit the module, which expects "
                f"{str(expected.dtype).removeprefix('torch.')}; {WEIGHTS} does not belong to this module tree."
            )
    if slot.get("dtype") != dtype or slot.get("shape") != list(value.shape):
        raise SerializationError(
            f"{where}: {WEIGHTS} holds a {dtype} tensor of shape {tuple(value.shape)} where {MODULES} records "
            f"{str(slot.get('dtype'))[:20]} {str(slot.get('shape'))[:80]}: the files do not belong together."
        )


def _owner_class(modules: dict[str, nn.Module], path: str) -> type:
    return fx.GraphModule if path == "" else type(modules[path])


def assign_tensors(tree: dict[str, Any], modules: dict[str, nn.Module], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put every saved tensor in its slot(s); one object per key, so tied weights stay tied.
    Returns key → the object now in the tree."""
    objects: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def tensor(key: Any, parameter: bool, requires_grad: bool, where: str) -> torch.Tensor:
        if not isinstance(key, str) or key not in weights:
            raise SerializationError(f"tensor {str(key)[:80]!r} is missing from {WEIGHTS}.")
        used.add(key)
        obj = objects.get(key)
        if obj is None:
            try:
                obj = nn.Parameter(weights[key], requires_grad=requires_grad) if parameter else weights[key]
            except RuntimeError as err:  # an integer tensor cannot require grad
                raise SerializationError(f"{where}: tensor {key!r} cannot be this parameter: {err}") from err
            objects[key] = obj
        elif isinstance(obj, nn.Parameter) != parameter:
            raise SerializationError(f"tensor {key!r} is used both as a parameter and as a buffer.")
        return obj

    for slot in entries(tree, "tensors", MODULES):
        path = field_of(slot, "module", str)
        name = field_of(slot, "name", str)
        role = field_of(slot, "role", str)
        module = modules.get(path)
        if module is None or role not in ("parameter", "buffer") or not is_atom(name):
            raise SerializationError(f"malformed tensor slot in {MODULES}: {str(slot)[:120]}")
        where = f"{path}.{name}" if path else name
        key = slot.get("key")
        slots = module._parameters if role == "parameter" else module._buffers
        if name not in slots:
            check_attribute(_owner_class(modules, path), name, f"tensor slot ({role})")
        if key is None:
            if name in slots and slots[name] is not None:
                raise SerializationError(f"{where} was saved as None but the constructor created it.")
            slots[name] = None
            continue
        if isinstance(key, str) and key in weights:
            _check_tensor(where, weights[key], slot, slots.get(name))
        value = tensor(key, role == "parameter", slot.get("requires_grad", True) is True, where)
        try:
            if name in slots:
                setattr(module, name, value)  # keeps subclasses' bookkeeping (RNN flat weights) in step
            elif role == "parameter":
                module.register_parameter(name, value)  # type: ignore[arg-type]
            else:
                module.register_buffer(name, value)
        except (KeyError, TypeError, AttributeError) as err:
            raise SerializationError(f"cannot put tensor {key!r} at {where}: {err}") from err
        if role == "buffer":
            if slot.get("persistent", True):
                module._non_persistent_buffers_set.discard(name)
            else:
                module._non_persistent_buffers_set.add(name)
    for c in entries(tree, "constants", MODULES):
        target = field_of(c, "path", str)
        owner_path, _, name = target.rpartition(".")
        if owner_path not in modules or not is_atom(name):
            raise SerializationError(f"bad constant {target[:120]!r} in {MODULES}.")
        owner = modules[owner_path]
        check_attribute(_owner_class(modules, owner_path), name, "tensor constant")
        if name in owner.__dict__ or name in owner._parameters or name in owner._buffers or name in owner._modules:
            raise SerializationError(f"constant {target!r} would replace an existing attribute.")
        key = field_of(c, "key", str)
        if key not in weights:
            raise SerializationError(f"tensor {key[:80]!r} is missing from {WEIGHTS}.")
        value = objects.get(key, weights[key])
        _check_tensor(target, value, c, None)
        object.__setattr__(owner, name, value)
        used.add(key)
    unused = set(weights) - used - tensor_keys_of(tree["modules"])
    if unused:
        raise SerializationError(f"{WEIGHTS} holds tensors no module uses ({sorted(unused)[:5]}): files do not belong together.")
    return {**weights, **objects}


def tensor_keys_of(module_entries: list[Any]) -> set[str]:
    """Keys of tensors held as attributes or by saved objects (opaque parts' owners), walked
    without recursion."""
    keys: set[str] = set()
    stack: list[Any] = [[e.get("attrs"), e.get("owner")] for e in module_entries if isinstance(e, dict)]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if v.get("$") == "tensor" and isinstance(v.get("v"), str):
                keys.add(v["v"])
            elif v.get("$") == "object":
                params, buffers = v.get("parameters"), v.get("buffers")
                for p in params.values() if isinstance(params, dict) else ():
                    if isinstance(p, list) and p and isinstance(p[0], str):
                        keys.add(p[0])
                keys.update(b for b in (buffers.values() if isinstance(buffers, dict) else ()) if isinstance(b, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return keys


def check_no_meta(root: nn.Module) -> None:
    for path, module in root.named_modules():
        for name, t in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise SerializationError(
                    f"{path or 'root'}.{name} ({type(module).__name__}) has no saved value: its constructor "
                    f"creates a tensor fxprep did not save. Please report this with the module class."
                )


def build_graph(graph_json: dict[str, Any], root: nn.Module, policy: TrustPolicy) -> fx.Graph:
    graph = fx.Graph()
    decode = Decoder(policy, types_ok=True)
    for entry in entries(graph_json, "nodes", GRAPH):
        name = field_of(entry, "name", str)
        op = field_of(entry, "op", str)
        if not name.isidentifier() or name in decode.nodes:
            raise SerializationError(f"bad node name {name[:80]!r} in {GRAPH}.")
        target: Any = entry.get("target")
        if op == "call_function":
            target = policy.function(target.get("fn") if isinstance(target, dict) else None)
        elif op in ("call_module", "get_attr"):
            if not isinstance(target, str):
                raise SerializationError(f"node {name!r}: malformed target.")
            # any module name nn.Module accepts ("block1-0" in regnet); only the tree is searched
            if not all(is_atom(part) and not part.startswith("__") for part in target.split(".")):
                raise SerializationError(f"node {name!r}: malformed {op} target {target[:80]!r}.")
            try:
                (root.get_submodule if op == "call_module" else _get_attr_checker(root))(target)
            except AttributeError as err:
                raise SerializationError(f"node {name!r}: {op} target {target!r} does not exist in the module tree.") from err
        elif op == "call_method":
            check_member(target, "method", policy.allow)
        elif op in ("placeholder", "output"):
            if not isinstance(target, str) or (op == "placeholder" and not target.lstrip("*").isidentifier()):
                raise SerializationError(f"node {name!r}: malformed target.")
        else:
            raise SerializationError(f"node {name!r}: unknown op {str(op)[:40]!r}.")
        args, kwargs = _call_args(entry, decode, f"node {name!r}")
        if op == "call_function" and target is builtins.getattr:
            check_getattr(args[1] if len(args) >= 2 else None)
        if op == "call_module":
            _check_slots(root.get_submodule(target), args, kwargs, name)
        type_expr = TYPES.get(entry["type"]) if isinstance(entry.get("type"), str) else None
        try:
            node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        except Exception as err:  # noqa: BLE001 - fx refusing the node is a file problem
            raise SerializationError(f"node {name!r} cannot be created: {err}") from err
        if node.name != name:
            raise SerializationError(f"node name {name!r} cannot be reproduced (got {node.name!r}).")
        decode.nodes[name] = node
    check_state_regions(graph, root)
    codegen = graph_json.get("codegen")
    if codegen is not None:
        graph._codegen = _pytree_codegen(codegen)
    try:
        graph.lint()
    except Exception as err:  # noqa: BLE001 - an invalid saved graph is a SerializationError
        raise SerializationError(f"{GRAPH} does not describe a valid graph: {err}") from err
    return graph


def _check_slots(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
    """An op's input slots must be inputs its call site passes (else it fails, or reads another)."""
    if isinstance(module, ops.BoundOp):
        slots = [s.index for s in pytree.tree_leaves((module.args, module.kwargs), is_leaf=lambda x: isinstance(x, ops.Slot))
                 if isinstance(s, ops.Slot)]
        if kwargs or any(i >= len(args) for i in slots):
            raise SerializationError(f"node {name!r}: its op reads inputs {sorted(set(slots))}, the call passes {len(args)}.")


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
# a model's own output container (Llava's, GOT-OCR2's ``...CausalLMOutputWithPast``) lives in its modelling
# module, which ``import transformers`` does not import: one of transformers' own, importable by name
_MODEL_MODULE = re.compile(r"transformers\.models\.[a-z0-9_]+\.modeling_[a-z0-9_]+")


def _import_pytree_types(spec: dict[str, Any]) -> None:
    """Import the modules that register the calling convention's container types (a transformers
    ``ModelOutput``), so a fresh process can load the module; only known container modules and
    transformers' own modelling modules (by a pattern: nothing else a file names is imported)."""
    names: set[str] = set()
    stack: list[Any] = []
    for key in ("in_spec", "out_spec"):
        if isinstance(spec.get(key), str):
            try:
                data = json.loads(spec[key])
            except (ValueError, RecursionError) as err:
                raise SerializationError(f"malformed calling convention (pytree spec) in {GRAPH}.") from err
            check_shape(data, Path(GRAPH))
            stack.append(data)
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("type"), str):
                names.add(v["type"])
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    for name in names:
        module = name.rpartition(".")[0]
        if module in _CONTAINER_MODULES or _MODEL_MODULE.fullmatch(module):
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
    except Exception as err:  # noqa: BLE001 - an unreadable saved spec is a SerializationError
        raise SerializationError(
            f"cannot read the calling convention (pytree spec) in {GRAPH}: {str(err)[:200]}. If it names a container "
            f"type from a library (transformers ModelOutput), import that library before fxprep.load."
        ) from err
    info = fx.graph._PyTreeInfo(orig_args, in_spec, out_spec)
    defaults = spec.get("defaults")
    if defaults is None:
        return fx.graph._PyTreeCodeGen(info)
    from ..capture.fx import _PyTreeCodeGenWithDefaults

    values = Decoder(TrustPolicy())(defaults)
    # written into the generated forward's signature: names it has, values that are plain literals
    if not isinstance(values, dict) or not all(
        k in orig_args and (v is None or type(v) in (bool, int, str) or (type(v) is float and math.isfinite(v)))
        and len(repr(v)) < 200 for k, v in values.items()
    ):
        raise SerializationError(f"malformed argument defaults in {GRAPH}: {str(defaults)[:120]}")
    return _PyTreeCodeGenWithDefaults(info, values)


def report_from_dict(data: Any, directory: Path) -> Report:
    """The report saved in the manifest, plus a note saying where it was loaded from."""
    if not isinstance(data, dict):
        report = Report("unknown")
    else:
        try:
            report = Report.from_dict(data)
        except Exception as err:  # noqa: BLE001 - any malformed report is a file problem
            raise SerializationError(f"the report in {MANIFEST} is malformed: {str(err)[:200]}") from err
    try:
        report.note(f"loaded from {directory} (fxprep.load)")
    except Exception as err:  # noqa: BLE001 - a malformed saved report is a SerializationError
        raise SerializationError(f"the report in {MANIFEST} is malformed: {str(err)[:200]}") from err
    return report


__all__ = ["LIMITS", "Decoder", "assign_tensors", "build_graph", "build_modules", "check_no_meta",
           "check_state_regions", "field_of", "finish_modules", "report_from_dict", "set_attrs"]
