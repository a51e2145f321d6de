"""The code a prepared module runs: fx's own, with submodules reached through ``_modules``.

fx reaches each leaf through a chain of ``nn.Module.__getattr__`` calls, which costs several percent
of a small-op-dense forward. :func:`fast_source` rewrites each chain to look every module up once
per call through ``_modules`` (or ``getattr`` where a module is not a plain container), and module
calls skip ``nn.Module.__call__`` only where it would do nothing but call ``forward``
(:func:`call_module`, :func:`fast_calls`). Lookups stay live, so a toolkit that swaps, hooks or
wraps a module is followed. ``gm.code`` stays fx's readable text.

See docs/concepts/sharing.md ("Under the hood") for the rules and the measurements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.graph import _format_target
from torch.nn.modules import module as _module

HELPER = "_fxprep_child"
CALL_HELPER = "_fxprep_call"
FAST_HELPER = "_fxprep_fast_calls"
LOCAL = "_fxprep_"  # the locals the rewritten forward binds start with it (no node of the graph may)


def child(parent: Any, names: tuple[str, ...]) -> Any:
    """``parent.<names[0]>.<names[1]>...`` for submodules, each step a dict read where the module
    stepped from is a plain ``nn.Module``."""
    for name in names:
        parent = parent._modules[name] if type(parent) is nn.Module else getattr(parent, name)
    return parent


_MODULE_CALL = nn.Module._wrapped_call_impl  # what nn.Module.__call__ is, unless something patched it
_is_compiling = torch.compiler.is_compiling  # Dynamo folds this call to True: nothing after it is traced
_tracing_state = torch._C._get_tracing_state


def fast_calls() -> bool:
    """Whether, for the forward about to run, nothing outside the modules themselves would make
    ``nn.Module.__call__`` do more than call ``forward``: not under ``torch.compile`` or
    ``torch.export``, no tracer's patch of ``nn.Module.__call__``, no global module hook, not under
    ``torch.jit.trace``. Asked once per forward (by its first module call): none of these changes
    inside a forward."""
    return (not _is_compiling() and nn.Module.__call__ is _MODULE_CALL
            and not (_module._global_forward_pre_hooks or _module._global_forward_hooks
                     or _module._global_backward_pre_hooks or _module._global_backward_hooks)
            and not _tracing_state())


def call_module(module: Any, fast: bool, *args: Any) -> Any:
    """``module(*args)``, without ``nn.Module.__call__``'s frames where that call would do nothing but
    call ``forward`` (``fast`` from :func:`fast_calls`, and nothing on the module itself: see the
    module docstring): its ``forward``, looked up as ``nn.Module.__call__`` would (so a ``forward``
    replaced on the instance or the class is the one called)."""
    if (fast and type(module).__call__ is _MODULE_CALL and module._compiled_call_impl is None
            and not (module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                     or module._backward_hooks)):
        return module.forward(*args)
    return module(*args)


class _Writer:
    """The expressions of one rewritten forward. Each module a node's target is reached through is
    looked up once per call: the first line under it binds it to a local (``(_fxprep_m3 := ...)``),
    later lines step from that local; the first module call binds ``_fxprep_fast`` (:func:`fast_calls`).
    fx's code is straight-line, nodes in order, so a local is bound on a line before every line
    using it (an expression is asked for only once its line is known to be rewritten)."""

    def __init__(self) -> None:
        self.bound: dict[tuple[str, ...], str] = {}
        self.fast = False

    def module(self, path: tuple[str, ...]) -> str:
        if path in self.bound:
            return self.bound[path]
        if len(path) == 1:
            return f"self._modules[{path[0]!r}]"
        parent = path[:-1]
        name = self.bound.get(parent)
        if name is not None:
            return f"{HELPER}({name}, {path[-1:]!r})"
        inner = self.module(parent)
        name = self.bound[parent] = f"{LOCAL}m{len(self.bound)}"
        return f"{HELPER}(({name} := {inner}), {path[-1:]!r})"

    def fast_flag(self) -> str:
        if self.fast:
            return f"{LOCAL}fast"
        self.fast = True
        return f"({LOCAL}fast := {FAST_HELPER}())"


def _resolve(root: nn.Module, path: list[str], step: Any) -> Any:
    current: Any = root
    for name in path:
        try:
            current = step(current, name)
        except (AttributeError, KeyError):
            return None
    return current


def _fast_target(root: fx.GraphModule, node: fx.Node) -> tuple[tuple[str, ...], str | None, bool] | None:
    """For a node whose target the rewritten code can reach: the module path, the attribute read from
    it (a ``get_attr``; None for a ``call_module``) and whether the call is made by
    :func:`call_module` (a call with positional arguments only). ``None`` keeps fx's expression."""
    path = str(node.target).split(".")
    modules = path if node.op == "call_module" else path[:-1]
    if not modules or hasattr(type(root), modules[0]) or any(hasattr(nn.Module, n) for n in modules[1:]):
        return None

    def fast_step(parent: Any, name: str) -> Any:
        return parent._modules[name] if parent is root else child(parent, (name,))

    found = _resolve(root, modules, fast_step)
    if found is None or found is not _resolve(root, modules, getattr):
        return None
    if node.op == "call_module":
        return tuple(modules), None, not node.kwargs
    return tuple(modules), path[-1], False


def fast_source(gm: fx.GraphModule, code: str) -> str:
    """``code`` (fx's source for ``gm``) with module chains read through ``_modules``.

    Each node's line is found by its name (fx starts it with ``<name> = ``) and only the target
    expression right after that is replaced; a line that does not read as expected is left alone."""
    if any(node.name.startswith(LOCAL) for node in gm.graph.nodes):
        return code  # a node named like the locals the rewrite binds: fx's code as it is
    lines = code.split("\n")
    where: dict[str, int] = {}
    for i, line in enumerate(lines):
        head = line.lstrip().split(" ", 1)[0]
        where.setdefault(head, i)
    writer = _Writer()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or not isinstance(node.target, str):
            continue
        row = where.get(node.name)
        if row is None:
            continue
        target = _fast_target(gm, node)
        if target is None:
            continue
        modules, attribute, call = target
        old = " = " + _format_target("self", node.target)
        line = lines[row]
        at = line.find(old)
        end = at + len(old)
        follows = line[end:end + 1]
        if at < 0 or (follows != "(" if node.op == "call_module" else follows not in ("", ";")):
            continue
        new = writer.module(modules)
        if attribute is not None:
            new = _format_target(new, attribute)
        elif call:  # "x = _fxprep_call(<module>, <fast>, a, b)": the call's "(" taken over
            new, end = f"{CALL_HELPER}({new}, {writer.fast_flag()}, ", end + 1
        lines[row] = line[:at] + " = " + new + line[end:]
    return "\n".join(lines)
