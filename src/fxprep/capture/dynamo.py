"""Dynamo capture, re-lifted to module level.

``torch._dynamo.export`` (``aten_graph=False``) records a torch-level graph (``F.relu``,
``operator.add``, Tensor methods) and fails less often than ``torch.fx`` on real code (shape
arithmetic, ``len``, most Python). What it gives back is not what a quantization toolkit wants,
though: modules are inlined or bound to Dynamo's own copies named ``L__self___layer1_0_conv1``,
parameters are attributes with mangled names, the call signature is flattened, ``torch.no_grad``
regions are ``_set_grad_enabled`` calls and devices are baked in as literals. This module turns
that graph back into one that looks like an fx capture of the user's model:

* every leaf module (``torch.nn``/``torch.ao.nn`` layers, as in fx; user subclasses that keep such a
  layer's ``forward``, e.g. torchvision's ``Conv3DSimple(nn.Conv3d)``; plus what the
  :class:`~fxprep.capture.common.LeafPolicy` names) is ONE ``call_module`` bound to the user's own
  module object under its original qualified name (``layer1.0.conv1``), found by identity through
  ``named_modules(remove_duplicate=False)``;
* parameters and buffers are ``get_attr`` nodes reading the user's own tensors under their
  original names, so ``state_dict`` keys and Parameter identity are preserved;
* ``node.meta['nn_module_stack']`` holds fx-style ``(qualified name, class)`` values;
* the prepared module is called exactly like the original (keyword arguments included) and
  returns exactly the original output type (``ModelOutput``, dict, tuple, registered dataclass).

Two routes lead there, both tested:

``"flag"``
    ``torch._dynamo.config.install_free_tensors_for_export = False`` (a private flag announced as
    temporary, feature-detected here, never version-pinned) makes Dynamo emit ``call_module`` for
    ``torch.nn`` leaves with their exact arguments; they only need re-targeting.
``"regroup"``
    Needs no private flag: Dynamo inlines everything, and the nodes of each leaf call (found by
    their ``nn_module_stack`` key, ``"<key>@k"`` for the k-th call of a reused module) are
    collapsed into one ``call_module``. The call's arguments (several inputs, keyword arguments,
    non-tensor flags such as ``need_weights=False``) and output structure are taken from one eager
    run with hooks on the leaves, and tied to graph nodes by identity (model inputs, parameters,
    other leaves' outputs), then shape, then value. That run keeps no tensors: only shapes, dtypes,
    identities and a fingerprint of the values, so its memory stays flat. Leaves that compute
    nothing (``nn.Identity``) are re-inserted where they were called. The same regrouping turns
    user-named leaves (``module_classes_to_exclude``, e.g. transformers' ``LlamaRMSNorm``) into
    modules on both routes, since Dynamo always inlines non-``torch.nn`` modules.

Around each capture the user's model is protected: attributes ``forward`` writes (Dynamo replays
them with *fake* tensors) are restored, tensor caches in dict attributes (timm LeViT's
``attention_bias_cache``) are emptied so the graph computes them from the parameters instead of
baking them in as constants, and Dynamo's process-wide "dynamic class" marks are undone.

Nothing here raises for a capture failure: :func:`capture_dynamo` returns it in the
:class:`~fxprep.capture.common.CaptureAttempt` so the cascade can fall back to fx.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..inputs import ExampleInputs
from .common import CaptureAttempt, CaptureResult, LeafPolicy

ROUTES = ("auto", "flag", "regroup")
FLAG = "install_free_tensors_for_export"
ROUTE_META = "fxprep_dynamo_route"
SEED = 20260611

_GRAD_TOGGLES = {torch._C._set_grad_enabled}
_SYM_METHODS = {}
for _name, _method in (("sym_size", "size"), ("sym_stride", "stride")):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None and hasattr(_packet, "int"):
        _SYM_METHODS[_packet.int] = _method
if hasattr(torch.ops.aten, "sym_numel"):
    _SYM_METHODS[torch.ops.aten.sym_numel.default] = "numel"


class ReliftError(RuntimeError):
    """The Dynamo graph could not be turned back into a module-level graph (an fxprep limitation)."""


def flag_available() -> bool:
    """Whether this torch has the private Dynamo flag the ``"flag"`` route needs."""
    import torch._dynamo

    return hasattr(torch._dynamo.config, FLAG)


def default_route() -> str:
    return "flag" if flag_available() else "regroup"


# --------------------------------------------------------------------------------------------------
# Calls: what Dynamo is called with vs how the prepared module will be called
# --------------------------------------------------------------------------------------------------
@dataclass
class _Calls:
    capture: ExampleInputs  # example + concrete_args (what the original and Dynamo get)
    prepared: ExampleInputs  # example without concrete_args (how the prepared module is called)


def _split_calls(model: nn.Module, example: ExampleInputs, concrete_args: dict[str, Any] | None) -> _Calls:
    if not concrete_args:
        return _Calls(example, example)
    try:
        bound = inspect.signature(model.forward).bind_partial(*example.args, **example.kwargs)
        given = set(bound.arguments)
    except TypeError:
        given = set(example.kwargs)
    extra = {k: v for k, v in concrete_args.items() if k not in given}
    capture = ExampleInputs(example.args, {**example.kwargs, **extra})
    prepared = ExampleInputs(example.args, {k: v for k, v in example.kwargs.items() if k not in concrete_args})
    return _Calls(capture, prepared)


def _positional_names(model: nn.Module, count: int) -> list[str]:
    """Names for the first ``count`` positional arguments of ``model.forward`` (valid identifiers)."""
    names: list[str] = []
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if len(names) >= count:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            while len(names) < count:
                names.append(f"{p.name}_{len(names)}")
    while len(names) < count:
        names.append(f"arg_{len(names)}")
    return names


# --------------------------------------------------------------------------------------------------
# Dynamic shapes
# --------------------------------------------------------------------------------------------------
def _tensor_inputs(model: nn.Module, call: ExampleInputs) -> dict[str, Any]:
    names = _positional_names(model, len(call.args))
    return {**dict(zip(names, call.args)), **call.kwargs}


def dynamic_shapes_spec(model: nn.Module, call: ExampleInputs, dynamic: Any) -> dict[str, Any] | None:
    """``dynamic`` (``"batch"``, or ``{arg: {dim: name}}``) as a ``dynamic_shapes`` dict for export.

    Dimensions with the same name share one symbol. Arguments not named are static.
    """
    if dynamic is None or dynamic is False:
        return None
    from torch.export import Dim

    dims: dict[str, Any] = {}

    def dim(name: Any) -> Any:
        if not isinstance(name, str):
            return name  # already a Dim (or a hint such as Dim.DYNAMIC)
        if name not in dims:
            dims[name] = Dim(re.sub(r"\W", "_", name) or "d")
        return dims[name]

    inputs = _tensor_inputs(model, call)
    spec: dict[str, Any] = {}
    for name, value in inputs.items():
        if dynamic == "batch":
            spec[name] = (
                {0: dim("batch")} if isinstance(value, torch.Tensor) and value.dim() >= 1 else None
            )
        else:
            spec[name] = dynamic.get(name) if isinstance(dynamic, dict) else None
            if spec[name] is not None:
                spec[name] = {int(d): dim(n) for d, n in spec[name].items()}
    if isinstance(dynamic, dict):
        unknown = sorted(set(dynamic) - set(inputs))
        if unknown:
            raise ValueError(f"dynamic names {unknown} that are not inputs of this call (inputs: {list(inputs)})")
    for name, dims_of in spec.items():
        value = inputs[name]
        for d in dims_of or {}:
            if not isinstance(value, torch.Tensor) or not -value.dim() <= d < value.dim():
                raise ValueError(f"dynamic dimension {d} of {name!r} does not exist")
            if value.shape[d] < 2:
                raise ValueError(
                    f"dynamic dimension {d} of {name!r} has size {value.shape[d]} in the example: Dynamo "
                    f"specializes sizes 0 and 1, so give an example with size >= 2 there"
                )
    return spec


def dynamic_dims(model: nn.Module, call: ExampleInputs, dynamic: Any) -> dict[str, dict[int, str]]:
    """``{input name: {dim: symbol name}}`` of the dimensions ``dynamic`` makes dynamic."""
    out: dict[str, dict[int, str]] = {}
    inputs = _tensor_inputs(model, call)
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        if dynamic == "batch" and value.dim() >= 1:
            out[name] = {0: "batch"}
        elif isinstance(dynamic, dict) and dynamic.get(name):
            out[name] = {int(d): str(n) for d, n in dynamic[name].items()}
    return out


def grown_example(model: nn.Module, example: ExampleInputs, dynamic: Any, grow: int = 1) -> ExampleInputs:
    """A second example whose dynamic dimensions are ``grow`` larger (the extra rows repeat the
    first ones, so token ids and masks stay valid). Dimensions sharing a name grow together."""
    dims = dynamic_dims(model, example, dynamic)

    def grown(value: Any, spec: dict[int, str] | None) -> Any:
        if not isinstance(value, torch.Tensor) or not spec:
            return value
        for d in sorted(spec):
            d = d % value.dim()
            size = value.shape[d]
            reps = math.ceil((size + grow) / max(size, 1))
            value = torch.cat([value] * reps, dim=d).narrow(d, 0, size + grow)
        return value

    names = _positional_names(model, len(example.args))
    args = tuple(grown(a, dims.get(n)) for n, a in zip(names, example.args))
    kwargs = {k: grown(v, dims.get(k)) for k, v in example.kwargs.items()}
    return ExampleInputs(args, kwargs)


# --------------------------------------------------------------------------------------------------
# Temporary state around capture: tensor caches, HF attention implementation
# --------------------------------------------------------------------------------------------------
def tensor_caches(model: nn.Module) -> list[tuple[nn.Module, str, dict[Any, Any]]]:
    """Plain dict attributes holding tensors (e.g. timm LeViT's ``attention_bias_cache``): values
    computed from parameters on a first eval call and reused afterwards. Captured as they are, the
    parameter would silently become a constant."""
    found = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key.startswith("_") or not isinstance(value, dict) or not value:
                continue
            if all(isinstance(v, torch.Tensor) for v in value.values()):
                found.append((module, key, value))
    return found


class AttributeGuard:
    """Keeps the user's modules exactly as they were across a capture.

    Dynamo replays what ``forward`` writes to module attributes (``self.saved = y``,
    ``self.cache[k] = y``) onto the real objects, with *fake* tensors. Inside the guard every plain
    dict/list attribute is a copy (``caches`` ones start empty, see :func:`tensor_caches`), and on
    exit every module's ``__dict__`` gets its original entries back (new ones removed).
    :meth:`reset` re-establishes the capture-time state, e.g. before running the model eagerly
    after Dynamo has left fake tensors behind.
    """

    def __init__(self, model: nn.Module, caches: list[tuple[nn.Module, str, dict[Any, Any]]]):
        self.modules = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
        self.caches = {(id(m), key) for m, key, _ in caches}
        self.snapshots: list[tuple[nn.Module, dict[str, Any]]] = []
        self.written: set[str] = set()

    def __enter__(self) -> AttributeGuard:
        self.snapshots = [(m, dict(m.__dict__)) for m in self.modules]
        self._swap()
        return self

    def _swap(self) -> None:
        for module, snapshot in self.snapshots:
            for key, value in snapshot.items():
                if key.startswith("_"):
                    continue
                if type(value) is dict:
                    module.__dict__[key] = {} if (id(module), key) in self.caches else dict(value)
                elif type(value) is list:
                    module.__dict__[key] = list(value)

    def _restore(self) -> None:
        for module, snapshot in self.snapshots:
            current = module.__dict__
            for key in list(current):
                if key not in snapshot:
                    if not key.startswith("_"):
                        self.written.add(key)
                    del current[key]
            for key, value in snapshot.items():
                if current.get(key, _MISSING) is not value:
                    if not key.startswith("_") and type(value) not in (dict, list):
                        self.written.add(key)
                    current[key] = value

    def reset(self) -> None:
        self._restore()
        self._swap()

    def __exit__(self, *exc: Any) -> None:
        self._restore()


# --------------------------------------------------------------------------------------------------
# Names: the user's module / tensor objects by identity
# --------------------------------------------------------------------------------------------------
class _Names:
    def __init__(self, model: nn.Module):
        self.model = model
        self.modules: dict[int, str] = {}
        self.module_objs: dict[int, nn.Module] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.modules.setdefault(id(m), name)
            self.module_objs.setdefault(id(m), m)
        self.tensors: dict[int, tuple[str, str]] = {}  # id -> (qualname, kind)
        self.non_persistent: set[str] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            self.tensors.setdefault(id(p), (name, "parameter"))
        for mname, m in model.named_modules(remove_duplicate=False):
            prefix = f"{mname}." if mname else ""
            for b, t in m._buffers.items():
                if t is None:
                    continue
                self.tensors.setdefault(id(t), (prefix + b, "buffer"))
                if b in m._non_persistent_buffers_set:
                    self.non_persistent.add(prefix + b)
        for mname, m in model.named_modules(remove_duplicate=False):
            prefix = f"{mname}." if mname else ""
            for k, v in vars(m).items():
                if isinstance(v, torch.Tensor) and not k.startswith("__"):
                    self.tensors.setdefault(id(v), (prefix + k, "attribute"))

    def module_name(self, module: Any) -> str | None:
        return self.modules.get(id(module))


# --------------------------------------------------------------------------------------------------
# nn_module_stack sources → module objects
# --------------------------------------------------------------------------------------------------
_TOKEN = re.compile(
    r"\s*(?:(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|(?P<num>-?\d+)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<op>[.\[\](),]))"
)
_MISSING = object()


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot parse source {text!r} at {pos}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


class _SourceParser:
    """Evaluates Dynamo source names (``getattr(L['self'].layer1, '0').conv1``,
    ``L['self'].model.layers[slice(None, 2, None)].0``) against the root module."""

    def __init__(self, text: str, root: nn.Module):
        self.tokens = _tokenize(text)
        self.i = 0
        self.root = root

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str | None = None, value: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise ValueError(f"unexpected token {tok!r}")
        self.i += 1
        return tok[1]

    def literal(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise ValueError("unexpected end")
        if tok[0] == "str":
            self.i += 1
            return _unquote(tok[1])
        if tok[0] == "num":
            self.i += 1
            return int(tok[1])
        if tok == ("name", "None"):
            self.i += 1
            return None
        if tok == ("name", "slice"):
            self.i += 1
            self.take("op", "(")
            parts = [self.literal()]
            while self.peek() == ("op", ","):
                self.i += 1
                parts.append(self.literal())
            self.take("op", ")")
            return slice(*parts)
        raise ValueError(f"unexpected literal {tok!r}")

    def primary(self) -> Any:
        tok = self.peek()
        if tok == ("name", "getattr"):
            self.i += 1
            self.take("op", "(")
            obj = self.expr()
            self.take("op", ",")
            name = self.literal()
            self.take("op", ")")
            return getattr(obj, name)
        if tok is not None and tok[0] == "name" and tok[1] in ("L", "self"):
            self.i += 1
            if self.peek() == ("op", "["):
                self.take("op", "[")
                self.literal()
                self.take("op", "]")
            return self.root
        raise ValueError(f"unsupported source start {tok!r}")

    def expr(self) -> Any:
        obj = self.primary()
        while True:
            tok = self.peek()
            if tok == ("op", "."):
                self.i += 1
                nxt = self.peek()
                if nxt is None or nxt[0] not in ("name", "num"):
                    raise ValueError("bad attribute")
                self.i += 1
                obj = getattr(obj, nxt[1])
            elif tok == ("op", "["):
                self.i += 1
                key = self.literal()
                self.take("op", "]")
                obj = obj[key]
            else:
                return obj

    def parse(self) -> Any:
        obj = self.expr()
        if self.peek() is not None:
            raise ValueError("trailing tokens")
        return obj


def _unquote(text: str) -> str:
    import ast

    return ast.literal_eval(text)


def resolve_source(text: str, root: nn.Module) -> Any:
    """The object a Dynamo source name points at, or None when it cannot be evaluated."""
    try:
        return _SourceParser(text, root).parse()
    except Exception:  # noqa: BLE001 - unresolvable sources are handled by the caller
        return None


def _source_path(text: str) -> str:
    """A readable dotted path from a source name (only for modules outside the user's tree)."""
    text = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", text)
    text = re.sub(r"getattr\(", "", text)
    text = re.sub(r",\s*['\"]([^'\"]*)['\"]\)", r".\1", text)
    text = re.sub(r"\[(-?\d+)\]", r".\1", text)
    return re.sub(r"[^0-9A-Za-z_.]+", "_", text).strip("._")


@dataclass
class _Frame:
    key: str
    base: str
    k: int
    source: str
    cls: type
    module: nn.Module | None
    qualname: str


class _Stacks:
    """Resolves ``nn_module_stack`` entries to the user's modules (cached per key)."""

    def __init__(self, model: nn.Module, names: _Names):
        self.model = model
        self.names = names
        self.cache: dict[tuple[str, str], _Frame] = {}

    def frame(self, key: str, source: str, cls: type) -> _Frame:
        cached = self.cache.get((key, source))
        if cached is not None:
            return cached
        base, _, k = key.partition("@")
        obj = resolve_source(source, self.model) if isinstance(source, str) else None
        if not isinstance(obj, nn.Module) and base.isdigit():
            obj = self.names.module_objs.get(int(base))  # inlined route: keys are id(module)
        module = obj if isinstance(obj, nn.Module) else None
        qualname = self.names.module_name(module) if module is not None else None
        if qualname is None:
            qualname = _source_path(source) if isinstance(source, str) else base
        frame = _Frame(key, base, int(k) if k.isdigit() else 0, source, cls, module, qualname)
        self.cache[(key, source)] = frame
        return frame

    def of(self, node: fx.Node) -> list[_Frame]:
        stack = node.meta.get("nn_module_stack") or {}
        frames = []
        for key, value in stack.items():
            source, cls = value if isinstance(value, tuple) and len(value) == 2 else (str(value), object)
            frames.append(self.frame(str(key), source, cls))
        return frames


_TORCH_NN = ("torch.nn", "torch.ao.nn")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def default_leaf(module: nn.Module) -> bool:
    """``torch.fx``'s default leaf rule (``torch.nn``/``torch.ao.nn`` modules but Sequential), plus
    subclasses that keep such a layer's ``forward`` (torchvision's ``Conv3DSimple(nn.Conv3d)``,
    transformers' ``PoolFormerGroupNorm(nn.GroupNorm)``): they compute exactly that layer, and Dynamo
    calls them as modules on one route and inlines them on the other, so both routes agree only if
    they are leaves."""
    cls = type(module)
    if isinstance(module, _CONTAINERS):
        return False  # never called as such (fx calls ModuleList a leaf, but nothing calls it)
    if cls.__module__.startswith(_TORCH_NN):
        return True
    return inherited_torch_forward(cls)


def inherited_torch_forward(cls: type) -> bool:
    """Whether ``cls`` (a user class) runs the ``forward`` of a ``torch.nn`` layer it subclasses."""
    owner = next((k for k in cls.__mro__ if "forward" in k.__dict__), None)
    return (
        owner is not None
        and owner is not nn.Module
        and owner.__module__.startswith(_TORCH_NN)
        and not issubclass(owner, _CONTAINERS)
    )


# --------------------------------------------------------------------------------------------------
# Eager recording of leaf calls (regroup route)
# --------------------------------------------------------------------------------------------------
_SAMPLES = 64  # values sampled per fingerprint, spread evenly over the tensor


@dataclass(frozen=True)
class _TensorSpec:
    """What the regrouping keeps of a tensor seen in the eager run: its shape, dtype and a
    fingerprint of its values (their float64 sum and a few evenly spread elements).

    Why not the values: the only use of values is telling same-shaped candidates apart, and
    cloning the inputs and outputs of every recorded leaf call made RAM grow by a fifth of
    vit_b_16's parameter bytes. A fingerprint is a few numbers, taken when the hook runs (so a
    later in-place op cannot change it).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    total: float | None = None  # None: no values to compare (meta, sparse, ...)
    samples: tuple[Any, ...] = ()

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorSpec:
        shape, dtype = tuple(t.shape), t.dtype
        if t.is_meta or t.layout != torch.strided:
            return cls(shape, dtype)
        try:
            with torch.no_grad():
                v = torch.atleast_1d(torch.view_as_real(t.detach()) if t.is_complex() else t.detach())
                total = float(v.sum(dtype=torch.float64))
                picks = torch.linspace(0, v.numel() - 1, steps=min(v.numel(), _SAMPLES), device=v.device).long()
                samples = tuple(v[torch.unravel_index(picks, v.shape)].tolist())
        except Exception:  # noqa: BLE001 - a tensor subclass without these ops: shape and dtype only
            return cls(shape, dtype)
        return cls(shape, dtype, total, samples)

    def same_values(self, other: _TensorSpec | None) -> bool:
        """Whether ``other`` holds the same values (sums may differ in the last bits when the two
        tensors were summed in a different order, e.g. one contiguous and one a view)."""
        return (
            other is not None and self.total is not None and other.total is not None
            and self.shape == other.shape and self.dtype == other.dtype and self.samples == other.samples
            and math.isclose(self.total, other.total, rel_tol=1e-9, abs_tol=1e-9)
        )


def _specs(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, _TensorSpec.of, tree)


@dataclass
class _Call:
    module: nn.Module
    seq: int
    args: tuple[Any, ...]  # tensors are _TensorSpecs, everything else as passed
    kwargs: dict[str, Any]
    output: Any = None
    # identity facts, taken before anything could mutate or free the tensors
    arg_origin: list[tuple[str, Any]] = field(default_factory=list)  # per flat arg tensor leaf
    arg_ids: list[int] = field(default_factory=list)  # id() of each flat arg tensor leaf as passed
    output_is_arg: list[int | None] = field(default_factory=list)  # per flat output tensor leaf


def _record_calls(
    model: nn.Module, leaves: dict[int, nn.Module], call: ExampleInputs, names: _Names
) -> dict[int, list[_Call]]:
    """Run ``model`` once with hooks on ``leaves``; the outermost leaf calls, in order, per module."""
    from ..verify import preserved_state

    calls: dict[int, list[_Call]] = {}
    active: list[_Call] = []
    # id(tensor) -> (seq, flat output index). The tensors are not kept alive: an entry goes when
    # its tensor dies, so a new tensor reusing the id is not taken for it.
    produced: dict[int, tuple[int, int]] = {}
    counter = [0]
    fresh = call.fresh_copy()
    inputs = {id(t): i for i, t in enumerate(pytree.tree_leaves((fresh.args, fresh.kwargs))) if isinstance(t, torch.Tensor)}

    def origin(t: torch.Tensor) -> tuple[str, Any]:
        if id(t) in inputs:
            return ("input", inputs[id(t)])
        if id(t) in names.tensors:
            return ("tensor", names.tensors[id(t)][0])
        if id(t) in produced:
            return ("call", produced[id(t)])
        return ("other", None)

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if active:
            active.append(None)  # type: ignore[arg-type]  # nested leaf call: not recorded
            return
        leaves_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        rec = _Call(module, counter[0], *_specs((tuple(args), dict(kwargs))))
        rec.arg_origin = [origin(t) for t in leaves_in]
        rec.arg_ids = [id(t) for t in leaves_in]
        counter[0] += 1
        calls.setdefault(id(module), []).append(rec)
        active.append(rec)

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        rec = active.pop()
        if rec is None or active:
            return
        out_leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        arg_ids = rec.arg_ids
        rec.output_is_arg = [arg_ids.index(id(t)) if id(t) in arg_ids else None for t in out_leaves]
        for i, t in enumerate(out_leaves):
            produced[id(t)] = (rec.seq, i)
            _forget_when_dead(t, produced)
        rec.output = _specs(output)

    handles = []
    try:
        for module in leaves.values():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            model(*fresh.args, **fresh.kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _forget_when_dead(t: torch.Tensor, table: dict[int, Any]) -> None:
    """Drop ``t``'s entry from ``table`` when ``t`` dies. Its id cannot be reused before then, so the
    entry found at that moment is ``t``'s own."""
    weakref.finalize(t, table.pop, id(t), None).atexit = False


class _ValueRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]):
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.wanted and isinstance(result, torch.Tensor):
            self.values[n] = _TensorSpec.of(result)
        return result


