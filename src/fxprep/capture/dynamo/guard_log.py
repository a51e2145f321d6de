"""Each guard Dynamo adds during a capture, with the user frames that made it.

:mod:`.scans` needs to know which line of the model made each guard that bounds a declared
dimension, which export's error does not say. :func:`recording` wraps the shape environment's
private ``_log_guard`` (feature-detected) for the capturing thread only and keeps each guard with
its expression, symbols and user frames; :func:`renamed` names a reused block's input sizes after
the model's inputs.

See docs/shapes.md ("Under the hood").
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...core.threads import confined
from ...reporting.diagnose import is_user_file


@dataclass(frozen=True)
class AddedGuard:
    """One guard: its expression (a sympy boolean), each free symbol's source names and example
    value, and the user frames (``(file, function, line)``, outermost first) that made it."""

    expr: Any
    sources: dict[Any, tuple[str, ...]]
    hints: dict[Any, int]
    stack: tuple[tuple[str, str, int], ...]
    # made while a block reuse stand-in computed its output on fake tensors (:func:`aside`): a guard
    # of that computation, not of the outer graph, which calls the block as one node
    aside: bool = False
    # the file of torch that made it (Dynamo's own: a decision of the model's Python code; a kernel's
    # shape logic otherwise) and the user line, as torch words it; None where torch's were not read
    framework: str | None = None
    user_loc: str = ""


@dataclass
class GuardLog:
    """The guards of the captures run inside :func:`recording`, in the order Dynamo added them."""

    guards: list[AddedGuard] = field(default_factory=list)


def _user_stack() -> tuple[tuple[str, str, int], ...]:
    from torch._guards import TracingContext

    try:
        summary = TracingContext.extract_stack()
    except Exception:  # noqa: BLE001 - no tracing context: no frames
        return ()
    out = []
    for frame in summary:
        filename = getattr(frame, "filename", None)
        if filename and is_user_file(filename):
            out.append((os.path.normcase(os.path.abspath(filename)), frame.name, int(frame.lineno or 0)))
    return tuple(out)


def _name(source: Any) -> str:
    """A source's text (``L['input_ids'].size()[1]``): a property in newer torch, a method before."""
    name = source.name
    return str(name() if callable(name) else name)


@dataclass
class _Block:
    names: dict[str, str] | None  # None: the model's own capture, its sources as they are (:func:`stopping`)
    added: GuardLog
    stop: Callable[[AddedGuard], Any] | None
    # a source name -> (its size as an expression over model input sizes, each one's (source, example value))
    derived: dict[str, tuple[Any, dict[Any, tuple[str, int]]]] = field(default_factory=dict)


_IN_BLOCK: list[_Block] = []  # the captures running on this thread, innermost last (:func:`renamed`, :func:`stopping`)
_ASIDE: list[bool] = []  # the stand-in computations running on this thread (:func:`aside`)
IN_BLOCK = "block:"  # before a block's own source name that is no model input's size
_THREADS = sys.modules[confined.__module__].__file__  # the wrapper the guard hook runs in (its frames are skipped)


class Stopped(BaseException):
    """Raised from inside Dynamo's trace when a guard it adds is one the ``stop`` of :func:`renamed` or
    :func:`stopping` names
    (a BaseException: model and Dynamo code that catches Exceptions lets it through, and cleans up
    in its ``finally`` blocks as for an interrupt). ``found``: what ``stop`` returned."""

    def __init__(self, found: Any):
        super().__init__(str(found))
        self.found = found


@contextlib.contextmanager
def renamed(names: dict[str, str], stop: Callable[[AddedGuard], Any] | None = None,
            derived: dict[str, tuple[Any, dict[Any, tuple[str, int]]]] | None = None) -> Iterator[GuardLog]:
    """Within (a repeated block's own capture), a guard's source named in ``names`` is recorded
    under the model input's name it maps to; any other is marked :data:`IN_BLOCK` and its example
    value left out, so that a block's argument named like a model input (``x``) is not taken for it,
    and no guard on a size the block alone names is evaluated at other sizes. Set by the capturing
    thread, read in the guards it adds (captures hold a global lock). Yields the guards recorded
    within (none where no :func:`recording` runs). ``stop(guard)``: asked of each guard recorded
    within; a value it returns ends the capture at once with :class:`Stopped` (the rest of a trace
    already known to be given up can take most of its time: a chunked scan's inner loops).
    ``derived``: a source whose size is made of model input sizes (``3*seq``): its symbol is written
    as that expression in each guard, over one symbol per model input size (recorded under its name)."""
    with _within(_Block(names, GuardLog(), stop, derived or {})) as added:
        yield added


