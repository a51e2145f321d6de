"""Where in the user's model a Dynamo failure happened: from Dynamo's user stack to live objects.

Dynamo reports a failure with the user frames it was tracing (``err.real_stack``: file, line and
function name of each), but not with the objects running them: the stack says
``PixtralAttention.forward`` failed, not *which* attention. The eager model knows: :func:`locate`
runs it once on the captured inputs with a trace hook (``sys.settrace``, frame entries only) and stops at every call
of the failing function whose callers are the frames of Dynamo's stack, call line for call line.
Each such call gives the live frames (their ``self`` objects), from which
:func:`~fxprep.capture.sites.sites_from_frames` reads the opaque sites. Dynamo traces in program
order, so the first matching call is the one it failed in; the later ones are the other instances
reaching the same code through the same path (the next layers of a stack of identical blocks),
which would fail the same way.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...diagnose import is_user_file
from ...inputs import ExampleInputs
from ...runs import SEED, preserved_state
from ..sites import FrameRecord, Site, sites_from_frames
from .opaque import OPAQUE_PREFIX

MAX_MATCHES = 256


def user_stack(err: BaseException) -> list[tuple[str, str, int]]:
    """Dynamo's user frames for ``err`` as ``(file, function, line)``, outermost first, without the
    frames of torch, the standard library and fxprep."""
    stack = getattr(err, "real_stack", None)
    if not stack and err.__context__ is not None:
        stack = getattr(err.__context__, "real_stack", None)
    out = []
    for summary in stack or []:
        filename = getattr(summary, "filename", None)
        if filename and is_user_file(filename):
            out.append((_norm(filename), summary.name, int(summary.lineno or 0)))
    return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def origin_stack(err: BaseException) -> list[tuple[str, str, int]]:
    """For a guard on a data-dependent size (``Eq(u2*u3, 24)``): the user frames where the first of
    its unbacked symbols was *created* (the ``.item()``, ``.tolist()`` or tensor-valued slice), which
    is what must be opaque; the guard itself may fail much later, or with no user frame at all.
    Empty when unknown, or when the symbols came out of an opaque part (:mod:`.opaque`)."""
    cause: BaseException | None = err
    while cause is not None and getattr(cause, "cond", None) is None:
        cause = cause.__context__ or cause.__cause__
    cond = getattr(cause, "cond", None)
    output = getattr(err, "_torch_dynamo_tracer_output", None)  # private: feature-detected
    graph_out = getattr(output, "output_graph", None) or getattr(output, "output_graph_for_cleanup", None)
    graph = getattr(graph_out, "graph", None)
    symbols = getattr(cond, "free_symbols", None)
    if not symbols or graph is None:
        return []
    for node in graph.nodes:
        bindings = node.meta.get("unbacked_bindings") or {}
        if not any(sym in symbols for sym in bindings):
            continue
        if node.op == "call_function" and getattr(node.target, "__name__", "").startswith(OPAQUE_PREFIX):
            return []
        frames = [(_norm(f), name, int(line)) for f, line, name in _FRAME.findall(node.meta.get("stack_trace") or "")]
        return [f for f in frames if is_user_file(f[0])]
    return []


def _norm(filename: str) -> str:
    return os.path.normcase(os.path.abspath(filename))


@dataclass
class Located:
    """The frames of each eager call on the failing path, the first being the one Dynamo failed in."""

    chains: list[list[FrameRecord]]
    exact: bool  # matched call line for call line (False: by function names only)

    def sites(self, model: nn.Module) -> list[tuple[Site, list[Site]]]:
        """The candidate sites, innermost first, each with the same site in the other matching
        calls (other instances of the same class reached the same way)."""
        first = sites_from_frames(self.chains[0], model)
        others = [sites_from_frames(chain, model) for chain in self.chains[1:]]
        out = []
        for k, site in enumerate(first):
            same: list[Site] = []
            if site.func is None:  # a function site is patched where it is looked up: every call
                kind = type(site.owner(model))
                for sites in others:
                    other = sites[k] if len(sites) == len(first) else None
                    if other is not None and other != site and other not in same and other.func is None \
                            and other.method == site.method and type(other.owner(model)) is kind:
                        same.append(other)
            out.append((site, same))
        return out


def _chain_matches(chain: list[tuple[str, str, int]], stack: list[tuple[str, str, int]], exact: bool) -> bool:
    """Whether the user frames of an eager call end with Dynamo's user stack (the eager chain also
    holds the frames of whoever called the model)."""
    if len(chain) < len(stack):
        return False
    tail = chain[len(chain) - len(stack):]
    for k, ((f1, n1, l1), (f2, n2, l2)) in enumerate(zip(tail, stack)):
        if f1 != f2 or n1 != n2:
            return False
        if exact and k < len(stack) - 1 and l1 != l2:
            return False
    return True


def locate(stack: list[tuple[str, str, int]], model: nn.Module, call: ExampleInputs) -> Located | None:
    """The live frames of the eager calls on the path of ``stack`` (Dynamo's user frames,
    :func:`user_stack` or :func:`origin_stack`), or None when the eager run never takes that path."""
    if not stack:
        return None
    target_file, target_name, _ = stack[-1]
    candidates: list[tuple[list[tuple[str, str, int]], list[FrameRecord]]] = []
    previous = sys.gettrace()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        # a global trace function is called once per new Python frame (a profile function would
        # also be called for every C call and return: several times slower on a detector's forward);
        # whoever traced before (a debugger, coverage) keeps tracing
        local = previous(frame, event, arg) if previous is not None else None
        if event != "call" or len(candidates) >= MAX_MATCHES:
            return local
        code = frame.f_code
        if code.co_name != target_name or _norm(code.co_filename) != target_file:
            return local
        frames = []
        f = frame
        while f is not None:
            if is_user_file(f.f_code.co_filename):
                frames.append(f)
            f = f.f_back
        frames.reverse()
        described = [(_norm(f.f_code.co_filename), f.f_code.co_name, f.f_lineno) for f in frames]
        if _chain_matches(described, stack, exact=False):
            records = [FrameRecord.of(f) for f in frames[len(frames) - len(stack):]]
            candidates.append((described, records))
        return local

    fresh = call.fresh_copy()
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            sys.settrace(trace)
            try:
                model(*fresh.args, **fresh.kwargs)
            finally:
                sys.settrace(previous)
    except Exception:  # noqa: BLE001 - the calls seen before an eager failure still locate it
        pass
    if not candidates:
        return None
    exact = [records for described, records in candidates if _chain_matches(described, stack, exact=True)]
    if exact:
        return Located(exact, True)
    return Located([records for _, records in candidates], False)


__all__ = ["Located", "locate", "origin_stack", "user_stack"]
