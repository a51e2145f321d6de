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

``gm.code`` (what ``print(gm)`` shows, what :func:`fxprep.save` writes for reading) stays fx's
readable text; only the compiled ``forward`` uses the rewritten one, with the same lines in the same
places, so tracebacks and fx's line map still point at the right node.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn
from torch.fx.graph import _format_target

HELPER = "_fxprep_child"


def child(parent: Any, names: tuple[str, ...]) -> Any:
    """``parent.<names[0]>.<names[1]>...`` for submodules, each step a dict read where the module
    stepped from is a plain ``nn.Module``."""
    for name in names:
        parent = parent._modules[name] if type(parent) is nn.Module else getattr(parent, name)
    return parent


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


def _fast_target(root: fx.GraphModule, node: fx.Node) -> str | None:
    """The rewritten expression for ``node``'s target, or ``None`` to keep fx's."""
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
        return _chain(modules)
    return _format_target(_chain(modules), path[-1])


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
        new = _fast_target(gm, node) if i is not None else None
        if new is None:
            continue
        old = " = " + _format_target("self", node.target)
        line = lines[i]
        at = line.find(old)
        end = at + len(old)
        follows = line[end:end + 1]
        if at < 0 or (follows != "(" if node.op == "call_module" else follows not in ("", ";")):
            continue
        lines[i] = line[:at] + " = " + new + line[end:]
    return "\n".join(lines)