def _record_values(gm: fx.GraphModule, model: nn.Module, call: ExampleInputs,
                   wanted: set[fx.Node]) -> dict[fx.Node, _TensorSpec]:
    from ..verify import preserved_state

    fresh = call.fresh_copy()
    flat = pytree.tree_leaves((fresh.args, fresh.kwargs))
    recorder = _ValueRecorder(gm, wanted)
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            recorder.run(*flat)
    except Exception:  # noqa: BLE001 - values only break ties; shapes and identity still work
        return {}
    return recorder.values


# --------------------------------------------------------------------------------------------------
# Regrouping
# --------------------------------------------------------------------------------------------------
_CONSTANT_TYPES = (type(None), bool, int, float, str, complex, torch.dtype, torch.device, torch.memory_format,
                   torch.layout, type(Ellipsis))


def _is_fx_constant(value: Any) -> bool:
    if isinstance(value, _CONSTANT_TYPES):
        return True
    if isinstance(value, slice):
        return all(_is_fx_constant(v) for v in (value.start, value.stop, value.step))
    if type(value) in (tuple, list):
        return all(_is_fx_constant(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _is_fx_constant(v) for k, v in value.items())
    return False


def _fake_shape(node: fx.Node) -> tuple[Any, ...] | None:
    ev = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(ev, torch.Tensor):
        return None
    out = []
    for s in ev.shape:
        if isinstance(s, int):
            out.append(s)
        else:
            hint = getattr(getattr(s, "node", None), "hint", None)
            out.append(hint if hint is not None else s)
    return tuple(out)


def _fake_dtype(node: fx.Node) -> torch.dtype | None:
    ev = node.meta.get("example_value", node.meta.get("val"))
    return ev.dtype if isinstance(ev, torch.Tensor) else None


def _matches(node: fx.Node, t: _TensorSpec) -> bool:
    shape = _fake_shape(node)
    return shape is not None and shape == t.shape and _fake_dtype(node) == t.dtype


@dataclass
class _Group:
    key: str
    frames: list[_Frame]  # the stack up to and including the leaf frame
    nodes: list[fx.Node]

    @property
    def leaf(self) -> _Frame:
        return self.frames[-1]


class _Regrouper:
    """Collapses leaf calls into ``call_module`` nodes of the user's modules (both routes).

    ``inputs`` are the graph nodes of the flattened capture call (None for a non-tensor input).
    """

    def __init__(self, dgm: fx.GraphModule, model: nn.Module, policy: LeafPolicy, names: _Names,
                 stacks: _Stacks, call: ExampleInputs, inputs: list[fx.Node | None]):
        self.dgm = dgm
        self.graph = dgm.graph
        self.model = model
        self.policy = policy
        self.names = names
        self.stacks = stacks
        self.call = call
        self.inputs = inputs
        self.notes: list[str] = []
        self.extra_leaves: dict[str, str] = {}
        self.targets: dict[fx.Node, str] = {}  # call_module node -> user qualname
        self.produced: dict[tuple[int, int], fx.Node] = {}  # (call seq, flat output index) -> node
        self.placed: dict[int, fx.Node] = {}  # call seq -> its call_module node
        self._values: dict[fx.Node, _TensorSpec] | None = None  # example values, recorded on first need
        self._wanted: set[fx.Node] = set()  # the nodes whose values a tie could need
        self._pristine = fx.Graph()  # the graph as captured (nodes only), for those values
        self._pristine_map: dict[fx.Node, fx.Node] = {}
        self.next_start: dict[int, float] = {}  # call seq -> where the next placed call starts
        self.order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(self.graph.nodes)}

    def is_leaf(self, module: nn.Module | None) -> bool:
        if module is None or module is self.model:
            return False
        return self.policy.reason(module) is not None or default_leaf(module)

    def _note_leaf(self, module: nn.Module | None) -> None:
        reason = self.policy.reason(module) if module is not None else None
        name = self.names.module_name(module)
        if reason is not None and name:
            self.extra_leaves[name] = reason

    def outermost_leaves(self) -> dict[int, nn.Module]:
        out: dict[int, nn.Module] = {}

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if self.is_leaf(child):
                    out.setdefault(id(child), child)
                else:
                    visit(child)

        visit(self.model)
        return out

    # -- analysis ------------------------------------------------------------------------------
    def groups(self) -> tuple[list[_Group], list[fx.Node]]:
        """Leaf groups to collapse, in graph order, and the leaf calls Dynamo already made
        ``call_module`` nodes (flag route)."""
        groups: dict[str, _Group] = {}
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            frames = self.stacks.of(node)
            for i, frame in enumerate(frames):
                if self.is_leaf(frame.module):
                    group = groups.get(frame.key)
                    if group is None:
                        group = groups[frame.key] = _Group(frame.key, frames[: i + 1], [])
                    group.nodes.append(node)
                    break
        collapse, direct = [], []
        for group in groups.values():
            call = self._direct_call(group)
            if call is not None:
                direct.append(call)
            else:
                collapse.append(group)
        return collapse, direct

    def _direct_call(self, group: _Group) -> fx.Node | None:
        """The ``call_module`` node that is the whole of ``group``, if Dynamo made one.

        Dynamo files the ``getitem`` that unpacks a leaf's tuple output (``nn.MultiheadAttention``'s
        ``out, _ = attn(x, x, x)``) under the leaf's own stack entry. Such a group is still one call:
        it needs no eager recording (which costs a forward), only the accesses moved to the caller's
        stack.
        """
        calls = [n for n in group.nodes if n.op == "call_module" and len(self.stacks.of(n)) == len(group.frames)]
        if len(calls) != 1:
            return None
        call = calls[0]
        accesses = [n for n in group.nodes if n is not call]
        if not all(n.op == "call_function" and n.target is operator.getitem and n.args[0] is call for n in accesses):
            return None
        parent = self._frames_meta(group.frames[:-1])
        for n in accesses:
            n.meta["nn_module_stack"] = dict(parent)
        return call

    def run(self) -> None:
        groups, direct = self.groups()
        for node in direct:
            frame = self.stacks.of(node)[-1]
            name = self.names.module_name(frame.module) if frame.module is not None else None
            if name is None:
                raise ReliftError(f"call_module {node.target} ({frame.source}) is not a submodule of the model")
            self.targets[node] = name
            self._note_leaf(frame.module)
        policy_leaves = any(self.policy.reason(m) is not None for m in self.model.modules() if m is not self.model)
        if not groups and not policy_leaves:
            return  # flag route, nothing inlined: Dynamo's call_module nodes are all there is
        # Which leaf calls to record eagerly: all of them when Dynamo inlined everything (regroup
        # route); on the flag route only the inlined ones and the policy's (a leaf whose call left no
        # node can only be one of those), which keeps memory flat on big inputs.
        outermost = self.outermost_leaves()
        if direct:
            leaves = {id(g.leaf.module): g.leaf.module for g in groups if g.leaf.module is not None}
            leaves.update({k: m for k, m in outermost.items() if self.policy.reason(m) is not None})
        else:
            leaves = dict(outermost)
            for g in groups:  # a leaf reached outside the module tree (e.g. kept in a plain list)
                if g.leaf.module is not None:
                    leaves.setdefault(id(g.leaf.module), g.leaf.module)
        calls = _record_calls(self.model, leaves, self.call, self.names)
        units: dict[int, list[Any]] = {}
        for g in groups:
            units.setdefault(id(g.leaf.module), []).append(g)
        for node in direct:
            units.setdefault(id(self.stacks.of(node)[-1].module), []).append(node)
        pairs: dict[int, tuple[_Call, Any]] = {}
        for mid, recs in calls.items():
            for rec, unit in self._pair(recs, units.get(mid, [])):
                pairs[rec.seq] = (rec, unit)
        # Example values only for the nodes matching could need: what groups read and return, and
        # same-shaped candidates for the inputs of calls that left no node.
        wanted: set[fx.Node] = set(self.inputs_nodes())
        for g in groups:
            wanted.update(self._ext_inputs(g.nodes))
            wanted.update(self._ext_outputs(g.nodes))
        probes = [t for rec, unit in pairs.values() if unit is None
                  for t in pytree.tree_leaves((rec.args, rec.kwargs)) if isinstance(t, _TensorSpec)]
        if probes:
            wanted.update(n for n in self.graph.nodes if any(_matches(n, t) for t in probes))
        self._wanted = wanted
        # The rewriting below changes the graph; a tie found later is broken with values of the
        # graph as captured, so keep a copy of it (nodes only, no tensors) until then.
        self._pristine.output(self._pristine.graph_copy(self.dgm.graph, self._pristine_map))
        upcoming = float(len(self.order))
        for seq in sorted(pairs, reverse=True):
            self.next_start[seq] = upcoming
            unit = pairs[seq][1]
            if isinstance(unit, _Group):
                upcoming = self.order[unit.nodes[0]]
            elif isinstance(unit, fx.Node):
                upcoming = self.order[unit]
        for seq in sorted(pairs):
            rec, unit = pairs[seq]
            if isinstance(unit, fx.Node):
                self._register_direct(rec, unit)
            elif isinstance(unit, _Group):
                self._collapse(rec, unit)
            else:
                self._insert_empty(rec)

    def value(self, node: fx.Node) -> _TensorSpec | None:
        """The example value of ``node``, to break a tie between same-shaped candidates. The graph
        is run (one more forward) only the first time a tie needs it: most models have none."""
        if self._values is None:
            copy = fx.GraphModule(self.dgm, self._pristine)
            wanted = {self._pristine_map[n] for n in self._wanted if n in self._pristine_map}
            values = _record_values(copy, self.model, self.call, wanted)
            self._values = {old: values[new] for old, new in self._pristine_map.items() if new in values}
        return self._values.get(node)

    def inputs_nodes(self) -> list[fx.Node]:
        return [n for n in self.inputs if n is not None]

    def _pair(self, recs: list[_Call], units: list[Any]) -> list[tuple[_Call, Any]]:
        """Eager calls of one module ↔ its groups in the graph (None: the call left no node)."""

        def frame_of(u: Any) -> _Frame:
            return u.leaf if isinstance(u, _Group) else self.stacks.of(u)[-1]

        def first(u: Any) -> float:
            return self.order[u.nodes[0]] if isinstance(u, _Group) else self.order[u]

        units = sorted(units, key=first)
        if len(units) == len(recs):
            return list(zip(recs, units))
        bases = {frame_of(u).base for u in units}
        by_k = {frame_of(u).k: u for u in units}
        if len(bases) <= 1 and len(by_k) == len(units) and all(k < len(recs) for k in by_k):
            return [(rec, by_k.get(i)) for i, rec in enumerate(recs)]
        name = self.names.module_name(recs[0].module)
        if self.policy.reason(recs[0].module) is not None:
            raise ReliftError(f"the {len(recs)} call(s) of '{name}' could not be paired with the captured graph")
        self.notes.append(
            f"module '{name}' was called {len(recs)} time(s) but its calls could not be paired with the "
            f"captured graph; they are left inlined."
        )
        return []

    # -- binding -------------------------------------------------------------------------------
    @staticmethod
    def _ext_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
        members = set(nodes)
        seen: dict[fx.Node, None] = {}
        for n in nodes:
            for inp in n.all_input_nodes:
                if inp not in members and inp.op != "get_attr":
                    seen.setdefault(inp, None)
        return list(seen)

    @staticmethod
    def _ext_outputs(nodes: list[fx.Node]) -> list[fx.Node]:
        members = set(nodes)
        return [n for n in nodes if any(u not in members for u in n.users)]

    def _by_origin(self, rec: _Call, index: int) -> fx.Node | None:
        kind, value = rec.arg_origin[index] if index < len(rec.arg_origin) else ("other", None)
        if kind == "input" and value < len(self.inputs):
            return self.inputs[value]
        if kind == "tensor":
            return self._get_attr(value)
        if kind == "call":
            return self.produced.get(value)
        return None

    def _tensor_node(self, rec: _Call, index: int, t: _TensorSpec, candidates: list[fx.Node],
                     used: set[fx.Node], window: tuple[float, float]) -> fx.Node | None:
        node = self._by_origin(rec, index)
        if node is not None and (node in candidates or not candidates):
            return node
        # Identity says which tensor object was passed, but an in-place op (``out += x``) may have
        # changed it since: the graph node the call actually reads wins.
        pool = [c for c in candidates if c not in used and _matches(c, t)]
        if len(pool) > 1:
            pool = [c for c in pool if t.same_values(self.value(c))] or pool
            if len(pool) > 1:
                self.notes.append(
                    f"leaf '{self.names.module_name(rec.module)}': {len(pool)} same-shaped values could be argument "
                    f"{index}; bound by order of use (no example values to tell them apart)."
                )
        if pool:
            return pool[0]
        if node is not None:
            return node
        # An argument the call never reads inside the graph: the latest node before the call that
        # holds this very value (nodes since the previous leaf call first).
        lo, hi = window
        earlier = [n for n in self.graph.nodes if self.order.get(n, hi) < hi and n.op != "output"
                   and _matches(n, t) and t.same_values(self.value(n))]
        recent = [n for n in earlier if self.order.get(n, -1.0) >= lo]
        return (recent or earlier)[-1] if earlier else None

    def _get_attr(self, qualname: str) -> fx.Node:
        anchor = next(iter(self.graph.nodes))
        for n in self.graph.nodes:
            if n.op != "placeholder":
                break
            anchor = n
        with self.graph.inserting_after(anchor):
            node = self.graph.get_attr(qualname)
        node.meta["fxprep_user_attr"] = qualname
        self.order[node] = self.order.get(anchor, 0.0) + 0.001
        return node

    def _bind(self, rec: _Call, candidates: list[fx.Node], window: tuple[float, float]) -> tuple[Any, Any] | None:
        flat, spec = pytree.tree_flatten((rec.args, rec.kwargs))
        used: set[fx.Node] = set()
        out: list[Any] = []
        index = 0
        by_id: dict[int, fx.Node] = {}  # the same tensor object passed twice (MHA's x, x, x)
        for leaf in flat:
            if isinstance(leaf, _TensorSpec):
                node = by_id.get(rec.arg_ids[index]) or self._tensor_node(rec, index, leaf, candidates, used, window)
                if node is not None:
                    by_id.setdefault(rec.arg_ids[index], node)
                index += 1
                if node is None:
                    return None
                used.add(node)
                out.append(node)
            elif _is_fx_constant(leaf):
                out.append(leaf)
            else:
                return None
        args, kwargs = pytree.tree_unflatten(out, spec)
        return tuple(args), dict(kwargs)

    def _output_paths(self, rec: _Call, outs: list[fx.Node]) -> tuple[dict[fx.Node, int], list[Any]] | None:
        if isinstance(rec.output, _TensorSpec):
            leaves: list[tuple[Any, _TensorSpec]] = [((), rec.output)]
        else:
            leaves = [(tuple(p), t) for p, t in pytree.tree_flatten_with_path(rec.output)[0] if isinstance(t, _TensorSpec)]
        result: dict[fx.Node, int] = {}
        taken: set[int] = set()
        for node in outs:
            pool = [i for i, (_, t) in enumerate(leaves) if i not in taken and _matches(node, t)]
            if len(pool) > 1:
                pool = [i for i in pool if leaves[i][1].same_values(self.value(node))] or pool
            if not pool:
                return None
            taken.add(pool[0])
            result[node] = pool[0]
        return result, [p for p, _ in leaves]

    # -- rewriting -----------------------------------------------------------------------------
    def _register_direct(self, rec: _Call, node: fx.Node) -> None:
        self.placed[rec.seq] = node
        if isinstance(rec.output, _TensorSpec):
            self.produced[(rec.seq, 0)] = node
            return
        if isinstance(rec.output, (tuple, list)):
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                    idx = user.args[1]
                    if 0 <= idx < len(rec.output) and isinstance(rec.output[idx], _TensorSpec):
                        flat_index = sum(isinstance(x, _TensorSpec) for x in pytree.tree_leaves(list(rec.output)[:idx]))
                        self.produced[(rec.seq, flat_index)] = user

    @staticmethod
    def _frames_meta(frames: list[_Frame]) -> dict[str, tuple[str, type]]:
        return {f.key: (f.source, f.cls) for f in frames}

    def _window(self, seq: int) -> tuple[float, float]:
        prev = [s for s in self.placed if s < seq]
        lo = self.order[self.placed[max(prev)]] if prev else -1.0
        return lo, self.next_start.get(seq, float(len(self.order)))

    def _give_up(self, rec: _Call, problem: str) -> None:
        name = self.names.module_name(rec.module)
        reason = self.policy.reason(rec.module)
        if reason is not None:
            raise ReliftError(f"module '{name}' ({reason}) could not be kept as one call: {problem}")
        self.notes.append(f"leaf '{name}' could not be regrouped into one call ({problem}); it is left inlined.")

    def _collapse(self, rec: _Call, group: _Group) -> None:
        nodes = group.nodes
        name = self.names.module_name(rec.module)
        if name is None:
            return self._give_up(rec, "it is not a submodule of the model")
        ext_in = self._ext_inputs(nodes)
        ext_out = self._ext_outputs(nodes)
        last = max(nodes, key=lambda n: self.order[n])
        lo, _ = self._window(rec.seq)
        bound = self._bind(rec, ext_in, (lo, self.order[nodes[0]]))
        if bound is None:
            return self._give_up(rec, "its arguments could not be tied to graph values")
        args, kwargs = bound
        arg_nodes: set[fx.Node] = set()
        fx.node.map_arg((args, kwargs), arg_nodes.add)
        missing = [n for n in ext_in if n not in arg_nodes]
        if missing:
            return self._give_up(rec, f"it reads values it is not given as arguments ({', '.join(m.name for m in missing)})")
        if any(self.order.get(n, -1.0) > self.order[last] for n in arg_nodes):
            return self._give_up(rec, "an argument is computed after the call")
        matched = self._output_paths(rec, ext_out)
        if matched is None:
            return self._give_up(rec, "values it computes are used outside it but are not part of its output")
        paths, leaf_paths = matched
        with self.graph.inserting_after(last):
            call = self.graph.call_module(name, args, kwargs)
        call.meta["nn_module_stack"] = self._frames_meta(group.frames)
        call.meta["fxprep_regrouped"] = True
        if isinstance(rec.output, _TensorSpec) and len(ext_out) == 1:
            call.meta["example_value"] = ext_out[0].meta.get("example_value")
        self.targets[call] = name
        self.order[call] = self.order[last] + 0.5
        self.placed[rec.seq] = call
        self._note_leaf(rec.module)
        if isinstance(rec.output, _TensorSpec):
            self.produced[(rec.seq, 0)] = call
        parent = self._frames_meta(group.frames[:-1])
        members = set(nodes)
        cursor = call
        for node in ext_out:
            value: fx.Node = call
            for key in leaf_paths[paths[node]]:
                with self.graph.inserting_after(cursor):
                    value = _access(self.graph, value, key)
                value.meta["nn_module_stack"] = dict(parent)
                self.order[value] = self.order[call] + 0.01
                cursor = value
            if value is not call:
                value.meta["example_value"] = node.meta.get("example_value")
            node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in members)
            self.produced[(rec.seq, paths[node])] = value
        for node in reversed(nodes):
            if node.users:
                raise ReliftError(f"node {node.name} of '{name}' is still used after regrouping")
            self.graph.erase_node(node)
        return None

    def _insert_empty(self, rec: _Call) -> None:
        """A leaf call that left no node (``nn.Identity``): put the call back where it happened."""
        name = self.names.module_name(rec.module)
        index = rec.output_is_arg[0] if isinstance(rec.output, _TensorSpec) and rec.output_is_arg else None
        if name is None or index is None:
            return self._give_up(rec, "it left no node in the captured graph and does not return its input")
        window = self._window(rec.seq)
        flat_args = [t for t in pytree.tree_leaves((rec.args, rec.kwargs)) if isinstance(t, _TensorSpec)]
        source = self._tensor_node(rec, index, flat_args[index], [], set(), window)
        bound = self._bind(rec, [source] if source is not None else [], window) if source is not None else None
        if source is None or bound is None:
            return self._give_up(rec, "it left no node in the captured graph and its input could not be found")
        args, kwargs = bound
        arg_nodes: list[fx.Node] = []
        fx.node.map_arg((args, kwargs), arg_nodes.append)
        prev = [s for s in self.placed if s < rec.seq]
        anchors = [*arg_nodes] + ([self.placed[max(prev)]] if prev else [])
        after = max(anchors, key=lambda n: self.order.get(n, 0.0))
        with self.graph.inserting_after(after):
            call = self.graph.call_module(name, args, kwargs)
        position = self.order.get(after, 0.0)
        self.order[call] = position + 0.25
        call.meta["nn_module_stack"] = self._frames_for_module(rec.module)
        call.meta["example_value"] = source.meta.get("example_value")
        call.meta["fxprep_regrouped"] = True
        self.targets[call] = name
        self.placed[rec.seq] = call
        self.produced[(rec.seq, 0)] = call
        self._note_leaf(rec.module)
        for user in list(source.users):
            if user is not call and self.order.get(user, -1.0) > position:
                user.replace_input_with(source, call)
        return None

    def _frames_for_module(self, module: nn.Module) -> dict[str, tuple[str, type]]:
        qualname = self.names.module_name(module) or ""
        out: dict[str, tuple[str, type]] = {}
        parts = qualname.split(".") if qualname else []
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            m = self.model.get_submodule(path)
            out[f"fxprep:{path}"] = (f"L['self'].{path}", type(m))
        return out


