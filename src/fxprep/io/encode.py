"""Save side: a prepared GraphModule as JSON entries and a table of tensors.

:class:`Encoder` turns values into tagged JSON (tensors become keys into the weights file,
functions importable names checked to resolve to the very function, :func:`function_name`).
:class:`TreeWriter` describes each module of the tree as one of the :data:`~.format.KINDS`: a
``torch.nn`` layer by its constructor arguments read back from its attributes (:func:`init_kwargs`,
checked by rebuilding it on ``meta``), an ``fxprep.ops`` op by its callable and argument template,
anything else trusted by its plain attributes. :func:`graph_json` writes the node list.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .. import ops
from ..errors import SerializationError
from . import checked, parametrized
from .allowlist import canonical_name
from .format import CONTAINERS, HOOK_DICTS, TYPE_NAMES, own_attrs, tensor_record
from .objects import ObjectWriter, class_name, opaque_code_name, trust_hint
from .trust import TrustPolicy, check_attribute, check_member, default_function_name


# --- naming functions and classes ----------------------------------------------------------------
def function_name(fn: Any) -> str:
    """The name a graph target or op callable is saved under, chosen so that :mod:`.trust` gives
    back this very object: its allow-list name (torch ops, ``math``, ``operator``, builtins),
    ``torch.ops.<ns>.<op>.<overload>`` for OpOverloads, ``Tensor.<method>``, or, for anything else,
    its own ``module.qualname`` (loadable with that package in ``trusted_modules``) when that name
    leads back to it."""
    if isinstance(fn, ops._MethodCall):
        return f"Tensor.{fn.name}"
    caller_of = getattr(fn, "autograd_function", None)
    if caller_of is not None:
        name = canonical_name(caller_of)
        if name is not None and _defined_as(caller_of, name):
            return f"autograd:{name}"
    elif (op := ops.op_name(fn)) is not None:
        return op
    else:
        name = checked.saved_name(fn) or default_function_name(fn)
        if name is not None:
            return name
        name = canonical_name(fn)
        if name is not None and _defined_as(fn, name):
            return name
    raise SerializationError(
        f"cannot save a call to {fn!r}: it has no importable name that leads back to it. "
        f"Define it at module level, or mark the calling module fxprep.opaque / modules_to_exclude."
    )


def custom_op_modules(gm: fx.GraphModule) -> dict[str, str]:
    """For each custom op (outside aten) that ``gm`` or one of its op modules calls, the Python
    module that registered it, where torch records one (``torch.library.custom_op``): some
    libraries register theirs only when that module is imported (transformers' MoE ops live in
    ``transformers.integrations.moe``, which ``import transformers`` does not import), so a fresh
    process loading the save imports it first (:meth:`.trust.TrustPolicy.import_op_modules`)."""
    from torch._library import custom_ops

    defs = getattr(custom_ops, "OPDEFS", {})
    found: dict[str, str] = {}
    for module in gm.modules():
        fns = [n.target for n in module.graph.nodes if n.op == "call_function"] if isinstance(module, fx.GraphModule) else []
        if isinstance(module, ops.BoundOp):
            fns.append(module.fn)
        for fn in fns:
            packet = fn.overloadpacket if isinstance(fn, torch._ops.OpOverload) else fn
            if not isinstance(packet, torch._ops.OpOverloadPacket) or packet._qualified_op_name.startswith("aten::"):
                continue
            source = getattr(getattr(defs.get(packet._qualified_op_name), "_init_fn", None), "__module__", None)
            if isinstance(source, str):
                found[packet._qualified_op_name] = source
    return found


def _defined_as(obj: Any, name: str) -> bool:
    """Whether ``name`` (``module.qualname``) finds ``obj`` in its already-imported module."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None:
        return False
    found: Any = module
    for part in name.removeprefix(module.__name__ + ".").split("."):
        found = vars(found).get(part) if hasattr(found, "__dict__") else None
        if found is None:
            return False
    return found is obj


