"""Hooks registered on the model itself (not on one of its layers): run around the graph, not in it.

Left on the model during capture they stop Dynamo's export (a pre-forward hook taking keyword
arguments) or make verification compare a hooked original with an unhooked graph, so
:func:`set_aside` takes them off for the length of ``prepare_model`` (the user's handles stay
valid) and :func:`carry` registers the same callables, in the same order, on the prepared module.
Global module hooks are set aside too, process-wide, under the capture lock.
See docs/concepts/capture.md, "Hooks on the model itself".
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from ..core.runs import FORWARD_HOOK_DICTS
from ..reporting.report import Report

GM = TypeVar("GM", bound=nn.Module)

_GLOBAL = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
           "_global_forward_pre_hooks")


@dataclass
class RootHooks:
    """The model's own hooks, as found when ``prepare_model`` started."""

    dicts: dict[str, Any] = field(default_factory=dict)  # forward-side hook dicts, by attribute name
    backward: list[tuple[str, Any]] = field(default_factory=list)  # ("full" / "pre" / "legacy", hook)
    global_count: int = 0  # global module forward hooks set aside

    def count(self) -> int:
        return len(self.dicts.get("_forward_hooks", ())) + len(self.dicts.get("_forward_pre_hooks", ())) \
            + len(self.backward)


@contextlib.contextmanager
def set_aside(model: nn.Module) -> Iterator[RootHooks]:
    """Within, ``model`` has no forward or pre-forward hooks of its own and no global module forward
    hook is registered; on exit the very dicts are back (a handle the user holds still removes its
    hook)."""
    with _globals_set_aside() as count, _own_set_aside(model) as found:
        found.global_count = count
        yield found


@contextlib.contextmanager
def _globals_set_aside() -> Iterator[int]:
    from torch.nn.modules import module as torch_module

    names = [n for n in _GLOBAL if isinstance(getattr(torch_module, n, None), dict)]
    count = len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)
    if not count:
        yield 0
        return
    saved = {n: getattr(torch_module, n) for n in names}
    for name in names:
        setattr(torch_module, name, collections.OrderedDict())
    try:
        yield count
    finally:
        for name, hooks in saved.items():
            setattr(torch_module, name, hooks)


@contextlib.contextmanager
def _own_set_aside(model: nn.Module) -> Iterator[RootHooks]:
    found = RootHooks()
    if not isinstance(model, nn.Module) or not (model._forward_hooks or model._forward_pre_hooks
                                                or model._backward_hooks or model._backward_pre_hooks):
        yield found
        return
    for hook in model._backward_pre_hooks.values():
        found.backward.append(("pre", hook))
    for hook in model._backward_hooks.values():
        found.backward.append(("full" if model._is_full_backward_hook else "legacy", hook))
    for name in FORWARD_HOOK_DICTS:
        found.dicts[name] = model.__dict__[name]
        model.__dict__[name] = collections.OrderedDict()
    try:
        yield found
    finally:
        for name, hooks in found.dicts.items():
            model.__dict__[name] = hooks


def carry(gm: GM, hooks: RootHooks, report: Report) -> GM:
    """``gm`` with ``hooks`` registered as they were on the model, said in ``report``."""
    if hooks.global_count:
        report.note(f"{hooks.global_count} global module hook(s) (register_module_forward_hook) were set aside "
                    f"while preparing (they stop Dynamo's capture); they apply to the prepared module's calls "
                    f"as to any module's.")
    if not hooks.count():
        return gm
    pre, pre_kwargs = hooks.dicts["_forward_pre_hooks"], hooks.dicts["_forward_pre_hooks_with_kwargs"]
    for key, hook in pre.items():
        gm.register_forward_pre_hook(hook, with_kwargs=key in pre_kwargs)
    post = hooks.dicts["_forward_hooks"]
    post_kwargs, always = hooks.dicts["_forward_hooks_with_kwargs"], hooks.dicts["_forward_hooks_always_called"]
    for key, hook in post.items():
        gm.register_forward_hook(hook, with_kwargs=key in post_kwargs, always_call=key in always)
    legacy = 0
    for kind, hook in hooks.backward:
        if kind == "pre":
            gm.register_full_backward_pre_hook(hook)
        elif kind == "full":
            gm.register_full_backward_hook(hook)
        else:
            legacy += 1
    kinds = [f"{len(pre)} pre-forward"] if pre else []
    kinds += [f"{len(post)} forward"] if post else []
    kinds += [f"{len(hooks.backward) - legacy} backward"] if len(hooks.backward) > legacy else []
    note = (f"The model's own hooks ({', '.join(kinds)}) run around its forward, not in it: they were set "
            f"aside for the capture and verification and are registered on the prepared module, which runs "
            f"them as the model does (a module with hooks has no saved form: fxprep.save refuses it).")
    if kinds:
        report.note(note)
    if legacy:
        report.note(f"The model's {legacy} backward hook(s) registered with the deprecated register_backward_hook "
                    f"were not carried to the prepared module; register them with register_full_backward_hook.")
    return gm
