"""A per-step loop kept out of the graph, so that the length it loops over stays dynamic.

A state-space or linear-attention layer's Python scan (``for t in range(seq_len)``) is unrolled by
Dynamo, which specialises or bounds the length, yet it holds no layer. :func:`find` reads the guards
that limit a declared dimension (:mod:`.guard_log`), locates the smallest non-``forward`` site
around them, and keeps it only where it hides no layer or parameter (:func:`hidden_inside`); the
capture is then retried with those scans opaque.

See docs/shapes.md ("Under the hood") for the models, the rules and how the result is verified.
"""

from __future__ import annotations

import dataclasses
import linecache
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...core.inputs import ExampleInputs
from ...core.runs import SEED, preserved_state
from ..shapes.dims import SIZE_SOURCE
from ..sites import Site
from .guard_log import AddedGuard, GuardLog
from .guard_read import bound
from .locate import Located, locate, resolve
from .recording import patched, real_callable

MAX_LOCATED = 4  # stacks matched to live objects per finding (each may cost one eager run)
_POWERS = [n for k in range(2, 11) for n in (2**k, 2**k + 1)]  # 4, 5, 8, 9 ... 1024, 1025: chunk sizes


@dataclass(frozen=True)
class Scan:
    """A site kept opaque so that ``symbol`` stays dynamic: ``guard`` (readable) is what its code
    put on it, at ``where``; ``past`` a size above the example's at which that guard fails."""

    site: Site
    symbol: str
    guard: str
    where: str
    past: int
    others: tuple[Site, ...] = ()  # the same method of the other instances of its module's class
    # a limiting guard inside it was made by a branch on the size (Mamba2's `if pad_size > 0`, or
    # transformers' sliding-window mask, which returns None below the window)
    branched: bool = False
    # the functions ``site`` (a function) calls on the way to the guard, outermost first, then the module
    # calling it: taken in its place, the first that hides nothing, where it hides something (:func:`usable`)
    inner: tuple[Site, ...] = ()

    @property
    def sites(self) -> tuple[Site, ...]:
        """Every site this scan makes opaque (a function is patched where its callers look it up:
        one site takes every call; a method is patched per instance)."""
        return (self.site, *self.others)

    def note(self, checked: bool) -> str:
        """The report's sentence on this scan (``checked``: the prepared module was verified at
        :attr:`past` or beyond)."""
        at = (f"; the prepared module was also checked at {self.symbol} {self.past}, where that guard fails" if checked
              else "")
        return (f"Shape-general: {self.site.qualname} runs eagerly, as one opaque call, so that '{self.symbol}' stays "
                f"dynamic: traced, its code ties the graph to the example's size ({self.guard} at {self.where}). It "
                f"computes with no layer and with no parameter it is not given, so the layers around it stay "
                f"modules{at}. Pass dynamic=False to trace it at the example's size instead.")


def _declared(guard: AddedGuard, dynamic: dict[str, dict[int, str]]) -> dict[Any, str]:
    """Each free symbol of ``guard`` that is a declared dimension, with its declared name."""
    out = {}
    for symbol, sources in guard.sources.items():
        for source in sources:
            m = SIZE_SOURCE.fullmatch(source)
            sym = dynamic.get(m.group(1), {}).get(int(m.group(2))) if m else None
            if sym is not None:
                out[symbol] = sym
                break
    return out


def _sizes_above(size: int) -> list[int]:
    return sorted({n for n in (size + 1, size + 2, size + 3, 2 * size, 2 * size + 1, *_POWERS) if n > size})


