"""The code a prepared module runs: fx's own, with submodules reached through ``_modules``.

fx writes a call to ``layer1.0.conv1`` as ``getattr(self.layer1, "0").conv1(x)``. Every step of
that chain is an ``nn.Module.__getattr__`` call (the child is not in the instance ``__dict__``, so
Python's own lookup fails first, then torch's fallback runs in Python): ~1.3 us a step on torch
2.14. A prepared graph reaches every leaf from the root, three to five steps deep, where the eager
model reaches most of them one step from its own ``self``: on small-op-dense models
(mobilenet_v3_small, a small Llama) the chains alone cost 7-13% of the forward.

:func:`fast_source` rewrites each chain as ``_fxprep_child(self._modules['layer1'], ('0', 'conv1'))``
(one call per chain, each step as follows):

* a step from a plain ``nn.Module`` (the containers ``GraphModule`` builds for the paths of its
  targets) is a dict read of its ``_modules``: for that class, ``getattr`` gives nothing else
  (names that are attributes of ``nn.Module`` itself, ``eval`` say, keep fx's chain);
* a step from anything else (a user's module, or a wrapper a toolkit put in a container's place:
  AIMET's ONNX markers forward ``__getattr__`` to the module they wrap) is ``getattr``, as fx has it.

So the lookup is decided at each call, never cached, and stays live: every way of replacing a
submodule (``setattr``, ``add_module``, torch.ao's ``parent._modules[name] = new``) writes
``_modules``, and a toolkit that swaps a leaf gets its new module called. The last step of a
``get_attr`` (a parameter, buffer or constant) stays an ordinary attribute access, so symbolic
tracers that hook parameter access still see it. A chain is rewritten only if it resolves to the
object fx's chain gives at compile time.

A call of one of fxprep's op modules (:class:`~fxprep.ops.BoundOp`: ``add``, ``matmul``, ``sdpa``,
an LLM graph has ~27 a layer) is written ``_fxprep_op(<chain>, a, b)``: where ``nn.Module.__call__``
would do nothing but call ``forward`` (no hooks of any kind, no module-level or global patch of
``__call__``, no ``forward`` replaced on the instance or class, not compiled, not under
``torch.compile``/``torch.export``, a symbolic tracer or ``torch.jit.trace``),
:func:`call_op` calls the op's bound call directly, skipping the three Python frames of
``_wrapped_call_impl``/``_call_impl``/``forward``: ~0.5 us a call, ~3% of a launch-bound forward
(an 8-layer Llama, bf16, 16 tokens, on a 2-core CPU with torch 2.11 and 2.14). Each of those conditions is checked at every
call, so a toolkit that hooks, wraps or swaps an op module (AIMET's QuantSim, torch.ao's observers,
NNCF's pre-hooks, fx and Dynamo re-tracing) gets ``module(*args)`` exactly as fx's code has it.

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

from fxprep.ops import BoundOp

HELPER = "_fxprep_child"
OP_HELPER = "_fxprep_op"


def child(parent: Any, names: tuple[str, ...]) -> Any:
    """``parent.<names[0]>.<names[1]>...`` for submodules, each step a dict read where the module
    stepped from is a plain ``nn.Module``."""
    for name in names:
        parent = parent._modules[name] if type(parent) is nn.Module else getattr(parent, name)
    return parent


_MODULE_CALL = nn.Module._wrapped_call_impl  # what nn.Module.__call__ is, unless something patched it
_BOUND_FORWARD = BoundOp.forward
_GLOBAL_HOOKS = (_module._global_forward_pre_hooks, _module._global_forward_hooks,
                 _module._global_backward_pre_hooks, _module._global_backward_hooks)
_is_compiling = torch.compiler.is_compiling  # Dynamo folds this call to True: nothing after it is traced
_tracing_state = torch._C._get_tracing_state


def call_op(module: Any, *args: Any) -> Any:
    """``module(*args)`` for an op module: its bound call directly where ``nn.Module.__call__`` would
    call nothing but its ``forward`` (see the module docstring); ``module(*args)`` otherwise."""
    # isinstance first: a class attribute read can run code (a ScriptModule's forward raises)
    if (not _is_compiling() and isinstance(module, BoundOp) and type(module).forward is _BOUND_FORWARD
            and type(module).__call__ is _MODULE_CALL
            and module._compiled_call_impl is None and "forward" not in module.__dict__
            and not (module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                     or module._backward_hooks or any(_GLOBAL_HOOKS))
            and not _tracing_state()):
        return module._call(args)
    return module(*args)


def _is_op(node: fx.Node, module: Any) -> bool:
    """Whether ``node`` calls an op module with positional arguments only (its call is
    :func:`call_op`'s)."""
    return (node.op == "call_module" and not node.kwargs and isinstance(module, BoundOp)
            and type(module).forward is _BOUND_FORWARD)


def _chain(path: list[str]) -> str:
    # one call with a constant tuple: the forward of an 80-layer LLM compiles ~1.5x faster than
    # with a call per step, and runs no slower
    head = f"self._modules[{path[0]!r}]"
    return f"{HELPER}({head}, {tuple(path[1:])!r})" if len(path) > 1 else head


def _resolve(root: nn.Module, path: list[str], step: Any) -> Any:
    current: Any = root
    for name in path:
        try:
            current = step(current, name)
        except (AttributeError, KeyError):
            return None
    return current


def _fast_target(root: fx.GraphModule, node: fx.Node) -> tuple[str, bool] | None:
    """The rewritten expression for ``node``'s target and whether it is an op module's (called by
    :func:`call_op`), or ``None`` to keep fx's."""
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
        return _chain(modules), _is_op(node, found)
    return _format_target(_chain(modules), path[-1]), False


def fast_source(gm: fx.GraphModule, code: str) -> str:
    """``code`` (fx's source for ``gm``) with module chains read through ``_modules``.

    Each node's line is found by its name (fx starts it with ``<name> = ``) and only the target
    expression right after that is replaced; a line that does not read as expected is left alone."""
    lines = code.split("\n")
    where: dict[str, int] = {}
    for i, line in enumerate(lines):
        head = line.lstrip().split(" ", 1)[0]
        where.setdefault(head, i)
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or not isinstance(node.target, str):
            continue
        i = where.get(node.name)
        target = _fast_target(gm, node) if i is not None else None
        if target is None:
            continue
        new, op = target
        old = " = " + _format_target("self", node.target)
        line = lines[i]
        at = line.find(old)
        end = at + len(old)
        follows = line[end:end + 1]
        if at < 0 or (follows != "(" if node.op == "call_module" else follows not in ("", ";")):
            continue
        # an op's call: "x = _fxprep_op(<chain>, a, b)" (its "(" taken over; no arguments leaves "(<chain>, )")
        lines[i] = line[:at] + " = " + (f"{OP_HELPER}({new}, " + line[end + 1:] if op else new + line[end:])
    return "\n".join(lines)