def _access(graph: fx.Graph, value: fx.Node, key: Any) -> fx.Node:
    if isinstance(key, pytree.SequenceKey):
        return graph.call_function(operator.getitem, (value, key.idx))
    if isinstance(key, pytree.MappingKey):
        return graph.call_function(operator.getitem, (value, key.key))
    if isinstance(key, pytree.GetAttrKey):
        return graph.call_function(getattr, (value, key.name))
    raise ReliftError(f"cannot access output part {key!r}")


# --------------------------------------------------------------------------------------------------
# Clean-ups on the Dynamo graph
# --------------------------------------------------------------------------------------------------
def remove_grad_toggles(graph: fx.Graph, enabled_at_capture: bool = True) -> int:
    """Drop ``_set_grad_enabled`` calls; values computed with grad disabled and used after the
    region get an explicit ``.detach()`` so gradients stay exactly what they were."""
    nodes = list(graph.nodes)
    toggles = [n for n in nodes if n.op == "call_function" and n.target in _GRAD_TOGGLES]
    if not toggles:
        return 0
    state = enabled_at_capture
    region: list[fx.Node] = []
    position = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if node in toggles:
            new_state = bool(node.args[0]) if node.args else True
            if not state and new_state and region:
                _detach_escaping(graph, region, node, position)
            region = []
            state = new_state
            continue
        if not state and node.op in ("call_function", "call_method", "call_module"):
            region.append(node)
    for node in toggles:
        graph.erase_node(node)
    return len(toggles)