def failing_size(guard: AddedGuard, symbols: set[Any], size: int) -> int | None:
    """The smallest size above ``size`` (of those tried: the next few, twice it, and powers of two and one
    past each, up to 1025) at which ``guard`` fails with each of ``symbols`` (Dynamo's symbols of one
    declared dimension: with ``Dim.AUTO`` each input has its own, tied by equality guards) at that
    size and its other symbols at their example values; None when it holds at all of them or
    cannot be evaluated."""
    import sympy

    others = {s: sympy.Integer(v) for s, v in guard.hints.items() if s not in symbols}
    if len(others) + len(symbols & set(guard.sources)) != len(guard.sources):
        return None  # a symbol without an example value (unbacked): not evaluated
    for n in _sizes_above(size):
        try:
            value = guard.expr.xreplace({**others, **{s: sympy.Integer(n) for s in symbols}})
        except Exception:  # noqa: BLE001 - an expression sympy cannot rebuild: not evaluated
            return None
        if value is sympy.false:
            return n
        if value is not sympy.true:
            return None
    return None


def _readable(guard: AddedGuard, names: dict[Any, str]) -> str:
    """The guard as Python (``seq == 8``), its declared symbols by their names."""
    import sympy

    expr = guard.expr.xreplace({s: sympy.Symbol(n, integer=True, positive=True) for s, n in names.items()})
    try:
        from torch.utils._sympy.printers import PythonPrinter

        text = PythonPrinter().doprint(expr)
    except Exception:  # noqa: BLE001 - a torch without that printer: sympy's own text
        text = str(expr)
    return text[:160]


def _where(stack: tuple[tuple[str, str, int], ...]) -> str:
    file, name, line = stack[-1]
    code = linecache.getline(file, line).strip()
    return f"{file}:{line} in {name}" + (f" ({code[:100]})" if code else "")


def _scan_site(located: Located | None, model: nn.Module) -> tuple[Site, tuple[Site, ...]] | None:
    """The innermost site on the guard's path when it is a function or a helper method (not a
    module's ``forward``: that would hide the module's layers): for a function, the one the
    innermost method calls, with the functions it calls on the way (outermost first: they stand in
    for it where it hides a layer or a parameter, Mamba-2's ``mamba2_scan_forward`` reading the
    layer's ``A_log`` around its ``mamba2_chunk_scan``), and last the module that calls them: a
    function its caller holds in a ``functools.partial`` (xLSTM's backend) is not looked up where a
    patch would take its calls, and a module calling it that hides nothing (:func:`usable`) may stand in."""
    if located is None:
        return None
    sites = [site for site, _ in located.sites(model, nested=True)]
    functions = []
    for site in sites:
        if site.func is None:
            break
        functions.append(site)
    if functions:
        outermost, *inner = reversed(functions)
        caller = sites[len(functions):len(functions) + 1]
        return outermost, (*inner, *(site for site in caller if site.is_module))
    if not sites:
        return None
    site = sites[0]
    return None if site.is_module else (site, ())


def _limiting(log: GuardLog, symbols: set[str], dynamic: dict[str, dict[int, str]], sizes: dict[str, int]
              ) -> list[tuple[AddedGuard, str, dict[Any, str], int]]:
    """The guards in ``log`` (with user frames) that fail above the example's size of one of the declared
    ``symbols``: ``(guard, declared symbol, its symbols' declared names, the size where it fails)`` each."""
    out = []
    seen: set[tuple[str, tuple[tuple[str, str, int], ...]]] = set()
    for guard in log.guards:
        key = (str(guard.expr), guard.stack)
        if not guard.stack or key in seen:
            continue
        seen.add(key)
        names = _declared(guard, dynamic)
        for sym in dict.fromkeys(names.values()):
            if sym in symbols and sym in sizes:
                past = failing_size(guard, {s for s, n in names.items() if n == sym}, sizes[sym])
                if past is not None:
                    out.append((guard, sym, names, past))
                    break
    return out


