"""A module method's source as an AST, and a rewritten AST compiled back into a function.

The rewrite never edits the user's file or class. It reads the method's source
(``inspect.getsourcelines``), parses it with the original line numbers, and compiles the rewritten
tree into a new function that shares everything else with the original: its globals (the user's
module namespace, read live), its closure cells (``super()``'s ``__class__`` included), its
defaults, and its decorators (re-applied). :func:`install` puts the new function on the model's
instances that run the original (an entry in the instance ``__dict__``, shadowing the class's
method) and :func:`uninstall` removes exactly what it installed (:func:`bound`: both around a
``with`` block).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

_TORCH_PREFIXES = ("torch.", "torchvision.", "torchaudio.")
_MISSING = object()


class SourceUnavailable(Exception):
    """The method's source cannot be read or parsed (a C extension, a lambda, exec'd code)."""


@dataclass
class Method:
    """One method of a user class, as the model's modules run it."""

    cls: type
    name: str
    attr: Any  # what ``cls.__dict__[name]`` holds (a function, a staticmethod, a decorated wrapper)
    raw: types.FunctionType  # the undecorated function
    filename: str
    first_line: int
    last_line: int
    instances: list[nn.Module] = field(default_factory=list)

    @property
    def qualname(self) -> str:
        return f"{self.cls.__qualname__}.{self.name}"

    def contains(self, filename: str, line: int) -> bool:
        return _same_file(filename, self.filename) and self.first_line <= line <= self.last_line


def _same_file(a: str, b: str) -> bool:
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


def _span(fn: types.FunctionType) -> tuple[str, int, int] | None:
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    return fn.__code__.co_filename, start, start + len(lines) - 1


def _raw(attr: Any) -> types.FunctionType | None:
    fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    fn = inspect.unwrap(fn) if callable(fn) else None
    return fn if isinstance(fn, types.FunctionType) else None


def method_at(model: nn.Module, filename: str, line: int) -> Method | None:
    """The method (of a class of one of ``model``'s modules, root included) whose source holds
    ``filename:line``, with the model's modules that run exactly that method; None when the line
    is in no such method (a free function, torch's own code)."""
    found: dict[tuple[type, str], Method] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__.startswith(_TORCH_PREFIXES) or cls is nn.Module or cls is object:
                continue
            for name, attr in cls.__dict__.items():
                raw = _raw(attr)
                if raw is None or not _same_file(raw.__code__.co_filename, filename):
                    continue
                span = _span(raw)
                if span is None or not span[1] <= line <= span[2]:
                    continue
                key = (cls, name)
                if key not in found:
                    found[key] = Method(cls, name, attr, raw, span[0], span[1], span[2])
                # Only modules whose class resolves the name to this very attribute run this code
                # (a subclass overriding it and calling super() does not get the rewrite).
                if inspect.getattr_static(type(module), name, None) is attr:
                    found[key].instances.append(module)
    candidates = [m for m in found.values() if m.instances]
    if not candidates:
        return None
    return min(candidates, key=lambda m: m.last_line - m.first_line)  # the innermost definition


def parse(method: Method) -> ast.FunctionDef:
    """The method's ``def`` (decorators included) with the line numbers of the file."""
    try:
        lines, start = inspect.getsourcelines(method.raw)
    except (OSError, TypeError) as err:
        raise SourceUnavailable(f"cannot read the source of {method.qualname}: {err}") from err
    text = "".join(lines)
    indented = bool(lines) and lines[0][:1] in (" ", "\t")
    try:
        # An indented def parses as the body of an `if 1:` whatever the indentation of its
        # multi-line strings (textwrap.dedent would give up on those).
        tree = ast.parse("if 1:\n" + text if indented else text)
    except SyntaxError as err:
        raise SourceUnavailable(f"cannot parse the source of {method.qualname}: {err}") from err
    node = tree.body[0].body[0] if indented else tree.body[0]  # type: ignore[attr-defined]
    if not isinstance(node, ast.FunctionDef) or node.name != method.raw.__name__:
        raise SourceUnavailable(f"the source of {method.qualname} is not a plain def")
    ast.increment_lineno(node, start - 1 - (1 if indented else 0))
    return node


def _cell(value: Any) -> types.CellType:
    return types.CellType(value)