@dataclass
class Encoder:
    """Turns Python values into tagged JSON. ``tensor_key`` (when given) names a tensor in the
    weights file; ``where`` says what is being encoded, for error messages."""

    where: str
    tensor_key: Callable[[torch.Tensor], str] | None = None
    objects: Callable[[Any, str], Any] | None = None  # helper objects of opaque parts (ObjectWriter.encode)

    def __call__(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) in (int, bool):
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
        if isinstance(v, fx.Node):
            return {"$": "node", "v": v.name}
        if isinstance(v, ops.Slot):
            return {"$": "slot", "v": v.index}
        if isinstance(v, torch.Size):
            return {"$": "size", "v": [int(x) for x in v]}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$": "tuple", "v": [self(x) for x in v]}
        if type(v) is list or isinstance(v, fx.immutable_collections.immutable_list):
            return [self(x) for x in v]
        if type(v) is dict or isinstance(v, fx.immutable_collections.immutable_dict):
            return {"$": "dict", "v": [[self(k), self(x)] for k, x in v.items()]}
        if type(v) in (set, frozenset):  # of plain values only (transformers' _keep_in_fp32_modules)
            if not all(x is None or type(x) in (bool, int, float, str) for x in v):
                raise SerializationError(f"cannot save {self.where}: a {type(v).__name__} of other than numbers and "
                                         f"strings has no safe saved form.")
            return {"$": type(v).__name__, "v": sorted(v, key=repr)}
        if isinstance(v, slice):
            return {"$": "slice", "v": [self(v.start), self(v.stop), self(v.step)]}
        if v is Ellipsis:
            return {"$": "ellipsis"}
        if isinstance(v, complex):
            return {"$": "complex", "v": [v.real, v.imag]}
        if isinstance(v, torch.dtype):
            return {"$": "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$": "device", "v": str(v)}
        if isinstance(v, torch.memory_format):
            return {"$": "memory_format", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.layout):
            return {"$": "layout", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Tensor) and self.tensor_key is not None:
            return {"$": "tensor", "v": self.tensor_key(v)}
        if isinstance(v, type) and v in TYPE_NAMES:
            return {"$": "type", "v": TYPE_NAMES[v]}
        if callable(v) and not isinstance(v, (type, nn.Module)):
            try:
                return {"$": "fn", "v": function_name(v)}
            except SerializationError:
                if self.objects is None or not _plain_object(v):
                    raise
        if self.objects is not None and (isinstance(v, nn.Module) or _plain_object(v)):
            return self.objects(v, self.where)
        raise SerializationError(
            f"cannot save {self.where}: a {type(v).__qualname__} has no safe saved form (fxprep saves tensors, "
            f"numbers, strings, dtypes, devices, slices, tuples/lists/dicts of those, sets of numbers and strings, and functions "
            f"with an importable name)."
        )


def _plain_object(v: Any) -> bool:
    """An instance of an ordinary class with its state in ``__dict__`` (a box coder, a matcher)."""
    return hasattr(v, "__dict__") and not isinstance(
        v, (type, type(sys), types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor)
    )


# Constructor arguments whose value is not stored under their own name.
_INIT_OVERRIDES: dict[type, Callable[[nn.Module], dict[str, Any]]] = {
    nn.MultiheadAttention: lambda m: {"bias": m.in_proj_bias is not None, "add_bias_kv": m.bias_k is not None},
}