def find(log: GuardLog, symbols: set[str], proposal: Any, model: nn.Module, call: ExampleInputs,
         taken: list[Site]) -> list[Scan]:
    """The scans behind the guards in ``log`` that limit the declared ``symbols`` of ``proposal`` (an
    :class:`~..shapes.autodims.Proposal` captured on ``call``), not already ``taken``; see the
    module docstring. Each site is taken once, with the first guard found in it. A site holding a
    limiting guard made by a branch (an ``if``, ``while`` or ``assert`` on the size) is marked
    :attr:`Scan.branched`: :func:`usable` takes it only where it returns tensors alone."""
    limiting = _limiting(log, symbols, proposal.dynamic, proposal.sizes(model, proposal.capture_example))
    found: list[Scan] = []
    located: dict[tuple[tuple[str, str, int], ...], tuple[Site, tuple[Site, ...]] | None] = {}
    for guard, sym, names, past in limiting:
        frames = {(f, n) for f, n, _ in guard.stack}
        if any(_within(scan, frames) for scan in found):
            continue  # inside a scan already found
        if guard.stack not in located:
            if len(located) >= MAX_LOCATED:
                break
            stack = list(guard.stack)
            located[guard.stack] = _scan_site(resolve(stack, model) or locate(stack, model, call), model)
        at = located[guard.stack]
        site, inner = at if at is not None else (None, ())
        if site is not None and _fixed_bound(guard, site):
            continue
        if site is not None and site not in taken and all(site not in s.sites for s in found):
            found.append(Scan(site, sym, _readable(guard, names), _where(guard.stack), past, _others(site, model),
                              inner=tuple(s for s in inner if s not in taken)))
    branches = [guard for guard, *_ in limiting if on_branch(*guard.stack[-1][::2])]
    return [dataclasses.replace(scan, branched=True)
            if any(_within(scan, {(f, n) for f, n, _ in guard.stack}) for guard in branches) else scan
            for scan in found]


_SPANS: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}


def _spans(file: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The line spans of ``file``'s branch conditions (``if``, ``elif``, ``while``, ``assert``, a
    conditional expression or a comprehension's ``if``) and of its loops (a ``for`` or ``while``
    statement, header and body, or a comprehension), read from its syntax tree once."""
    import ast

    if file not in _SPANS:
        branches: list[tuple[int, int]] = []
        loops: list[tuple[int, int]] = []
        try:
            with open(file, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            tests = [node.test] if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) else []
            tests += list(node.ifs) if isinstance(node, ast.comprehension) else []
            branches += [(t.lineno, t.end_lineno or t.lineno) for t in tests]
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp,
                                 ast.GeneratorExp)):
                loops.append((node.lineno, node.end_lineno or node.lineno))
        _SPANS[file] = (branches, loops)
    return _SPANS[file]


def on_branch(file: str, line: int) -> bool:
    """Whether ``file:line`` is in the condition of an ``if``, ``elif``, ``while``, ``assert`` or
    conditional expression (False where the file cannot be read)."""
    return any(low <= line <= high for low, high in _spans(file)[0])


def _in_loop(file: str, line: int) -> bool:
    """Whether ``file:line`` is in a loop: a ``for`` or ``while`` statement, or a comprehension."""
    return any(low <= line <= high for low, high in _spans(file)[1])


def _fixed_bound(guard: AddedGuard, site: Site) -> bool:
    """Whether ``guard`` bounds one dimension (a range, :func:`.guard_read.bound`) where no loop and
    no branch of the code from ``site`` inward made it: the end of a table of fixed size (ProphetNet's
    relative-position buckets sliced to the length: ``seq <= 63``). No opaque call lifts it: kept
    opaque, the site still ends where the table does, the original fails past it, and the check there
    refused the whole capture (static shapes); read as a bound, the graph is kept within it."""
    if bound(guard, "size") is None:
        return False
    frames = guard.stack
    start = next((k for k in range(len(frames) - 1, -1, -1) if frames[k][1] == site.method), 0)
    return not any(on_branch(file, line) or _in_loop(file, line) for file, _, line in frames[start:])


def _others(site: Site, model: nn.Module) -> tuple[Site, ...]:
    """For a method site, the same method of every other instance of its owner's class (each layer
    of a stack runs the same loop); none for a function site."""
    if site.func is not None or site.attr is not None:
        return ()
    kind = type(site.owner(model))
    return tuple(Site(path, site.method) for path, module in model.named_modules()
                 if type(module) is kind and path != site.path)


def _within(scan: Scan, frames: set[tuple[str, str]]) -> bool:
    """Whether a guard whose stack holds ``frames`` ran inside ``scan``'s function or method."""
    return any(name == scan.site.method for _, name in frames)


