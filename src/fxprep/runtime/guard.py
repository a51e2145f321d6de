"""What a prepared module checks about its inputs before computing anything.

A captured graph is valid only for inputs structured like its example, and called otherwise it
computes something else rather than failing. :func:`record` keeps that structure as an
:class:`InputSpec`, and :func:`check` compares each call with it (lengths, keys, None-ness,
specialised scalars, and on the Dynamo path every dimension not declared dynamic), raising
:class:`~fxprep.errors.InputMismatch`. The spec is plain data; the check is skipped while the module
is traced or compiled. This module depends only on :mod:`fxprep.errors`.

See docs/concepts/shapes.md.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx

from ..errors import InputMismatch

# Spec nodes (plain data, JSON-able): {"kind": "tensor", "shape": [2, None, 8] | None},
# {"kind": "none"}, {"kind": "seq", "type": "list", "items": [...]}, {"kind": "dict", "items":
# {key: ...}}, {"kind": "value", "value": 3}, {"kind": "leaf"} (anything but None or a container).
# A node made from a tensor also keeps the example's own "example": {"shape": [1, 3, 8], "dtype":
# "float32"}: never checked against a call (``shape`` says what is), but it lets a save be run on a
# probe shaped like the example it was captured on (fxprep.io.selfcheck).
SCALARS = (bool, int, float, str)


# The spec's ``tracer`` when Dynamo's rules made it (static shapes where not declared dynamic), as saves
# hold it: capture/routes.Route.DYNAMO's value (runtime/ imports nothing of capture/; a test keeps the
# two equal). Any other value is fx's rules: the structure alone is checked.
DYNAMO_RULES = "dynamo"


class InputSpec:
    """The inputs a prepared module was captured for: ``params`` maps each argument name of the
    generated ``forward`` to a spec node (see the comment above); ``tracer`` says which rules made
    it ("dynamo": static shapes where not ``dynamic``)."""

    def __init__(self, params: dict[str, Any], tracer: str):
        self.params = params
        self.tracer = tracer
        self._signature: inspect.Signature | None = None
        self._binding: _Binding | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "tracer": self.tracer}

    @classmethod
    def from_dict(cls, data: Any) -> InputSpec:
        if not isinstance(data, dict) or not isinstance(data.get("params"), dict) or not isinstance(data.get("tracer"), str):
            raise ValueError("malformed input spec")
        for node in data["params"].values():
            _check_node(node, 0)
        return cls(dict(data["params"]), data["tracer"])

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.params, self.tracer, self._signature, self._binding = state["params"], state["tracer"], None, None

    def __deepcopy__(self, memo: dict[int, Any]) -> InputSpec:
        return InputSpec(_copy(self.params), self.tracer)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputSpec) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"InputSpec({self.tracer}: {', '.join(self.params)})"


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


_KINDS = {"tensor", "none", "seq", "dict", "value", "leaf"}


def _check_node(node: Any, depth: int) -> None:
    """A spec read from a file: only the shapes this module writes, nothing deeper than 64."""
    if depth > 64 or not isinstance(node, dict) or not isinstance(node.get("kind"), str) or node["kind"] not in _KINDS:
        raise ValueError("malformed input spec")
    kind = node["kind"]
    example = node.get("example")
    if example is not None and not (
            isinstance(example, dict) and isinstance(example.get("dtype"), str) and isinstance(example.get("shape"), list)
            and len(example["shape"]) <= 64 and all(type(d) is int and 0 <= d < 2**40 for d in example["shape"])):
        raise ValueError("malformed input spec")
    if kind == "tensor":
        shape = node.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(d is None or type(d) is int for d in shape)):
            raise ValueError("malformed input spec")
        why = node.get("why")
        if why is not None and not (isinstance(why, dict) and all(
                isinstance(k, str) and isinstance(v, str) and len(v) <= 1000 for k, v in why.items())):
            raise ValueError("malformed input spec")
        limits = node.get("range")
        if limits is not None and not (isinstance(limits, dict) and all(
                isinstance(k, str) and k.isdigit() and len(k) <= 3 and isinstance(v, list) and len(v) == 3
                and all(b is None or type(b) is int for b in v[:2]) and isinstance(v[2], str) and len(v[2]) <= 1000
                for k, v in limits.items())):
            raise ValueError("malformed input spec")
    elif kind == "seq":
        if not isinstance(node.get("items"), list) or node.get("type") not in ("list", "tuple"):
            raise ValueError("malformed input spec")
        for item in node["items"]:
            _check_node(item, depth + 1)
    elif kind == "dict":
        if not isinstance(node.get("items"), dict):
            raise ValueError("malformed input spec")
        for item in node["items"].values():
            _check_node(item, depth + 1)
    elif kind == "value" and type(node.get("value")) not in SCALARS:
        raise ValueError("malformed input spec")


def _describe(value: Any, tracer: str, dynamic: set[int] | None, why: dict[int, str] | None = None,
              limits: dict[int, tuple[int | None, int | None, str]] | None = None) -> dict[str, Any]:
    if value is None:
        return {"kind": "none"}
    if isinstance(value, torch.Tensor):
        example = {"shape": [int(s) for s in value.shape], "dtype": str(value.dtype).removeprefix("torch.")}
        if tracer != DYNAMO_RULES:
            return {"kind": "leaf", "example": example}
        shape = [None if d in (dynamic or set()) else int(s) for d, s in enumerate(value.shape)]
        node = {"kind": "tensor", "shape": shape, "example": example}
        if why:  # dimensions found specialised by the model's code, with the reason
            node["why"] = {str(d): str(w) for d, w in why.items()}
        if limits:  # dynamic dimensions a branch of the model's code bounds: [min, max, why]
            node["range"] = {str(d): [lo, hi, str(w)] for d, (lo, hi, w) in limits.items()}
        return node
    if isinstance(value, (list, tuple)):
        return {"kind": "seq", "type": "list" if isinstance(value, list) else "tuple",
                "items": [_describe(v, tracer, None) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"kind": "dict", "items": {k: _describe(v, tracer, None) for k, v in value.items()}}
    if type(value) in SCALARS and tracer == DYNAMO_RULES:
        return {"kind": "value", "value": value}
    return {"kind": "leaf"}


def record(gm: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tracer: str,
           dynamic_dims: dict[str, set[int]], why: dict[str, dict[int, str]] | None = None,
           limits: dict[str, dict[int, tuple[int | None, int | None, str]]] | None = None) -> InputSpec | None:
    """The spec of ``gm`` captured (by ``tracer``) for the call ``gm(*args, **kwargs)``.

    ``dynamic_dims``: {argument name: dimensions left dynamic} (``dynamic=...``). Arguments of the
    generated forward that the call leaves to their defaults are fixed values (``concrete_args``):
    recorded as such. ``why``: {argument name: {dim: reason}} for dimensions found specialised
    (:mod:`fxprep.capture.shape_general`), said when a call differs there. ``limits``: {argument name: {dim: (min,
    max, why)}} for dynamic dimensions a branch of the model's code bounds (the graph holds one way of
    it), checked at each call. None when the forward's signature cannot be read or bound."""
    try:
        signature = inspect.signature(gm.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    params: dict[str, Any] = {}
    for name, p in signature.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return None  # cannot say which values the graph was captured for
        if name in bound.arguments:
            params[name] = _describe(bound.arguments[name], tracer, dynamic_dims.get(name), (why or {}).get(name),
                                     (limits or {}).get(name))
        elif p.default is None:
            params[name] = {"kind": "none"}
        elif type(p.default) in SCALARS:
            params[name] = {"kind": "value", "value": p.default}
    return InputSpec(params, tracer)


def tracing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Inputs are symbolic here (compile, export, an fx trace): nothing to check, and a check on
    symbolic sizes would specialise them."""
    if torch.compiler.is_compiling() or _is_exporting():
        return True
    if _FX_TLS is not None:
        # this thread's dict: a lookup, where getattr's default costs a raised AttributeError (~1.5 µs)
        if _FX_TLS.__dict__.get("flag", False):
            return True
    elif _fx_tracing():
        return True
    for v in args:
        if isinstance(v, fx.Proxy):
            return True
    for v in kwargs.values():
        if isinstance(v, fx.Proxy):
            return True
    return False


# read on every call of a prepared module: fx's thread-local flag directly where this torch has it
_FX_TLS = getattr(fx._symbolic_trace, "_is_fx_tracing_tls", None)
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _fx_tracing() -> bool:
    get = getattr(fx._symbolic_trace, "_get_is_fx_tracing", None)
    return bool(get is not None and get())


def check(gm: torch.nn.Module, spec: InputSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`InputMismatch` when ``gm(*args, **kwargs)`` does not fit ``spec`` (nothing while
    :func:`tracing`)."""
    if not tracing(args, kwargs):
        check_inputs(gm, spec, args, kwargs)


def check_inputs(gm: torch.nn.Module, spec: InputSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """:func:`check` for a caller that has already decided the inputs are not symbolic (a prepared
    module's call, which also checks its baked values: :func:`tracing` is asked once per call)."""
    if spec._signature is None:
        spec._signature = inspect.signature(gm.forward)
        spec._binding = _Binding(spec._signature)
    arguments = spec._binding.bind(args, kwargs) if spec._binding is not None else None
    if arguments is None:
        try:
            arguments = spec._signature.bind(*args, **kwargs).arguments
        except TypeError as err:
            raise InputMismatch(f"the prepared module was called with arguments its forward does not take: {err}. "
                                f"It takes {', '.join(spec._signature.parameters)}.") from err
    problems: list[str] = []
    for name, node in spec.params.items():
        if name in arguments:
            _match(node, arguments[name], name, problems)
        else:
            default = spec._signature.parameters[name].default
            if default is not inspect.Parameter.empty:
                _match(node, default, name, problems)
        if len(problems) >= 3:
            break
    if problems:
        raise InputMismatch(_message(spec, problems))


class _Binding:
    """``Signature.bind`` for the calls a prepared module gets on every forward, without its cost
    (~10 us, 1-2% of a small LLM's forward): arguments by position then by name, for a forward whose
    parameters are all positional-or-keyword (what fx generates). Anything else (an unknown name, an
    argument given twice, too many) returns None and takes ``Signature.bind``, which says what is wrong."""

    def __init__(self, signature: inspect.Signature):
        params = list(signature.parameters.values())
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.names: tuple[str, ...] | None = tuple(p.name for p in params) if plain else None
        self.known = frozenset(self.names or ())
        self.required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        names = self.names
        if names is None or len(args) > len(names):
            return None
        if not args:
            return kwargs if kwargs.keys() <= self.known and self.required <= kwargs.keys() else None
        arguments = dict(zip(names, args))
        for key, value in kwargs.items():
            if key in arguments or key not in self.known:
                return None
            arguments[key] = value
        return arguments if self.required <= arguments.keys() else None


def _match(node: dict[str, Any], value: Any, path: str, problems: list[str]) -> None:
    kind = node["kind"]
    if kind == "none":
        if value is not None:
            problems.append(f"{path}: None at capture (the graph has no input for it), got {_what(value)}")
        return
    if value is None:
        problems.append(f"{path}: {_captured(node)} at capture, got None")
        return
    if kind == "leaf":
        if isinstance(value, (list, tuple, dict)):
            problems.append(f"{path}: a single value at capture, got {_what(value)}")
    elif kind == "tensor":
        if not isinstance(value, torch.Tensor):
            problems.append(f"{path}: a tensor at capture, got {_what(value)}")
            return
        shape = node.get("shape")
        if shape is not None and (len(shape) != value.dim() or any(
                s is not None and s != int(v) for s, v in zip(shape, value.shape))):
            shown = "x".join("*" if s is None else str(s) for s in shape) or "scalar"
            reasons = node.get("why") or {}
            said = [f"dim {d}: {reasons[str(d)]}" for d, (s, v) in enumerate(zip(shape, value.shape))
                    if s is not None and s != int(v) and str(d) in reasons]
            problems.append(f"{path}: shape {shown} at capture ({'; '.join(said) if said else 'Dynamo specialised it'}), "
                            f"got {'x'.join(str(int(v)) for v in value.shape) or 'scalar'}")
            return
        for d, (low, high, why) in (node.get("range") or {}).items():
            size = int(value.shape[int(d)]) if int(d) < value.dim() else None
            if size is not None and ((low is not None and size < low) or (high is not None and size > high)):
                bounds = " and ".join(x for x in (f">= {low}" if low is not None else "",
                                                   f"<= {high}" if high is not None else "") if x)
                problems.append(f"{path}: dim {d} is {size}, the graph holds for {bounds} only ({why})")
    elif kind == "seq":
        items = node["items"]
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: a {node['type']} of {len(items)} at capture, got {_what(value)}")
        elif len(value) != len(items):
            problems.append(f"{path}: a {node['type']} of {len(items)} item(s) at capture, got {len(value)}"
                            + (f" (the graph would use the first {len(items)} and ignore the rest)"
                               if len(value) > len(items) else ""))
        else:
            for i, (item, v) in enumerate(zip(items, value)):
                _match(item, v, f"{path}[{i}]", problems)
    elif kind == "dict":
        items = node["items"]
        if not isinstance(value, dict):
            problems.append(f"{path}: a dict at capture, got {_what(value)}")
        elif set(value) != set(items):
            missing, extra = sorted(set(items) - set(value), key=str), sorted(set(value) - set(items), key=str)
            problems.append(f"{path}: dict keys differ from capture"
                            + (f"; missing {missing}" if missing else "") + (f"; not captured {extra}" if extra else ""))
        else:
            for key, item in items.items():
                _match(item, value[key], f"{path}[{key!r}]", problems)
    elif kind == "value":
        expected = node["value"]
        if type(value) is not type(expected) and not (isinstance(value, (int, float)) and isinstance(expected, (int, float))
                                                      and not isinstance(value, bool) and not isinstance(expected, bool)):
            problems.append(f"{path}: {expected!r} at capture, got {_what(value)}")
        elif value != expected:
            problems.append(f"{path}: {expected!r} at capture (baked into the graph), got {value!r}")


def _captured(node: dict[str, Any]) -> str:
    kind = node["kind"]
    if kind == "seq":
        return f"a {node['type']} of {len(node['items'])}"
    if kind == "dict":
        return "a dict"
    if kind == "value":
        return repr(node["value"])
    return "a tensor" if kind == "tensor" else "a value"


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {'x'.join(str(int(s)) for s in value.shape) or 'scalar'}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r:.40}"


def _message(spec: InputSpec, problems: list[str]) -> str:
    lines = ["the prepared module was captured for inputs structured like its example, and this call differs "
             "(the graph would silently compute something else):"]
    lines += [f"  - {p}" for p in problems]
    if spec.tracer == DYNAMO_RULES and any("specialised" in p for p in problems):
        lines.append("Prepare with dynamic='batch' (or dynamic={argument: {dim: name}}) to allow other sizes, "
                     "or with tracer='fx'.")
    else:
        lines.append("Prepare the model again with example inputs structured like this call.")
    return "\n".join(lines)
