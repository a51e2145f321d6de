"""Dynamic shapes: which input dimensions Dynamo may keep symbolic, and a second input to verify them.

The user says ``dynamic="batch"`` or ``{argument: {dim: name}}``; Dynamo wants ``dynamic_shapes``
keyed by argument name with ``torch.export.Dim`` objects, and verification wants a second example
whose dynamic dimensions differ (:func:`grown_example`). Both need the names of the positional
arguments (:func:`positional_names`), which the re-lifting also uses to name the graph's inputs.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.inputs import ExampleInputs

# Dynamo's name for a size of a named input: ``L['input_ids'].size()[1]`` (``L['kwargs']['input_ids']...``
# where the input came through ``**kwargs``): groups (input name, dimension)
SIZE_SOURCE = re.compile(r"L(?:\['kwargs'\])?\['(\w+)'\]\.size\(\)\[(\d+)\]")


def positional_names(model: nn.Module, count: int) -> list[str]:
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


def self_in_args(module: nn.Module) -> str | None:
    """The name of the ``*args`` that holds ``self`` first in the frame Dynamo traces for ``module``'s
    ``forward``, or None where ``self`` is a parameter of its own.

    Why: a ``forward`` wrapped by a decorator whose wrapper takes ``(*args, **kwargs)`` (transformers'
    ``deprecate_kwarg`` on most decoder layers) is that frame, called as a bound method: the module is
    ``L['args'][0]`` and its first input ``L['args'][1]``. Only a wrapper with no named positional
    parameter qualifies; in ``forward(self, *args)`` the varargs are inputs."""
    fn = getattr(module.forward, "__func__", module.forward)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount or code.co_posonlyargcount or not code.co_flags & inspect.CO_VARARGS:
        return None
    return str(code.co_varnames[code.co_kwonlyargcount])


def named_inputs(model: nn.Module, call: ExampleInputs) -> dict[str, Any]:
    """``call``'s arguments by name: positional ones named after ``model.forward``'s parameters."""
    names = positional_names(model, len(call.args))
    return {**dict(zip(names, call.args)), **call.kwargs}


def shortest_length(model: nn.Module, call: ExampleInputs, dynamic: Any) -> int | None:
    """The smallest size in ``call`` of a dimension ``dynamic`` declares other than the batch (a
    sequence length), or None when it declares none."""
    inputs = named_inputs(model, call)
    sizes = [int(inputs[name].shape[d]) for name, dims in dynamic_dims(model, call, dynamic).items()
             for d in dims if d % max(inputs[name].dim(), 1) != 0] if dynamic else []
    return min(sizes) if sizes else None


def hints(sizes: Any) -> list[int] | None:
    """``sizes`` (ints and symbolic sizes) as their values in the example being traced; None where
    one has no such value (an unbacked size)."""
    out = []
    for s in sizes:
        if type(s) is int:
            out.append(s)
            continue
        hint = getattr(getattr(s, "node", None), "hint", None)
        if hint is None:
            return None
        out.append(int(hint))
    return out


@dataclass(frozen=True)
class MaybeDynamic:
    """A dimension declared to Dynamo as ``Dim.AUTO``: dynamic unless the code specialises it, with
    no range for export to prove (:attr:`~.autodims.SizeRange.unproven`); ``name`` is its symbol for the
    report, which a ``Dim.AUTO`` has none of."""

    name: str


def dynamic_shapes_spec(model: nn.Module, call: ExampleInputs, dynamic: Any) -> dict[str, Any] | None:
    """``dynamic`` (``"batch"``, or ``{arg: {dim: name}}``) as a ``dynamic_shapes`` dict for export.

    Dimensions with the same name share one symbol. Arguments not named are static.
    """
    if dynamic is None or dynamic is False:
        return None
    from torch.export import Dim

    dims: dict[str, Any] = {}

    def dim(name: Any) -> Any:
        if isinstance(name, MaybeDynamic):
            return Dim.AUTO
        if not isinstance(name, str):
            return name  # already a Dim (or a hint such as Dim.DYNAMIC)
        if name not in dims:
            dims[name] = Dim(re.sub(r"\W", "_", name) or "d")
        return dims[name]

    inputs = named_inputs(model, call)
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
    return _nested_var_keyword(model, spec)


def _nested_var_keyword(model: nn.Module, spec: dict[str, Any]) -> dict[str, Any]:
    """Export matches ``dynamic_shapes`` to the forward's own parameters: keyword arguments that
    ``forward(..., **kwargs)`` takes in its ``**kwargs`` go under that parameter's name."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return spec
    var_kw = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    if var_kw is None:
        return spec
    named = {p.name for p in params.values() if p.kind is not p.VAR_KEYWORD}
    out = {k: v for k, v in spec.items() if k in named}
    extra = {k: v for k, v in spec.items() if k not in named}
    if extra:
        out[var_kw] = extra
    return out