def init_kwargs(module: nn.Module) -> dict[str, Any] | None:
    """Constructor arguments of a ``torch.nn`` layer, read back from its attributes (None when some
    required argument is not stored). Tensor-valued flags (``bias``) become booleans; ``device``,
    ``dtype`` and private arguments take their defaults (tensors are assigned after construction)."""
    cls = type(module)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if isinstance(module, nn.RNNBase) and cls is not nn.RNNBase:
            # LSTM/GRU/RNN take (*args, **kwargs) and pass their mode to RNNBase themselves.
            params = [p for p in list(inspect.signature(nn.RNNBase.__init__).parameters.values())[1:] if p.name != "mode"]
            if isinstance(module, nn.RNN):
                params.append(inspect.Parameter("nonlinearity", inspect.Parameter.KEYWORD_ONLY, default="tanh"))
    except (TypeError, ValueError):
        return None
    override = _INIT_OVERRIDES.get(cls, lambda m: {})(module)
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("device", "dtype") or p.name.startswith("_"):
            continue
        if p.name in override:
            kwargs[p.name] = override[p.name]
            continue
        try:
            value = getattr(module, p.name)
        except AttributeError:
            if p.default is p.empty:
                return None
            continue
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        elif isinstance(value, (torch.Tensor, nn.Module)):
            if p.default is p.empty:
                return None
            continue
        if p.default is not p.empty and _same(value, p.default):
            continue  # defaults are left out: shorter, and some classes refuse explicit defaults (GRU proj_size)
        kwargs[p.name] = value
    return kwargs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, weakref.ref) and isinstance(b, weakref.ref):
        return True  # caches of references to tensors (RNN flat weights): rebuilt by the class itself
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - a value whose == raises is not the same value
        return False


def _class_of(module: nn.Module) -> Any:
    """A module's class; for a class torch.nn.utils.parametrize generated (a new one per module), the
    class it was made from."""
    return ("parametrized", type(module).__bases__) if parametrized.is_parametrized(module) else type(module)


