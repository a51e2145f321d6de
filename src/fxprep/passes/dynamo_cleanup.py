"""Clean-ups of a Dynamo graph: what Dynamo records that an fx capture of the same model would not.

Each is a plain ``GraphModule -> GraphModule`` pass that edits ``gm.graph`` in place (the caller
recompiles once) and, given a ``notes`` list, says in a sentence what it changed:

* :func:`remove_grad_toggles`: ``torch.no_grad`` regions are ``_set_grad_enabled`` calls in the graph;
* :func:`remove_noise`: logging-only calls (``torch._C._log_api_usage_once``);
* :func:`rewrite_sym_ops`: ``aten.sym_size.int(x, d)`` under dynamic shapes, back to ``x.size(d)``;
* :func:`portable_tensor_checks`: ``aten._is_all_true(x)`` (``torch._check_tensor_all``) as ``torch.all(x)``;
* :func:`setitem_as_method`: ``t[index] = value`` on a tensor as ``t.__setitem__(index, value)`` (re-traceable);
* :func:`fold_numpy_constants`: NumPy calls on constants, Dynamo-wrapped, back to Python numbers;
* :func:`restore_autograd_functions`: a custom ``autograd.Function`` recorded as a higher-order op
  over Dynamo-internal bodies, back to a call of the user's Function;
* :func:`replace_device_literals`: ``device=`` literals Dynamo baked in, back to the input's device.
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..ops import autograd_function_caller

_GRAD_TOGGLES = {torch._C._set_grad_enabled}
_SYM_METHODS = {}
for _name, _method in (("sym_size", "size"), ("sym_stride", "stride")):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None and hasattr(_packet, "int"):
        _SYM_METHODS[_packet.int] = _method
if hasattr(torch.ops.aten, "sym_numel"):
    _SYM_METHODS[torch.ops.aten.sym_numel.default] = "numel"


def remove_grad_toggles(gm: fx.GraphModule, *, enabled_at_capture: bool = True,
                        notes: list[str] | None = None) -> fx.GraphModule:
    """Drop ``_set_grad_enabled`` calls; values computed with grad disabled and used after the
    region get an explicit ``.detach()`` so gradients stay exactly what they were."""
    graph = gm.graph
    nodes = list(graph.nodes)
    toggles = [n for n in nodes if n.op == "call_function" and n.target in _GRAD_TOGGLES]
    if not toggles:
        return gm
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
    if notes is not None:
        notes.append(
            f"{len(toggles)} torch.no_grad/enable_grad toggle(s) removed from the graph; values computed without "
            f"grad are detached where they leave the region, so gradients are unchanged."
        )
    return gm


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


def remove_noise(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop calls that only log (``torch._C._log_api_usage_once``)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _NOISE and not node.users:
            gm.graph.erase_node(node)
    return gm


def rewrite_sym_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """``aten.sym_size.int(x, d)`` (dynamic shapes) → ``x.size(d)``, a plain fx-level call."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _SYM_METHODS:
            with graph.inserting_before(node):
                new = graph.call_method(_SYM_METHODS[node.target], tuple(node.args), dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    return gm


_IS_ALL_TRUE = getattr(getattr(torch.ops.aten, "_is_all_true", None), "default", None)


def portable_tensor_checks(gm: fx.GraphModule) -> fx.GraphModule:
    """``x._is_all_true()`` (what Dynamo records for ``torch._check_tensor_all(cond)``, which
    transformers' own checks call; or ``aten._is_all_true(x)``) → ``torch.all(x)``: the same 0-dim
    bool tensor, but an op every exporter knows. The ONNX exporters have no ``_is_all_true``, so a
    graph holding it (Llava's image-token check) could not be exported, by fxprep or by a toolkit
    it was handed to."""
    graph = gm.graph
    for node in list(graph.nodes):
        found = (node.op == "call_method" and node.target == "_is_all_true") or \
            (node.op == "call_function" and _IS_ALL_TRUE is not None and node.target is _IS_ALL_TRUE)
        if found and len(node.args) == 1 and not node.kwargs:
            with graph.inserting_before(node):
                new = graph.call_function(torch.all, tuple(node.args))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    return gm


def setitem_as_method(gm: fx.GraphModule) -> fx.GraphModule:
    """``operator.setitem(t, index, value)`` on a tensor (``mask[:n, :n] = 0``) → ``t.__setitem__(index,
    value)``: the same in-place write, but code a ``torch.fx`` re-trace can follow. fx generates the
    former as the statement ``t[index] = value``, which a Proxy refuses ("does not support item
    assignment"), so torch.ao's ``prepare_fx`` could not take a graph holding one (Pixtral's block
    attention mask)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.setitem or len(node.args) != 3 or node.kwargs:
            continue
        target = node.args[0]
        value = target.meta.get("example_value", target.meta.get("val")) if isinstance(target, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue  # a list or dict written in place: fx's statement form re-traces fine
        with graph.inserting_before(node):
            new = graph.call_method("__setitem__", tuple(node.args))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return gm


_APPLY_CALL = re.compile(r"([A-Za-z_][\w.]*)\.apply\s*\(")


def _apply_line(node: fx.Node) -> str:
    """The source line Dynamo recorded for ``node`` (its stack trace's last line of code)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()
             if ln.strip() and not ln.strip().startswith("File ") and set(ln.strip()) - set("^~ ")]
    return lines[-1] if lines else ""


def _user_autograd_function(node: fx.Node, owner: nn.Module) -> type[torch.autograd.Function] | None:
    """The ``autograd.Function`` class a Dynamo ``autograd_function_apply`` node came from.

    Dynamo keeps only the traced forward/backward bodies, not the class. The source line it records
    (``return GeLUFunction.apply(x)``) names it, and the module whose ``forward`` made the call
    gives the globals to resolve that name in. None when that does not lead to exactly one class.
    """
    found = _APPLY_CALL.findall(_apply_line(node))
    if len(found) != 1:
        return None
    scope: Any = getattr(type(owner).forward, "__globals__", {})
    head, *rest = found[0].split(".")
    value = scope.get(head)
    for part in rest:
        value = getattr(value, part, None)
    if isinstance(value, type) and issubclass(value, torch.autograd.Function):
        return value
    return None


def _apply_arguments(gm: fx.GraphModule, node: fx.Node, cls: type[torch.autograd.Function]) -> tuple[Any, ...] | None:
    """The arguments of the user's ``cls.apply(...)`` call that Dynamo recorded as ``node``; None
    when they cannot be told for certain.

    Dynamo's node holds the tensors the forward body reads (its free variables, in the order the
    body first reads them), not the call's arguments: ``XSoftmax.apply(scores, mask, -1)`` becomes
    ``(fwd, bwd, mask, scores)``, the ``-1`` folded into the body. So the call is read from its
    source line, each argument a literal (kept as it is) or a name, and each free variable placed
    at the argument it is: the one named as Dynamo named the variable (``mask``, ``mask_1``, an
    input's ``l_mask_``), or else the one whose parameter of ``forward`` the body reads it as (the
    lines of ``forward`` that use it name that parameter alone). A Function of one tensor argument
    called with one free variable needs no reading. Otherwise the node stays Dynamo's
    (:mod:`fxprep.passes.functional_to_module` wraps it)."""
    lifted = list(node.args[2:])
    if not all(isinstance(a, fx.Node) for a in lifted):
        return None
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # after ctx
    except (TypeError, ValueError):
        return None
    if any(p.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params):
        return None
    mask = node.kwargs.get("args_tensor_mask")
    if isinstance(mask, (list, tuple)):  # older torch: the call's tensors in order, then the body's other reads
        return _arguments_by_mask(node, cls.__name__, [bool(m) for m in mask], lifted)
    read = _arguments_from_source(node, cls.__name__, [p.name for p in params], lifted, _body_reads(gm, node, params))
    if read is not None:
        return read
    return tuple(lifted) if len(params) == 1 and len(lifted) == 1 else None


def _body_reads(gm: fx.GraphModule, node: fx.Node, params: list[Any]) -> list[set[str]]:
    """For each free variable of ``node``'s forward body, the parameters of ``forward`` that every
    line of code using it names (empty where there is no body or no line)."""
    body = getattr(gm, node.args[0].target, None) if isinstance(node.args[0], fx.Node) else None
    names = {p.name for p in params}
    if not isinstance(body, fx.GraphModule):
        return []
    found: list[set[str]] = []
    for placeholder in (n for n in body.graph.nodes if n.op == "placeholder"):
        common: set[str] | None = None
        for user in placeholder.users:
            try:
                tree = ast.parse(_apply_line(user))
            except SyntaxError:
                common = set()
                break
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & names
            common = used if common is None else common & used
        found.append(common or set())
    return found


def _arguments_from_source(node: fx.Node, name: str, params: list[str], lifted: list[fx.Node],
                           reads: list[set[str]]) -> tuple[Any, ...] | None:
    """``name.apply(...)``'s arguments read from ``node``'s source line (see :func:`_apply_arguments`);
    ``reads``: :func:`_body_reads`. None where any argument cannot be told."""
    tree = _source_call(node, name)
    if tree is None or len(tree.args) > len(params):
        return None
    placed: dict[int, fx.Node] = {}
    for i, value in enumerate(lifted):
        named = [k for k, a in enumerate(tree.args) if isinstance(a, ast.Name) and a.id in _variable_names(value.name)]
        if len(named) != 1 and i < len(reads) and len(reads[i]) == 1:
            named = [params.index(next(iter(reads[i])))]
        if len(named) != 1 or named[0] in placed or named[0] >= len(tree.args):
            return None
        placed[named[0]] = value
    arguments: list[Any] = []
    for k, arg in enumerate(tree.args):
        if k in placed:
            arguments.append(placed[k])
            continue
        value = _literal(arg)
        if value is _NOT_LITERAL:
            return None  # a name that is no free variable, an expression
        arguments.append(value)
    return tuple(arguments)


def _arguments_by_mask(node: fx.Node, name: str, mask: list[bool], values: list[fx.Node]) -> tuple[Any, ...] | None:
    """The call's arguments where Dynamo's node says which were tensors (``args_tensor_mask``, torch
    before 2.10): those tensors in order, each other argument a literal read from the source line."""
    if all(mask):
        return tuple(values[:len(mask)])
    tree = _source_call(node, name)
    if tree is None or len(tree.args) != len(mask):
        return None
    tensors = iter(values[:sum(mask)])
    arguments: list[Any] = []
    for is_tensor, arg in zip(mask, tree.args):
        if is_tensor:
            arguments.append(next(tensors))
            continue
        value = _literal(arg)
        if value is _NOT_LITERAL:
            return None
        arguments.append(value)
    return tuple(arguments)


_NOT_LITERAL = object()


def _literal(arg: Any) -> Any:
    """The value of the call argument ``arg`` (an ``ast`` node) where it is a literal, else :data:`_NOT_LITERAL`."""
    try:
        return ast.literal_eval(arg)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return _NOT_LITERAL


def _source_call(node: fx.Node, name: str) -> Any:
    """The ``name.apply(...)`` call on ``node``'s source line, parsed (an ``ast.Call`` with plain
    positional arguments), or None."""
    line = _apply_line(node)
    start = line.find(f"{name}.apply(")
    call = _balanced_call(line[start:]) if start >= 0 else None
    try:
        tree = ast.parse(call, mode="eval").body if call is not None else None
    except SyntaxError:
        return None
    if not isinstance(tree, ast.Call) or tree.keywords or any(isinstance(a, ast.Starred) for a in tree.args):
        return None
    return tree


def _balanced_call(text: str) -> str | None:
    """``text`` up to the parenthesis that closes its first one (a call on one line), or None."""
    depth = 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return text[:i + 1]
    return None


def _variable_names(node_name: str) -> set[str]:
    """The source names Dynamo may have named a node after: ``x`` for ``x``, ``x_1`` and ``l_x_``."""
    names = {node_name, re.sub(r"_\d+$", "", node_name)}
    if node_name.startswith("l_") and node_name.endswith("_"):
        names.add(node_name[2:-1])
    return names


def restore_autograd_functions(gm: fx.GraphModule, owner_of: Callable[[fx.Node], nn.Module]) -> fx.GraphModule:
    """``autograd_function_apply(fwd_body, bwd_body, *inputs)`` → a call of the user's Function.

    Dynamo records a custom ``autograd.Function`` as a higher-order op over two traced graph bodies;
    those bodies are Dynamo internals (no saved form, not the user's code). Where the class can be
    found, the call becomes ``Cls.apply(*inputs)``, as an fx capture has it, so the Function's own
    forward and backward run. Only single-output Functions are rewritten (all users take ``[0]``,
    or, on older torch, the node is that one tensor).
    ``owner_of(node)`` is the module whose ``forward`` made the call: its globals resolve the name."""
    graph = gm.graph
    hop = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    for node in list(graph.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        users = list(node.users)
        # its one output taken as [0] (newer torch), or the node is that output (older torch)
        picked = all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users)
        if not users or not (picked or isinstance(node.meta.get("example_value"), torch.Tensor)):
            continue
        cls = _user_autograd_function(node, owner_of(node))
        arguments = _apply_arguments(gm, node, cls) if cls is not None else None
        if cls is None or arguments is None:
            continue
        bodies = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        with graph.inserting_before(node):
            call = graph.call_function(autograd_function_caller(cls), arguments)
        call.meta = {k: v for k, v in node.meta.items() if k != "source_fn_stack"}
        if picked:
            call.meta["example_value"] = users[0].meta.get("example_value")
            for user in users:
                user.replace_all_uses_with(call)
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(call)
        graph.erase_node(node)
        for body in bodies:
            if not body.users:
                graph.erase_node(body)
    return gm


def fold_numpy_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """Dynamo traces NumPy calls through ``torch._numpy`` wrappers (``np.sqrt(head_dim)`` in
    transformers' CTRL becomes a call to ``<Wrapped function <original sqrt>>``). On constant
    arguments the result is a constant: put the Python number back, as the user's code computed it,
    so no Dynamo-internal callable stays in the prepared graph."""
    from torch._dynamo.utils import numpy_to_tensor_wrapper

    graph = gm.graph
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
    return gm


def replace_device_literals(gm: fx.GraphModule, anchor: fx.Node | None, device: torch.device | None, *,
                            notes: list[str] | None = None) -> fx.GraphModule:
    """Turn ``torch.device`` literals equal to the inputs' device into ``anchor.device``, so the
    prepared module follows ``.to(device)`` (Dynamo bakes ``x.device`` in as a constant)."""
    if anchor is None or device is None:
        return gm
    graph = gm.graph
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
    if count and notes is not None:
        notes.append(
            f"{count} device literal(s) ({device}) baked in by Dynamo now read the device of the first "
            f"input tensor, so the prepared module follows .to(device)."
        )
    return gm

