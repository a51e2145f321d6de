"""The user's objects behind Dynamo's names.

Dynamo refers to modules by *source* strings (``getattr(L['self'].layer1, '0').conv1``) in each
node's ``nn_module_stack``, and to tensors by its own mangled attribute names. Re-lifting needs the
user's very objects: this module maps modules and tensors to their qualified names by identity
(:class:`Names`), evaluates Dynamo's source strings against the root without ``eval``
(:func:`resolve_source`), and resolves a node's module stack to frames of user modules
(:class:`Stacks`). It also holds the leaf rule both routes share (:func:`default_leaf`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..shapes.dims import self_in_args


class ReliftError(RuntimeError):
    """The Dynamo graph could not be turned back into a module-level graph (an fxprep limitation)."""


class Names:
    """Qualified names of the user's modules and tensors (parameters, buffers, tensor attributes),
    found by identity; the first name wins for objects reachable under several."""

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


_TOKEN = re.compile(
    r"\s*(?:(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|(?P<num>-?\d+)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<op>[.\[\](),]))"
)


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


def self_alias(module: nn.Module) -> re.Pattern[str] | None:
    """How Dynamo names ``module`` in the frame of its own ``forward`` when that is not
    ``L['self']`` (a pattern matching it), else None.

    Why: a ``forward`` wrapped by a decorator whose wrapper takes ``(*args, **kwargs)`` (transformers
    5.24's ``deprecate_kwarg`` on every Llama-family ``forward``) is the frame Dynamo traces, and
    there ``self`` is ``args[0]``: the module stack says ``L['args'][0].model.embed_tokens``. Only a
    wrapper with no named positional parameter qualifies (:func:`..shapes.dims.self_in_args`)."""
    name = self_in_args(module)
    if name is None:
        return None
    return re.compile(r"L\[(['\"])" + re.escape(name) + r"\1\]\[0\]")


def canonical_source(text: str, alias: re.Pattern[str] | None) -> str:
    """``text`` with the traced module named ``L['self']`` (see :func:`self_alias`)."""
    return text if alias is None else alias.sub("L['self']", text)


def _source_path(text: str) -> str:
    """A readable dotted path from a source name (only for modules outside the user's tree)."""
    text = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", text)
    text = re.sub(r"getattr\(", "", text)
    text = re.sub(r",\s*['\"]([^'\"]*)['\"]\)", r".\1", text)
    text = re.sub(r"\[(-?\d+)\]", r".\1", text)
    return re.sub(r"[^0-9A-Za-z_.]+", "_", text).strip("._")


@dataclass
class Frame:
    key: str
    base: str
    k: int
    source: str
    cls: type
    module: nn.Module | None
    qualname: str


class Stacks:
    """Resolves ``nn_module_stack`` entries to the user's modules (cached per key)."""

    def __init__(self, model: nn.Module, names: Names):
        self.model = model
        self.names = names
        self.alias = self_alias(model)
        self.cache: dict[tuple[str, str], Frame] = {}

    def frame(self, key: str, source: str, cls: type) -> Frame:
        cached = self.cache.get((key, source))
        if cached is not None:
            return cached
        base, _, k = key.partition("@")
        obj = resolve_source(canonical_source(source, self.alias), self.model) if isinstance(source, str) else None
        if not isinstance(obj, nn.Module) and base.isdigit():
            obj = self.names.module_objs.get(int(base))  # inlined route: keys are id(module)
        module = obj if isinstance(obj, nn.Module) else None
        qualname = self.names.module_name(module) if module is not None else None
        if qualname is None:
            qualname = _source_path(source) if isinstance(source, str) else base
        frame = Frame(key, base, int(k) if k.isdigit() else 0, source, cls, module, qualname)
        self.cache[(key, source)] = frame
        return frame

    def owner(self, node: fx.Node) -> nn.Module:
        """The module of the model whose ``forward`` made ``node``: the innermost frame that is one
        (a module held in a global, such as the kernels package's wrapper of a function, is no module
        of the model: the call is its caller's); the root when no frame resolves."""
        for frame in reversed(self.of(node)):
            if frame.module is not None:
                return frame.module
        return self.model

    def of(self, node: fx.Node) -> list[Frame]:
        stack = node.meta.get("nn_module_stack") or {}
        frames = []
        for key, value in stack.items():
            source, cls = value if isinstance(value, tuple) and len(value) == 2 else (str(value), object)
            cls = cls.__dict__.get("__fxprep_original_class__", cls) if isinstance(cls, type) else cls  # recording.patched
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


@dataclass
class Group:
    """The nodes of one leaf call: all nodes whose module stack reaches the same leaf frame key."""

    key: str
    frames: list[Frame]  # the stack up to and including the leaf frame
    nodes: list[fx.Node]

    @property
    def leaf(self) -> Frame:
        return self.frames[-1]


def frames_meta(frames: list[Frame]) -> dict[str, tuple[str, type]]:
    """``frames`` in ``nn_module_stack`` form."""
    return {f.key: (f.source, f.cls) for f in frames}


def read_part(graph: fx.Graph, value: fx.Node, key: Any) -> fx.Node:
    """A node reading one pytree step (``key``) of ``value``: the output of a regrouped call or of an
    opaque part, taken apart into the pieces Dynamo's graph used."""
    if isinstance(key, pytree.SequenceKey):
        return graph.call_function(operator.getitem, (value, key.idx))
    if isinstance(key, pytree.MappingKey):
        return graph.call_function(operator.getitem, (value, key.key))
    if isinstance(key, pytree.GetAttrKey):
        return graph.call_function(getattr, (value, key.name))
    raise ReliftError(f"cannot read part {key!r} of a call's output")