@contextlib.contextmanager
def stopping(stop: Callable[[AddedGuard], Any]) -> Iterator[GuardLog]:
    """Within (the model's own capture), ``stop`` is asked of each guard as in :func:`renamed`, and the
    guards' sources are recorded as they are: they are the model's inputs already."""
    with _within(_Block(None, GuardLog(), stop)) as added:
        yield added


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """Within (a block reuse stand-in computing its output on the outer capture's fake tensors),
    guards are recorded as :attr:`AddedGuard.aside`: the outer graph calls the block as one node,
    whatever that computation decided, and the block's own capture records its guards itself
    (Dots3's indexer takes ``min(2048, seq)``: a ``seq < 2048`` guard there, none in either graph)."""
    _ASIDE.append(True)
    try:
        yield
    finally:
        _ASIDE.pop()


@contextlib.contextmanager
def _within(block: _Block) -> Iterator[GuardLog]:
    _IN_BLOCK.append(block)
    try:
        yield block.added
    finally:
        _IN_BLOCK.pop()


def example_values(env: Any) -> dict[Any, Any]:
    """Each backed symbol of the shape environment ``env`` to its value at the example:
    ``backed_var_to_val`` in newer torch, ``var_to_val`` before (now deprecated)."""
    values = getattr(env, "backed_var_to_val", None)
    return env.var_to_val if values is None else values


def _added(env: Any, expr: Any) -> AddedGuard:
    sources: dict[Any, tuple[str, ...]] = {}
    hints: dict[Any, int] = {}
    values = example_values(env)
    written: dict[Any, Any] = {}  # a block's size made of model input sizes -> that expression
    for symbol in getattr(expr, "free_symbols", ()):
        names = [_name(s) for s in env.var_to_sources.get(symbol, ())]
        renames = _IN_BLOCK[-1].names if _IN_BLOCK else None
        made = _made_of(names, renames)
        if made is not None:
            written[symbol] = made[0]
            sources.update({part: (source,) for part, (source, _) in made[1].items()})
            hints.update({part: value for part, (_, value) in made[1].items()})
            continue
        sources[symbol] = tuple(names if renames is None else (renames.get(n, f"{IN_BLOCK}{n}") for n in names))
        value = values.get(symbol)
        if renames is not None and not any(name in renames for name in names):
            # a block's size that is no declared dimension where the block is called: may be one in the
            # whole model (the length of a tuple's tensor), so no guard on it is evaluated at other sizes
            continue
        if value is not None:
            with contextlib.suppress(TypeError, ValueError):
                hints[symbol] = int(value)
    framework, user_loc = _made_where(env)
    expr = expr.xreplace(written) if written else expr
    return AddedGuard(expr, sources, hints, _user_stack(), bool(_ASIDE), framework, user_loc)


def _made_of(names: list[str], renames: dict[str, str] | None) -> tuple[Any, dict[Any, tuple[str, int]]] | None:
    """In a block's own capture, what a symbol whose sources are ``names`` (none a model input's size
    itself) is made of in model input sizes (:func:`renamed`'s ``derived``), or None."""
    if renames is None or any(name in renames for name in names):
        return None
    derived = _IN_BLOCK[-1].derived
    return next((derived[name] for name in names if name in derived), None)


def _made_where(env: Any) -> tuple[str | None, str]:
    """The file of torch that asked for the guard (the first frame outside the shape environment's
    own files and this module, as torch finds it for its own record) and the user line torch
    names; ``(None, "")`` where the shape environment's helpers are not there."""
    from torch.fx.experimental import symbolic_shapes

    try:
        skipped = symbolic_shapes.uninteresting_files() | {__file__, _THREADS}
        frame: Any = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename in skipped:
            frame = frame.f_back
        framework = frame.f_code.co_filename if frame is not None else ""
        return framework, str(env._get_sloc(framework_loc="").maybe_user_loc or "").strip()
    except Exception:  # noqa: BLE001 - another torch: the location is not read
        return None, ""


@contextlib.contextmanager
def recording() -> Iterator[GuardLog]:
    """Record each guard Dynamo adds on this thread until exit (see the module docstring)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    log = GuardLog()
    original = getattr(ShapeEnv, "_log_guard", None)
    if original is None:
        yield log
        return

    def log_guard(env: Any, prefix: str, expr: Any, *args: Any, **kwargs: Any) -> Any:
        found = None
        if "suppressed" not in str(prefix):
            with contextlib.suppress(Exception):  # recording never changes what Dynamo does (but for a stop)
                log.guards.append(_added(env, expr))
                block = _IN_BLOCK[-1] if _IN_BLOCK else None
                if block is not None:
                    block.added.guards.append(log.guards[-1])
                    found = block.stop(log.guards[-1]) if block.stop is not None else None
        if found is not None:
            raise Stopped(found)
        return original(env, prefix, expr, *args, **kwargs)

    ShapeEnv._log_guard = confined(log_guard, original)  # type: ignore[method-assign]
    try:
        yield log
    finally:
        ShapeEnv._log_guard = original  # type: ignore[method-assign]


__all__ = ["AddedGuard", "GuardLog", "Stopped", "aside", "example_values", "recording", "renamed", "stopping"]