def _detach_escaping(graph: fx.Graph, region: list[fx.Node], end: fx.Node, position: dict[fx.Node, int]) -> None:
    members = set(region)
    for node in region:
        ev = node.meta.get("example_value")
        if not isinstance(ev, torch.Tensor) or not ev.is_floating_point():
            continue
        outside = [u for u in node.users if u not in members and position.get(u, -1) > position[end]]
        if not outside:
            continue
        with graph.inserting_after(end):
            det = graph.call_method("detach", (node,))
        det.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "example_value", "stack_trace")}
        det.meta["fxprep_origin"] = "torch.no_grad region"
        for u in outside:
            u.replace_input_with(node, det)


_NOISE = {torch._C._log_api_usage_once}


def remove_noise(graph: fx.Graph) -> None:
    """Drop calls that only log (``torch._C._log_api_usage_once``)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _NOISE and not node.users:
            graph.erase_node(node)


def module_method_calls(dgm: fx.GraphModule, names: _Names, stacks: _Stacks) -> dict[fx.Node, str]:
    """``get_attr(module).forward(x)`` (Dynamo's form for some ``torch.nn`` subclasses that keep the
    parent's forward, e.g. transformers' ``PoolFormerGroupNorm(nn.GroupNorm)``) → ``call_module``."""
    graph = dgm.graph
    found: dict[fx.Node, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in ("forward", "__call__") or not node.args:
            continue
        owner = node.args[0]
        if not isinstance(owner, fx.Node) or owner.op != "get_attr":
            continue
        obj = _get(dgm, str(owner.target))
        if not isinstance(obj, nn.Module):
            continue
        name = names.module_name(obj)
        if name is None:
            frames = [f for f in stacks.of(node) if f.module is not None and type(f.module) is type(obj)]
            name = names.module_name(frames[-1].module) if frames else None
        if name is None:
            continue
        with graph.inserting_before(node):
            call = graph.call_module(name, tuple(node.args[1:]), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        found[call] = name
    return found


def rewrite_sym_ops(graph: fx.Graph) -> None:
    """``aten.sym_size.int(x, d)`` (dynamic shapes) → ``x.size(d)``, a plain fx-level call."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _SYM_METHODS:
            with graph.inserting_before(node):
                new = graph.call_method(_SYM_METHODS[node.target], tuple(node.args), dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)