def dynamic_dims(model: nn.Module, call: ExampleInputs, dynamic: Any) -> dict[str, dict[int, str]]:
    """``{input name: {dim: symbol name}}`` of the dimensions ``dynamic`` makes dynamic."""
    out: dict[str, dict[int, str]] = {}
    inputs = named_inputs(model, call)
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        if dynamic == "batch" and value.dim() >= 1:
            out[name] = {0: "batch"}
        elif isinstance(dynamic, dict) and dynamic.get(name):
            out[name] = {int(d): n if isinstance(n, str) else n.name if isinstance(n, MaybeDynamic)
                         else str(getattr(n, "__name__", n))
                         for d, n in dynamic[name].items()}
    return out


def repeated_to(value: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``value`` made ``size`` long in ``dim``, its values kept valid: in dimension 0 (a batch) by
    repeating it whole (the extra rows repeat the first ones); in a later dimension (a sequence) by
    repeating its last entry, since a sequence's start may be special where its end is plain text
    (a VLM's prompt opens with its image tokens, whose number must match the images)."""
    if dim == 0 or value.shape[dim] == 0:
        reps = math.ceil(size / max(value.shape[dim], 1))
        return torch.cat([value] * reps, dim=dim).narrow(dim, 0, size)
    if size <= value.shape[dim]:
        return value.narrow(dim, 0, size)
    last = value.narrow(dim, value.shape[dim] - 1, 1)
    return torch.cat([value, last.expand(*[size - value.shape[dim] if i == dim else -1
                                           for i in range(value.dim())])], dim=dim)


def grown_example(model: nn.Module, example: ExampleInputs, dynamic: Any, grow: int | dict[str, int] = 1) -> ExampleInputs:
    """A second example whose dynamic dimensions are ``grow`` larger (:func:`repeated_to`, so token
    ids and masks stay valid); ``grow`` may be given per dimension name (a name it does not give keeps
    its size). Dimensions sharing a name grow together."""
    dims = dynamic_dims(model, example, dynamic)

    def grown(value: Any, spec: dict[int, str] | None) -> Any:
        if not isinstance(value, torch.Tensor) or not spec:
            return value
        for d, name in sorted(spec.items()):
            more = grow if isinstance(grow, int) else grow.get(str(name), 0)
            d = d % value.dim()
            value = repeated_to(value, d, value.shape[d] + more) if more else value
        return value

    names = positional_names(model, len(example.args))
    args = tuple(grown(a, dims.get(n)) for n, a in zip(names, example.args))
    kwargs = {k: grown(v, dims.get(k)) for k, v in example.kwargs.items()}
    return ExampleInputs(args, kwargs)


def model_sources(model: nn.Module, call: ExampleInputs, dims: dict[str, dict[int, str]]) -> dict[str, str]:
    """Each way the model's capture may name a declared dimension of its inputs (``dims``, by input
    name; ``call``: what Dynamo is called with), mapped to ``L['name'].size()[d]``."""
    positional = positional_names(model, len(call.args))
    shift = 1 if self_in_args(model) is not None else 0  # ``self`` is args[0] there
    out: dict[str, str] = {}
    for name, declared in dims.items():
        spellings = [f"L['{name}']", f"L['kwargs']['{name}']"]
        if name in positional:
            spellings.append(f"L['args'][{positional.index(name) + shift}]")
        for d in declared:
            out.update({f"{spelling}.size()[{d}]": f"L['{name}'].size()[{d}]" for spelling in spellings})
    return out


def model_dimensions(dims: dict[str, dict[int, str]]) -> dict[str, str]:
    """Each declared size of the model's inputs (``dims``: ``{input: {dim: symbol}}``) as
    :func:`model_sources` names it (``L['input_ids'].size()[1]``), to its declared symbol (``seq``)."""
    return {f"L['{name}'].size()[{d}]": sym for name, declared in dims.items() for d, sym in declared.items()}