def _structure_matches(original: nn.Module, rebuilt: nn.Module) -> bool:
    """Same subtree paths and classes, same tensor slots (names, None-ness, shapes), same buffer
    persistence and no more hooks than the constructor itself registers."""
    a = list(original.named_modules(remove_duplicate=False))
    b = list(rebuilt.named_modules(remove_duplicate=False))
    if [(n, _class_of(m)) for n, m in a] != [(n, _class_of(m)) for n, m in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        for slots in ("_parameters", "_buffers"):
            sx, sy = getattr(x, slots), getattr(y, slots)
            if sx.keys() != sy.keys():
                return False
            for k in sx:
                if (sx[k] is None) != (sy[k] is None) or (sx[k] is not None and sx[k].shape != sy[k].shape):
                    return False
        if x._non_persistent_buffers_set != y._non_persistent_buffers_set:
            return False
        if any(len(getattr(x, h)) > len(getattr(y, h)) for h in HOOK_DICTS):
            return False
        tensors_x = {k for k, v in own_attrs(x).items() if isinstance(v, torch.Tensor)}
        tensors_y = {k for k, v in own_attrs(y).items() if isinstance(v, torch.Tensor)}
        if tensors_x or tensors_y:
            return False  # plain tensor attributes are not restored by construction
    return True


@dataclass
class TreeWriter:
    """Builds the modules.json entries and the tensor table of one GraphModule."""

    gm: fx.GraphModule
    policy: TrustPolicy = field(default_factory=TrustPolicy)  # packages whose code opaque parts may name
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    key_of: dict[int, str] = field(default_factory=dict)
    slots: list[dict[str, Any]] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def tensor_key(self, t: torch.Tensor, suggested: str) -> str:
        key = self.key_of.get(id(t))
        if key is None:
            if t.is_meta:
                raise SerializationError(
                    f"cannot save tensor {suggested!r}: it is on the meta device (no data). Load the real "
                    f"weights into the prepared module first (gm.load_state_dict(..., assign=True))."
                )
            if t.layout != torch.strided or t.is_quantized:
                raise SerializationError(f"cannot save tensor {suggested!r}: {t.layout} / quantized tensors are not supported.")
            key = suggested
            while key in self.tensors:
                key += "_"
            self.key_of[id(t)] = key
            self.tensors[key] = t
        return key

    def write(self) -> None:
        self._paths_by_id: dict[int, list[str]] = {}
        for n, m in self.gm.named_modules(remove_duplicate=False):
            self._paths_by_id.setdefault(id(m), []).append(n)
        self.objects = ObjectWriter(self.policy, {i: paths[0] for i, paths in self._paths_by_id.items()},
                                    self.tensor_key, Encoder)
        seen: dict[int, str] = {}
        owned: set[str] = set()
        for path, module in self.gm.named_modules(remove_duplicate=False):
            entry: dict[str, Any] = {"path": path, "training": module.training}
            if id(module) in seen:
                entry.update(kind="same_as", of=seen[id(module)])
                self.entries.append(entry)
                continue
            seen[id(module)] = path
            entry["class"] = class_name(type(module))
            self._record_slots(path, module)  # first, so tensors are keyed by their slot path
            if module is self.gm:
                entry["kind"] = "root"
                self._check_root_hooks()
            elif path in owned:
                entry["kind"] = "owned"
            else:
                entry.update(self._describe(path, module, owned))
            self.entries.append(entry)

    def _check_root_hooks(self) -> None:
        if any(getattr(self.gm, h) for h in HOOK_DICTS):
            raise SerializationError("cannot save: the prepared module has forward/backward hooks, which have no saved form.")

    def _describe(self, path: str, module: nn.Module, owned: set[str]) -> dict[str, Any]:
        cls = type(module)
        if isinstance(module, fx.GraphModule):  # a torch.cond branch: its own graph, its children as usual
            return {"kind": "graph", "graph": graph_json(module, self.policy)}
        where = f"module {path!r} ({class_name(cls)})"
        if isinstance(module, ops.BoundOp):
            enc = Encoder(where)
            return {"kind": "bound_op", "fn": function_name(module.fn), "args": [enc(a) for a in module.args],
                    "kwargs": {k: enc(v) for k, v in module.kwargs.items()}}
        if opaque_code_name(module) is not None:
            return self._opaque(path, module)
        if parametrized.is_parametrized(module):
            return self._parametrized(path, module, owned, where)
        if any(getattr(module, h) for h in HOOK_DICTS if not cls.__module__.startswith("torch.")):
            raise SerializationError(f"cannot save {where}: it has forward/backward hooks, which have no saved form.")
        if cls in CONTAINERS:
            if own_attrs(module):
                return self._state(path, module)
            return {"kind": "container"}
        if cls.__module__.startswith(("torch.nn.", "torch.ao.nn.")):
            described = self._init(path, module, owned)
            if described is not None:
                return described
        return self._state(path, module)

    def _parametrized(self, path: str, module: nn.Module, owned: set[str], where: str) -> dict[str, Any]:
        """A torch.nn layer with torch's weight_norm (:mod:`.parametrized`): its base class's
        constructor call plus the parametrizations load applies again with torch's own code."""
        base, spec = parametrized.describe(module, where)
        if not base.__module__.startswith(("torch.nn.", "torch.ao.nn.")):
            raise SerializationError(
                f"cannot save {where}: fxprep saves weight_norm on torch.nn layers only (rebuilt from their "
                f"constructor arguments), and {class_name(base)} is not one. Remove the parametrization first "
                f"(torch.nn.utils.parametrize.remove_parametrizations), or save the original model."
            )
        described = self._init(path, module, owned, base, spec)
        if described is None:
            raise SerializationError(
                f"cannot save {where}: a {class_name(base)} with weight_norm is saved as that layer rebuilt from its "
                f"constructor arguments with torch's weight_norm applied again, and this one is not what that "
                f"rebuilds (other hooks, tensors or submodules, or parts shared with other modules)."
            )
        return {**described, "class": class_name(base), "parametrize": spec}

    def _init(self, path: str, module: nn.Module, owned: set[str], base: type[nn.Module] | None = None,
              spec: dict[str, Any] | None = None) -> dict[str, Any] | None:
        kwargs = init_kwargs(module)
        if kwargs is None:
            return None
        try:
            with torch.device("meta"):
                rebuilt = (base or type(module))(**kwargs)
                if spec is not None:
                    parametrized.apply(rebuilt, spec, path)
        except Exception:  # noqa: BLE001 - not reconstructible this way: fall back to "state"
            return None
        if not _structure_matches(module, rebuilt):
            return None
        if spec is not None and not all(parametrized.same_hooks(x, y) for x, y in zip(module.modules(), rebuilt.modules())):
            return None
        # Everything the constructor creates below this module must not be shared with the outside.
        for m in module.modules():
            if any(not (n == path or n.startswith(path + ".")) for n in self._paths_by_id.get(id(m), [])):
                return None
        patches: dict[str, dict[str, Any]] = {}
        for (sub, x), (_, y) in zip(module.named_modules(remove_duplicate=False), rebuilt.named_modules(remove_duplicate=False)):
            ax, ay = own_attrs(x), own_attrs(y)
            if not ay.keys() <= ax.keys():
                return None
            # attributes set after construction (transformers' _is_hf_initialized) are patched in too
            diff = {k: v for k, v in ax.items() if k not in ay or not _same(v, ay[k])}
            if diff:
                try:
                    enc = Encoder(f"attributes of {path}.{sub}")
                    patches[sub] = {k: enc(v) for k, v in diff.items()}
                except SerializationError:
                    return None
        for sub, _ in module.named_modules(remove_duplicate=False):
            if sub:
                owned.add(f"{path}.{sub}")
        enc = Encoder(f"constructor of {path!r}")
        return {"kind": "init", "init": {k: enc(v) for k, v in kwargs.items()}, "patch": patches}

    def _opaque(self, path: str, module: nn.Module) -> dict[str, Any]:
        """An opaque part, by the name of the code it runs, when that code is in a trusted package."""
        what, fn = opaque_code_name(module)  # type: ignore[misc]
        part = f"{path!r}, an opaque part of the model"
        if fn is None or not self.policy.trusted_code(fn):
            raise SerializationError(f"cannot save {part}: it runs {what} eagerly, and " + trust_hint(what, self.policy))
        if hasattr(module, "method"):
            owner = self.objects.encode(module.__dict__["owner"], f"{path}.owner")
            return {"kind": "opaque_method", "method": module.method, "owner_path": str(module.owner_path), "owner": owner}
        return {"kind": "opaque_function", "fn": what}

    def _state(self, path: str, module: nn.Module) -> dict[str, Any]:
        cls = type(module)
        where = f"module {path!r} of class {class_name(cls)}"
        if any(getattr(module, h) for h in (*HOOK_DICTS, "_state_dict_hooks", "_load_state_dict_pre_hooks")):
            raise SerializationError(f"cannot save {where}: it has hooks, which have no saved form."
                                     + parametrized.hooks_hint(module))
        attrs = {}
        for k, v in own_attrs(module).items():
            if k.startswith("__"):
                continue
            try:
                check_attribute(cls, k)
            except SerializationError as err:
                raise SerializationError(f"cannot save {where}: it could not be loaded back ({err}).") from err
            try:
                attrs[k] = self._attribute_encoder(f"{where}, attribute {k!r}", f"{path}.{k}")(v)
            except SerializationError as err:
                if "trusted_modules" in str(err):
                    raise
                raise SerializationError(
                    f"cannot save {where}: attribute {k!r} holds a {type(v).__qualname__}, which has no safe "
                    f"saved form; fxprep does not know its constructor, and saves such modules from their plain "
                    f"attributes only. Let fxprep trace into it instead of keeping it as a leaf, or save the "
                    f"original model."
                ) from err
        return {"kind": "state", "attrs": attrs}

    def _attribute_encoder(self, where: str, name: str) -> Encoder:
        """An Encoder for the attribute saved as ``name``: the tensors and helper objects it holds are
        named after it."""
        return Encoder(where, lambda t: self.tensor_key(t, name), lambda obj, _: self.objects.encode(obj, name))

    def _record_slots(self, path: str, module: nn.Module) -> None:
        for role, slots in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in slots.items():
                key = None if t is None else self.tensor_key(t, f"{path}.{name}" if path else name)
                slot = {"module": path, "name": name, "role": role, "key": key, **({} if t is None else tensor_record(t))}
                if role == "parameter" and t is not None:
                    slot["requires_grad"] = bool(t.requires_grad)
                if role == "buffer":
                    slot["persistent"] = name not in module._non_persistent_buffers_set
                self.slots.append(slot)

    def constants(self) -> list[dict[str, Any]]:
        """Plain tensor attributes read by get_attr nodes (fx's ``_tensor_constant0``), in the
        graph and in nested branch graphs (paths from the root)."""
        out = []
        graphs = [(p, m) for p, m in self.gm.named_modules() if isinstance(m, fx.GraphModule)]
        for prefix, module in graphs:
            out += self._constants(module, f"{prefix}." if prefix else "")
        return out

    def _constants(self, gm: fx.GraphModule, prefix: str) -> list[dict[str, Any]]:
        out = []
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            owner_path, _, name = str(node.target).rpartition(".")
            try:
                owner = gm.get_submodule(owner_path)
            except AttributeError as err:
                raise SerializationError(f"get_attr {node.target!r} points nowhere.") from err
            if name in owner._parameters or name in owner._buffers or name in owner._modules:
                continue
            value = getattr(owner, name, None)
            if not isinstance(value, torch.Tensor):
                raise SerializationError(
                    f"cannot save get_attr {node.target!r}: a {type(value).__qualname__} (nested graphs such as "
                    f"torch.cond branches, script objects) has no saved form yet."
                )
            path = prefix + str(node.target)
            out.append({"path": path, "key": self.tensor_key(value, path), **tensor_record(value)})
        return out


# --- graph: save side ---------------------------------------------------------------------------
def graph_json(gm: fx.GraphModule, policy: TrustPolicy | None = None) -> dict[str, Any]:
    nodes = []
    for node in gm.graph.nodes:
        enc = Encoder(f"node {node.name!r} ({node.op} {node.target})")
        if node.op == "call_function":
            target: Any = {"fn": function_name(node.target)}
        else:
            target = str(node.target)
        if node.op == "call_method":
            try:  # what load would refuse is refused here, where the model can still be changed
                check_member(node.target, "method", policy.allow if policy is not None else ())
            except SerializationError as err:
                raise SerializationError(f"cannot save node {node.name!r}: {str(err).removeprefix('refusing to load: ')}"
                                         ) from err
        entry = {"name": node.name, "op": node.op, "target": target, "args": [enc(a) for a in node.args],
                 "kwargs": {k: enc(v) for k, v in node.kwargs.items()}}
        try:
            if node.type is not None and node.type in TYPE_NAMES:
                entry["type"] = TYPE_NAMES[node.type]
        except TypeError:  # unhashable annotation: left out (it only changes the printed code)
            pass
        nodes.append(entry)
    return {"class_name": type(gm).__name__, "nodes": nodes, "codegen": codegen_json(gm.graph)}


def codegen_json(graph: fx.Graph) -> dict[str, Any] | None:
    codegen = graph._codegen
    if type(codegen) is fx.graph.CodeGen:
        return None
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        info = codegen.pytree_info
        try:
            out = {
                "kind": "pytree",
                "orig_args": list(info.orig_args),
                "in_spec": None if info.in_spec is None else pytree.treespec_dumps(info.in_spec),
                "out_spec": None if info.out_spec is None else pytree.treespec_dumps(info.out_spec),
            }
        except Exception as err:  # noqa: BLE001 - any spec failure becomes SerializationError
            raise SerializationError(f"cannot save the module's calling convention (pytree spec): {err}") from err
        # defaults of arguments fixed by concrete_args (``targets=None`` of a detector)
        defaults = getattr(codegen, "defaults", None)
        if defaults:
            out["defaults"] = Encoder("the calling convention's defaults")(dict(defaults))
        return out
    raise SerializationError(f"cannot save a graph with custom code generation {type(codegen).__qualname__}.")