_APPLY_CALL = re.compile(r"([A-Za-z_][\w.]*)\.apply\s*\(")


def _user_autograd_function(node: fx.Node, stacks: _Stacks) -> type | None:
    """The ``autograd.Function`` class a Dynamo ``autograd_function_apply`` node came from.

    Dynamo keeps only the traced forward/backward bodies, not the class. The source line it records
    (``return GeLUFunction.apply(x)``) names it, and the module whose ``forward`` made the call
    gives the globals to resolve that name in. None when that does not lead to exactly one class.
    """
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()
             if ln.strip() and not ln.strip().startswith("File ") and set(ln.strip()) - set("^~ ")]
    found = _APPLY_CALL.findall(lines[-1]) if lines else []
    if len(found) != 1:
        return None
    frames = stacks.of(node)
    owner = frames[-1].module if frames and frames[-1].module is not None else stacks.model
    scope: Any = getattr(type(owner).forward, "__globals__", {})
    head, *rest = found[0].split(".")
    value = scope.get(head)
    for part in rest:
        value = getattr(value, part, None)
    if isinstance(value, type) and issubclass(value, torch.autograd.Function):
        return value
    return None


def restore_autograd_functions(graph: fx.Graph, stacks: _Stacks) -> int:
    """``autograd_function_apply(fwd_body, bwd_body, *inputs)`` → a call of the user's Function.

    Dynamo records a custom ``autograd.Function`` as a higher-order op over two traced graph bodies;
    those bodies are Dynamo internals (no saved form, not the user's code). Where the class can be
    found, the call becomes ``Cls.apply(*inputs)``, as an fx capture has it, so the Function's own
    forward and backward run. Only single-output Functions are rewritten (all users take ``[0]``)."""
    from .fx import autograd_function_caller

    hop = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    count = 0
    for node in list(graph.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        users = list(node.users)
        if not users or not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
                                for u in users):
            continue
        cls = _user_autograd_function(node, stacks)
        if cls is None:
            continue
        bodies = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        with graph.inserting_before(node):
            call = graph.call_function(autograd_function_caller(cls), tuple(node.args[2:]))
        call.meta = {k: v for k, v in node.meta.items() if k != "source_fn_stack"}
        call.meta["example_value"] = users[0].meta.get("example_value")
        for user in users:
            user.replace_all_uses_with(call)
            graph.erase_node(user)
        graph.erase_node(node)
        for body in bodies:
            if not body.users:
                graph.erase_node(body)
        count += 1
    return count