class _Seen(BaseException):
    """Ends the eager run once the site has been watched (not an Exception: model code that catches
    those must not swallow it)."""


def hidden_inside(model: nn.Module, call: ExampleInputs, site: Site) -> list[str]:
    """What one eager call of ``site`` (its first, in a run of ``model`` on ``call``) computes with
    that a quantizer would no longer see with the site opaque: each module it calls, and each
    parameter of the model it uses without receiving it as an argument (a helper method reading
    ``self.weight``). A parameter passed in (Mamba's ``D``) stays a ``get_attr`` input of the opaque
    call. Empty for a scan that may be opaque."""
    return watch(model, call, site)[0]


def watch(model: nn.Module, call: ExampleInputs, site: Site) -> tuple[list[str], list[str]]:
    """:func:`hidden_inside`, and the type of each leaf of that call's output that is not a tensor
    (None, a number: the graph holds it as recorded at every size)."""
    from torch.overrides import TorchFunctionMode

    parameters = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    modules = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    found: list[str] = []
    given: set[int] = set()
    constants: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            for leaf in pytree.tree_leaves((args, kwargs or {})):
                if isinstance(leaf, nn.Parameter) and id(leaf) in parameters and id(leaf) not in given:
                    found.append(f"parameter {parameters[id(leaf)]}")
            return func(*args, **(kwargs or {}))

    def called(module: nn.Module, args: Any) -> None:
        found.append(f"module {modules.get(id(module), type(module).__name__)}")

    real = real_callable(site, model)

    def watched(*args: Any, **kwargs: Any) -> Any:
        given.update(id(v) for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor))
        handle = torch.nn.modules.module.register_module_forward_pre_hook(called)
        try:
            with Watch():
                out = real(*args, **kwargs)
            constants.extend(type(v).__name__ for v in pytree.tree_leaves(out) if not isinstance(v, torch.Tensor))
        finally:
            handle.remove()
        raise _Seen

    fresh = call.fresh_copy()
    try:
        with patched(model, {site: watched}), preserved_state(model), torch.no_grad():
            torch.manual_seed(SEED)
            model(*fresh.args, **fresh.kwargs)
    except _Seen:
        return list(dict.fromkeys(found)), constants
    except Exception as err:  # noqa: BLE001 - a site the eager run cannot reach: not taken
        return [f"the eager run failed ({type(err).__name__})"], constants
    return ["the eager run never called it"], constants


def usable(log: GuardLog, symbols: set[str], proposal: Any, model: nn.Module, call: ExampleInputs,
           taken: list[Site]) -> list[Scan]:
    """The scans :func:`find` names for the declared ``symbols`` of ``proposal`` (an
    :class:`~..shapes.autodims.Proposal` captured on ``call``) that hide nothing (:func:`hidden_inside`)."""
    from ...reporting import progress

    out = []
    for found in find(log, symbols, proposal, model, call, taken):
        for site in (found.site, *found.inner):  # the outermost function that hides nothing
            scan = dataclasses.replace(found, site=site, inner=(), others=_others(site, model))
            hidden, constants = watch(model, call, site)
            if not hidden:
                break
            progress.step(f"{site.qualname} loops over '{scan.symbol}' but is not kept opaque: it uses {hidden[0]}")
        if hidden:
            continue
        if scan.branched and constants:  # a decision on the size: the graph would hold that value at every size
            progress.step(f"{scan.site.qualname} decides on '{scan.symbol}' and returns {constants[0]}: not kept opaque")
            continue
        progress.step(f"{scan.site.qualname} made opaque: a loop over '{scan.symbol}' ({scan.guard})")
        out.append(scan)
    return out


__all__ = ["Scan", "failing_size", "find", "hidden_inside", "usable"]
