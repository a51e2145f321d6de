"""The code a prepared module runs: fx's own, with submodules reached through ``_modules``.

fx writes a call to ``layer1.0.conv1`` as ``getattr(self.layer1, "0").conv1(x)``. Every step of
that chain is an ``nn.Module.__getattr__`` call (the child is not in the instance ``__dict__``, so
Python's own lookup fails first, then torch's fallback runs in Python): ~1.3 us a step on torch
2.14. A prepared graph reaches every leaf from the root, three to five steps deep, where the eager
model reaches most of them one step from its own ``self``: on small-op-dense models
(mobilenet_v3_small, a small Llama) the chains alone cost 7-13% of the forward.

:func:`fast_source` rewrites each chain as ``_fxprep_child(_fxprep_m1, ('conv1',))``: each module
on the way is looked up once per call, by the first line under it, which binds it to a local
(``_fxprep_child((_fxprep_m1 := _fxprep_child((_fxprep_m0 := self._modules['layer1']), ('0',))),
('conv1',))``); every later line steps once from that local (fx's code is straight-line, so the
binding line runs first). Each step:

* from a plain ``nn.Module`` (the containers ``GraphModule`` builds for the paths of its targets) is
  a dict read of its ``_modules``: for that class, ``getattr`` gives nothing else (names that are
  attributes of ``nn.Module`` itself, ``eval`` say, keep fx's chain);
* from anything else (a user's module, or a wrapper a toolkit put in a container's place: AIMET's
  ONNX markers forward ``__getattr__`` to the module they wrap) is ``getattr``, as fx has it.

So the lookup is decided at each call, never cached across calls, and stays live: every way of
replacing a submodule (``setattr``, ``add_module``, torch.ao's ``parent._modules[name] = new``)
writes ``_modules``, and a toolkit that swaps a module gets the new one called from the next call
on. The last step of a ``get_attr`` (a parameter, buffer or constant) stays an ordinary attribute
access, so symbolic tracers that hook parameter access still see it. A chain is rewritten only if it
resolves to the object fx's chain gives at compile time; a graph with a node named like the
rewrite's locals (``_fxprep_...``) keeps fx's code.

A module call with positional arguments (every leaf, and fxprep's op modules: ``add``, ``matmul``,
``sdpa``, ~27 a Llama layer) is written ``_fxprep_call(<module>, _fxprep_fast, a, b)``: where
``nn.Module.__call__`` would do nothing but call ``forward``, :func:`call_module` calls ``forward``
itself, skipping ``_wrapped_call_impl``/``_call_impl``. What could make that call do more is
checked: per forward, once, by :func:`fast_calls` (``torch.compile``/``torch.export``, a tracer's
patch of ``nn.Module.__call__``, global module hooks, ``torch.jit.trace``); per call, on the module
(its hooks, ``__call__`` replaced on its class, ``Module.compile()``; a ``forward`` replaced on its
class or instance is the one called). So a toolkit that hooks, wraps or swaps a module (AIMET's QuantSim, torch.ao's observers, NNCF's
pre-hooks, fx and Dynamo re-tracing) gets ``module(*args)`` exactly as fx's code has it.

Measured (an 8-layer Llama, hidden 64, bf16, 16 tokens, one thread of a 2-core CPU, 200 alternating
rounds, transformers' CPU-only CUDA-capture probe taken out of eager): the prepared forward went
from 1.02x-1.045x eager to 0.93x-0.98x, on torch 2.11 and 2.14 (``benchmarks/README.md``).

``gm.code`` (what ``print(gm)`` shows, what :func:`fxprep.save` writes for reading) stays fx's
readable text; only the compiled ``forward`` uses the rewritten one, with the same lines in the same
places, so tracebacks and fx's line map still point at the right node.
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