def fold_numpy_constants(graph: fx.Graph) -> int:
    """Dynamo traces NumPy calls through ``torch._numpy`` wrappers (``np.sqrt(head_dim)`` in
    transformers' CTRL becomes a call to ``<Wrapped function <original sqrt>>``). On constant
    arguments the result is a constant: put the Python number back, as the user's code computed it,
    so no Dynamo-internal callable stays in the prepared graph."""
    from torch._dynamo.utils import numpy_to_tensor_wrapper

    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, numpy_to_tensor_wrapper):
            continue
        if any(isinstance(a, fx.Node) for a in pytree.tree_leaves((node.args, node.kwargs))):
            continue  # on traced values: left as is (save refuses it with the reason)
        value = node.target(*node.args, **node.kwargs)
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            continue
        node.replace_all_uses_with(value.item())  # type: ignore[arg-type]
        graph.erase_node(node)
        count += 1
    return count


def replace_device_literals(graph: fx.Graph, anchor: fx.Node | None, device: torch.device | None) -> int:
    """Turn ``torch.device`` literals equal to the inputs' device into ``anchor.device``, so the
    prepared module follows ``.to(device)`` (Dynamo bakes ``x.device`` in as a constant)."""
    if anchor is None or device is None:
        return 0
    count = 0
    dev_node: fx.Node | None = None

    def swap(value: Any) -> Any:
        nonlocal count, dev_node
        if isinstance(value, torch.device) and value == device:
            if dev_node is None:
                with graph.inserting_after(anchor):
                    dev_node = graph.create_node("call_function", getattr, (anchor, "device"), name="device")
                dev_node.meta["example_value"] = device
            count += 1
            return dev_node
        if type(value) in (tuple, list):
            return type(value)(swap(v) for v in value)
        if type(value) is dict:
            return {k: swap(v) for k, v in value.items()}
        return value

    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module") or node is dev_node:
            continue
        before = count
        new_args, new_kwargs = swap(tuple(node.args)), swap(dict(node.kwargs))
        if count != before:
            node.args, node.kwargs = new_args, new_kwargs
    return count