def compile_function(method: Method, tree: ast.FunctionDef, helpers: dict[str, Any]) -> Any:
    """Compile ``tree`` (a rewritten copy of ``method``'s def) into what ``cls.__dict__[name]``
    would hold: a function sharing the original's globals, closure cells and defaults, wrapped in
    the original's decorators, with ``helpers`` reachable as closure variables."""
    raw = method.raw
    decorators = list(tree.decorator_list)
    tree.decorator_list = []
    names = list(raw.__code__.co_freevars) + list(helpers)
    # def __fxprep_factory__(<free variables>, <helpers>): <the def>; return <name>
    factory = ast.parse(f"def __fxprep_factory__({', '.join(names)}):\n    pass").body[0]
    assert isinstance(factory, ast.FunctionDef)
    factory.body = [tree, ast.Return(value=ast.Name(id=tree.name, ctx=ast.Load()))]
    ast.copy_location(factory, tree)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, raw.__code__.co_filename, "exec", dont_inherit=True)
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in factory_code.co_consts if isinstance(c, types.CodeType) and c.co_name == tree.name)
    cells = dict(zip(raw.__code__.co_freevars, raw.__closure__ or ()))
    closure = tuple(cells[n] if n in cells else _cell(helpers[n]) for n in inner.co_freevars)
    fn = types.FunctionType(inner, raw.__globals__, raw.__name__, raw.__defaults__, closure)
    fn.__kwdefaults__ = raw.__kwdefaults__
    fn.__qualname__ = raw.__qualname__
    fn.__module__ = raw.__module__
    fn.__doc__ = raw.__doc__
    fn.__dict__.update(raw.__dict__)
    fn.__dict__.pop("__wrapped__", None)
    fn.__fxprep_rewritten__ = raw  # type: ignore[attr-defined]
    return _decorate(method, fn, decorators)


def _decorate(method: Method, fn: Any, decorators: list[ast.expr]) -> Any:
    """Re-apply the original's decorators (innermost first), evaluated in its module namespace."""
    result: Any = fn
    for dec in reversed(decorators):
        text = ast.unparse(dec)
        if text in ("staticmethod", "classmethod"):
            result = staticmethod(result) if text == "staticmethod" else classmethod(result)
            continue
        try:
            decorator = eval(compile(ast.Expression(dec), method.filename, "eval"), method.raw.__globals__)  # noqa: S307
            result = decorator(result)
        except Exception as err:  # noqa: BLE001 - any decorator failure becomes SourceUnavailable, said
            raise SourceUnavailable(f"cannot re-apply the decorator @{text} of {method.qualname}: {err}") from err
    return result


def bind(attr: Any, instance: nn.Module) -> Any:
    """What ``instance.<name>`` evaluates to when the class holds ``attr``."""
    return attr.__get__(instance, type(instance)) if hasattr(attr, "__get__") else attr


Installed = list[tuple[nn.Module, str, Any]]

# (id(instance), name) -> the values fxprep installed there, oldest first; the newest is the one in
# the instance's __dict__. Entries live only while installed (install/uninstall keep it).
_LAYERS: dict[tuple[int, str], list[Any]] = {}


def install(replacements: list[tuple[Method, Any]]) -> Installed:
    """Install each rewritten method on the instances that run the original (an entry in the
    instance ``__dict__``; the class is never touched). Returns what :func:`uninstall` removes.

    An attribute the user set on the instance is left alone. A copy fxprep itself installed there
    (a family's methods during capture: :meth:`fxprep.families.Family.capture_context`) is covered by the new one until that
    is uninstalled, whichever is uninstalled first: the newest copy is the one that runs."""
    installed: Installed = []
    for method, attr in replacements:
        for instance in method.instances:
            key = (id(instance), method.name)
            layers = _LAYERS.get(key, [])
            current = instance.__dict__.get(method.name, _MISSING)
            if current is not _MISSING and not (layers and current is layers[-1]):
                continue  # the user set this attribute on the instance: leave it
            value = bind(attr, instance)
            instance.__dict__[method.name] = value
            _LAYERS[key] = [*layers, value]
            installed.append((instance, method.name, value))
    return installed


def uninstall(installed: Installed) -> None:
    """Remove exactly the entries :func:`install` made; where a copy installed earlier is still
    installed on the same instance, it runs again."""
    for instance, name, value in reversed(installed):
        key = (id(instance), name)
        layers = _LAYERS.get(key, [])
        top = layers[-1] if layers else None
        layers[:] = [v for v in layers if v is not value]
        if not layers:
            _LAYERS.pop(key, None)
        if top is value and instance.__dict__.get(name) is value:
            if layers:
                instance.__dict__[name] = layers[-1]
            else:
                del instance.__dict__[name]
    installed.clear()


@contextlib.contextmanager
def bound(replacements: list[tuple[Method, Any]]) -> Iterator[None]:
    """:func:`install` for the ``with`` block only."""
    installed = install(replacements)
    try:
        yield
    finally:
        uninstall(installed)