# --------------------------------------------------------------------------------------------------
# Building the prepared GraphModule
# --------------------------------------------------------------------------------------------------
class _Holder:
    """Builds the attribute tree the prepared GraphModule is created from: fresh containers, the
    user's own leaf modules and tensors at their original paths, never mutating a user module."""

    def __init__(self) -> None:
        self.root = nn.Module()
        self.fresh = {id(self.root)}

    def install(self, path: str, obj: Any, persistent: bool = True) -> None:
        *prefix, leaf = path.split(".")
        container = self.root
        atoms = path.split(".")
        for i, atom in enumerate(prefix):
            nxt = container._modules.get(atom)
            if nxt is None:
                nxt = nn.Module()
                self.fresh.add(id(nxt))
                container.add_module(atom, nxt)
            elif id(nxt) not in self.fresh:
                try:
                    reachable = _get(nxt, ".".join(atoms[i + 1:])) is obj
                except AttributeError:
                    reachable = False
                if reachable:
                    return  # reachable through the user's own module already
                raise ReliftError(f"cannot place {path!r}: {atom!r} is a user module holding something else")
            container = nxt
        existing = container._modules.get(leaf) if isinstance(obj, nn.Module) else getattr(container, leaf, None)
        if existing is obj:
            return
        if isinstance(obj, nn.Module):
            container._modules[leaf] = obj  # replaces a fresh container created for a get_attr
        elif isinstance(obj, nn.Parameter):
            container.register_parameter(leaf, obj)
        elif isinstance(obj, torch.Tensor):
            container.register_buffer(leaf, obj, persistent=persistent)
        else:
            setattr(container, leaf, obj)


def _free_name(taken: set[str], model: nn.Module, base: str) -> str:
    base = re.sub(r"\W", "_", base).strip("_") or "const"
    name, i = f"_fxprep_const_{base}", 0
    while name in taken or hasattr(model, name):
        i += 1
        name = f"_fxprep_const_{base}_{i}"
    taken.add(name)
    return name


def _build(dgm: fx.GraphModule, model: nn.Module, names: _Names, stacks: _Stacks, targets: dict[fx.Node, str],
           pytree_info: Any, notes: list[str]) -> fx.GraphModule:
    graph = dgm.graph
    holder = _Holder()
    taken: set[str] = set()
    constants: list[str] = []
    readers: set[str] = set()
    # Modules first, so tensors under them are found through the user's module.
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        target = targets.get(node)
        if target is None:
            frames = stacks.of(node)
            module = frames[-1].module if frames else None
            target = names.module_name(module) if module is not None else None
            if target is None:
                raise ReliftError(f"call_module {node.target} does not map to a submodule of the model")
        node.target = target
        holder.install(target, model.get_submodule(target))
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        user = node.meta.pop("fxprep_user_attr", None)
        obj = _get(model, user) if user is not None else _get(dgm, str(node.target))
        if isinstance(obj, torch.Tensor) and id(obj) in names.tensors:
            qual, kind = names.tensors[id(obj)]
            node.target = qual
            holder.install(qual, obj, persistent=kind != "attribute" and qual not in names.non_persistent)
        elif isinstance(obj, torch.Tensor):
            new = _free_name(taken, model, str(node.target))
            frames = stacks.of(node)
            readers.add(frames[-1].qualname if frames else "")
            node.target = new
            holder.install(new, obj, persistent=False)
            constants.append(new)
        else:
            new = str(node.target)
            if hasattr(model, new) or new in taken:
                new = _free_name(taken, model, new)
            taken.add(new)
            node.target = new
            holder.install(new, obj)
    for node in graph.nodes:
        frames = stacks.of(node) if node.meta.get("nn_module_stack") else []
        if frames:
            stack: dict[str, tuple[str, type]] = {}
            for f in frames:
                stack[f.qualname if f.k == 0 else f"{f.qualname}@{f.k}"] = (f.qualname, f.cls)
            node.meta["nn_module_stack"] = stack
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph._codegen = torch.fx.graph._PyTreeCodeGen(pytree_info)
    graph.lint()
    gm = fx.GraphModule(holder.root, graph, type(model).__name__)
    if constants:
        notes.append(
            f"{len(constants)} tensor(s) that are neither parameters nor buffers of the model were baked into "
            f"the graph as constants ({', '.join(constants[:5])}{'...' if len(constants) > 5 else ''}; read in "
            f"{', '.join(repr(r) for r in sorted(readers)[:5])})."
        )
    gm.meta["fxprep_constants"] = constants
    _reorder_like(gm, model)
    return gm


def _reorder_like(gm: fx.GraphModule, model: nn.Module) -> None:
    """Order the containers fxprep created like the original's, so ``state_dict()`` keys come in
    the original order too."""
    for name, module in gm.named_modules():
        if module is not gm and type(module) is not nn.Module:
            continue
        try:
            original = model.get_submodule(name) if name else model
        except AttributeError:
            continue
        for attr in ("_parameters", "_buffers", "_modules"):
            items = getattr(module, attr)
            ref = {k: i for i, k in enumerate(getattr(original, attr))}
            ordered = sorted(items.items(), key=lambda kv: ref.get(kv[0], len(ref)))
            items.clear()
            items.update(ordered)


def _get(root: Any, path: str) -> Any:
    obj = root
    for atom in path.split("."):
        obj = getattr(obj, atom)
    return obj


def unreferenced_parameters(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """Parameters of ``model`` that ``gm`` neither reads (get_attr) nor holds in a called leaf."""
    used: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = _get(gm, str(node.target))
            if isinstance(obj, torch.Tensor):
                used.add(id(obj))
        elif node.op == "call_module":
            used.update(id(p) for p in gm.get_submodule(str(node.target)).parameters())
    return [name for name, p in model.named_parameters() if id(p) not in used]


# --------------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------------
class _DynamoGlobalState:
    """Dynamo remembers across calls that a module *class* is "dynamic" once it met one instance
    with hooks (``GenerationTracker.mark_class_dynamic``); every later capture then inlines that
    class and, on the flag route, fails on its parameters. Undo what one capture added (private
    state, feature-detected: without it this is a no-op).

    Dynamo also keeps every backend it compiled with in a process-wide table; export's backend holds
    the captured graph, and with it the user's leaf modules and their parameters, so each prepared
    model would stay in memory for the life of the process (about the parameter bytes per call on
    resnet50). The entries one capture added are dropped too; the user's own ``torch.compile``
    entries are left alone."""

    def __enter__(self) -> _DynamoGlobalState:
        try:
            from torch._dynamo import eval_frame

            self.backends: dict[int, Any] | None = eval_frame.cached_backends
            self.backends_before = set(self.backends)
        except Exception:  # noqa: BLE001
            self.backends = None
        try:
            from torch._dynamo.mutation_guard import GenerationTracker

            self.tables = [GenerationTracker.dynamic_classes, GenerationTracker.generation_values]
            self.before = [set(t.values) for t in self.tables]
        except Exception:  # noqa: BLE001
            self.tables = []
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.backends is not None:
            for key in set(self.backends) - self.backends_before:
                backend = self.backends.pop(key, None)
                if hasattr(backend, "reset"):
                    backend.reset()
        for table, before in zip(self.tables, getattr(self, "before", [])):
            try:
                for idx in set(table.values) - before:
                    table._remove_id(idx)
            except Exception:  # noqa: BLE001
                pass


def _export(model: nn.Module, call: ExampleInputs, route: str, dynamic_spec: dict[str, Any] | None) -> Any:
    import torch._dynamo as dynamo

    patches: dict[str, Any] = {}
    if route == "flag":
        patches[FLAG] = False
    elif flag_available():
        patches[FLAG] = True
    if hasattr(dynamo.config, "allow_rnn"):
        patches["allow_rnn"] = True
    kwargs: dict[str, Any] = {"assume_static_by_default": True}
    if dynamic_spec is not None:
        kwargs["dynamic_shapes"] = dynamic_spec
    with dynamo.config.patch(**patches), _DynamoGlobalState():
        return dynamo.export(model, **kwargs)(*call.args, **call.kwargs)


def requiring_grad(call: ExampleInputs) -> ExampleInputs:
    """``call`` with its floating-point tensors requiring grad (``detach()`` views: no copy).

    Why: with inputs that do not require grad, Dynamo runs a custom ``autograd.Function`` as its
    forward alone and inlines it (``STE.apply(x)`` becomes ``torch.round(x)``), silently dropping the
    backward a quantization-aware user relies on. With a grad-requiring input it records the
    Function as one call, which the re-lifting keeps as a module.
    """

    def mark(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not t.requires_grad and t.is_leaf:
            return t.detach().requires_grad_(True)
        return t

    args, kwargs = pytree.tree_map_only(torch.Tensor, mark, (call.args, call.kwargs))
    return ExampleInputs(tuple(args), dict(kwargs))


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _first_tensor(call: ExampleInputs) -> tuple[int, torch.Tensor] | None:
    for i, leaf in enumerate(pytree.tree_leaves((call.args, call.kwargs))):
        if isinstance(leaf, torch.Tensor):
            return i, leaf
    return None


def relift(dgm: fx.GraphModule, model: nn.Module, policy: LeafPolicy, calls: _Calls, route: str,
           notes: list[str]) -> tuple[fx.GraphModule, dict[str, str]]:
    """Turn Dynamo's graph into the module-level one (see the module docstring)."""
    graph = dgm.graph
    names = _Names(model)
    stacks = _Stacks(model, names)
    info = graph._codegen.pytree_info if isinstance(graph._codegen, torch.fx.graph._PyTreeCodeGen) else None
    if info is None:
        raise ReliftError("Dynamo graph has no pytree signature")
    graph.owning_module = None  # targets change meaning here: checks come back in _build
    placeholders = _placeholders(graph)
    flat_capture = pytree.tree_flatten_with_path((calls.capture.args, calls.capture.kwargs))[0]
    if len(placeholders) != len(flat_capture):
        raise ReliftError(f"Dynamo graph has {len(placeholders)} inputs for {len(flat_capture)} flattened arguments")

    count = remove_grad_toggles(graph, torch.is_grad_enabled())
    if count:
        notes.append(
            f"{count} torch.no_grad/enable_grad toggle(s) removed from the graph; values computed without "
            f"grad are detached where they leave the region, so gradients are unchanged."
        )
    rewrite_sym_ops(graph)
    fold_numpy_constants(graph)
    restore_autograd_functions(graph, stacks)
    remove_noise(graph)

    # Leaf calls: re-target Dynamo's call_module nodes, collapse inlined leaves.
    method_calls = module_method_calls(dgm, names, stacks)
    regrouper = _Regrouper(dgm, model, policy, names, stacks, calls.capture, list(placeholders))
    regrouper.run()
    for node, name in method_calls.items():
        if not getattr(node, "_erased", False):  # not collapsed into an enclosing leaf
            regrouper.targets.setdefault(node, name)
    notes.extend(regrouper.notes)

    # Inputs: keep those of the prepared call; bake concrete_args in.
    prepared_flat = pytree.tree_flatten_with_path((calls.prepared.args, calls.prepared.kwargs))[0]
    prepared_paths = {pytree.keystr(p) for p, _ in prepared_flat}
    kept: list[fx.Node] = []
    for node, (path, value) in zip(placeholders, flat_capture):
        if pytree.keystr(path) in prepared_paths:
            kept.append(node)
            continue
        if node.users and isinstance(value, torch.Tensor):
            with graph.inserting_after(node):
                const = graph.get_attr(f"_fxprep_concrete_{node.name}")
            setattr(dgm, str(const.target), value)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
        elif node.users:
            for user in list(node.users):
                user.replace_input_with(node, value)
        graph.erase_node(node)
    if len(kept) != len(prepared_flat):
        raise ReliftError("inputs of the prepared call do not match the captured graph's inputs")
    orig_args = _positional_names(model, len(calls.prepared.args)) + list(calls.prepared.kwargs)
    for node, (path, _) in zip(kept, prepared_flat):
        _rename(node, _input_name(path, orig_args, len(calls.prepared.args)))
    in_spec = pytree.tree_structure((calls.prepared.args, calls.prepared.kwargs))
    pytree_info = torch.fx.graph._PyTreeInfo(orig_args, in_spec, info.out_spec)

    first = _first_tensor(calls.prepared)
    anchor = kept[first[0]] if first is not None else None
    device = first[1].device if first is not None else None
    replaced = replace_device_literals(graph, anchor, device)
    if replaced:
        notes.append(
            f"{replaced} device literal(s) ({device}) baked in by Dynamo now read the device of the first "
            f"input tensor, so the prepared module follows .to(device)."
        )
    gm = _build(dgm, model, names, stacks, regrouper.targets, pytree_info, notes)
    gm.meta[ROUTE_META] = route
    return gm, regrouper.extra_leaves


def _input_name(path: tuple[Any, ...], orig_args: list[str], n_positional: int) -> str:
    """``x``, ``input_ids``, ``pair_0``: a readable name for a flattened input."""
    parts: list[str] = []
    if len(path) >= 2 and isinstance(path[0], pytree.SequenceKey):
        first = path[1]
        if path[0].idx == 0 and isinstance(first, pytree.SequenceKey) and first.idx < n_positional:
            parts.append(orig_args[first.idx])
        elif isinstance(first, pytree.MappingKey):
            parts.append(str(first.key))
        for key in path[2:]:
            parts.append(str(getattr(key, "idx", getattr(key, "key", getattr(key, "name", "")))))
    name = re.sub(r"\W", "_", "_".join(parts)) or "input"
    return name if not name[0].isdigit() else f"input_{name}"


def _rename(node: fx.Node, name: str) -> None:
    try:
        node._rename(name)
        if node.op == "placeholder":
            node.target = node.name
    except Exception:  # noqa: BLE001 - a cosmetic nicety only
        pass


def _failure(err: BaseException, start: float) -> tuple[None, CaptureAttempt]:
    return None, CaptureAttempt.failed("dynamo", err, start)


_RETRY_ON_REGROUP = ("neither buffers/parameters/constants", "install_free_tensors")
# Inputs made to require grad cannot be written in place, turned into NumPy, ...: "a leaf Variable
# that requires grad is being used in an in-place operation".
_RETRY_WITHOUT_GRAD = ("requires grad",)


def capture_dynamo(
    model: nn.Module,
    policy: LeafPolicy,
    example: ExampleInputs,
    concrete_args: dict[str, Any] | None = None,
    *,
    route: str = "auto",
    dynamic: Any = None,
) -> tuple[CaptureResult | None, CaptureAttempt]:
    """Capture ``model`` with Dynamo and re-lift it to module level.

    ``route`` is ``"auto"`` (the flag route when this torch has the flag, else regroup; a flag-route
    failure Dynamo only has on that route is retried with regroup), ``"flag"`` or ``"regroup"``.
    ``dynamic`` marks dimensions dynamic (``"batch"`` or ``{arg: {dim: name}}``).
    Never raises for a capture failure.
    """
    start = time.perf_counter()
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
    if route == "flag" and not flag_available():
        err = RuntimeError(f"this torch has no torch._dynamo.config.{FLAG}; use route='regroup'")
        return _failure(err, start)
    current = default_route() if route == "auto" else route
    calls = _split_calls(model, example, concrete_args)
    notes: list[str] = []
    try:
        spec = dynamic_shapes_spec(model, calls.capture, dynamic)
    except Exception as err:  # noqa: BLE001
        return _failure(err, start)
    from . import huggingface

    caches = tensor_caches(model)
    grad_inputs = True
    while True:  # each failure below relaxes one thing and tries again, or gives up
        guard = AttributeGuard(model, caches)
        attempt_notes: list[str] = []
        try:
            with huggingface.capture_context(model, attempt_notes), guard:
                capture_call = requiring_grad(calls.capture) if grad_inputs else calls.capture
                result = _export(model, capture_call, current, spec)
                guard.reset()  # Dynamo left fake tensors in attributes forward() writes
                gm, extra = relift(result.graph_module, model, policy, calls, current, attempt_notes)
            notes.extend(attempt_notes)
            break
        except Exception as err:  # noqa: BLE001 - reported, the cascade goes on
            if grad_inputs and any(s in str(err) for s in _RETRY_WITHOUT_GRAD):
                grad_inputs = False  # capture the inputs as given instead
            elif caches:
                caches = []  # maybe the model cannot run with its caches emptied: keep them in place
            elif route == "auto" and current == "flag" and any(s in str(err) for s in _RETRY_ON_REGROUP):
                notes.append(f"Dynamo's call_module route failed ({type(err).__name__}); used the regroup route.")
                current = "regroup"
            else:
                return _failure(err, start)
    written = guard.written
    if caches:
        notes.append(
            f"{len(caches)} tensor cache(s) ({', '.join(sorted({k for _, k, _ in caches}))}) were emptied during "
            f"capture so the graph computes them from the parameters instead of baking in cached values."
        )
    if written:
        notes.append(
            f"forward() writes module attributes ({', '.join(sorted(written)[:6])}); they were restored after "
            f"capture, and values kept this way are not part of the graph."
        )
    unused = unreferenced_parameters(gm, model)
    consts = gm.meta.get("fxprep_constants", [])
    if consts and unused:
        notes.append(
            f"WARNING: parameter(s) {', '.join(unused[:8])}{'...' if len(unused) > 8 else ''} are not referenced by "
            f"the prepared graph while it reads constant tensors {', '.join(consts[:5])}: if the forward derives "
            f"those constants from the parameters (a cache), changing the parameters will NOT change the prepared "
            f"module. Clear the cache or use tracer='fx'."
        )
    if dynamic:
        notes.append(f"dynamic dimensions: {dynamic_dims(model, calls.capture, dynamic)}")
    result_ = CaptureResult(gm, "dynamo", notes=notes, extra_leaves=extra)
    return result_, CaptureAttempt("dynamo", True, time.perf_counter() - start)


__all__ = [
    "ROUTES",
    "capture_dynamo",
    "default_route",
    "dynamic_shapes_spec",
    "flag_available",
    "grown_example",
    "relift",
    "remove_grad_toggles",
    "replace_device_literals",
    "resolve_source",
    "tensor_caches",
    "unreferenced_parameters",
]
