"""Turn a capture failure into an :class:`Issue` a person can act on.

A raw tracer exception says *what* broke deep inside torch. An Issue says where in the *user's* code
(module path, file, line, the source line), which kind of problem it is, and the concrete fix.
"User code" is anything that is neither torch, the standard library nor fxprep itself: a model that
lives in site-packages (timm, transformers) is user code too.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
import traceback
import types
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

# Categories (stable strings: tests and reports key on them).
DATA_DEPENDENT_BRANCH = "data-dependent branch"
SHAPE_DEPENDENT_BRANCH = "shape-dependent branch"
DATA_DEPENDENT_LOOP = "data-dependent loop"
DATA_DEPENDENT_VALUE = "data-dependent value"
ITERATION = "iteration over a traced value"
CONSTRUCTOR = "tensor constructor sized from a traced shape"
NON_TORCH_CALL = "non-torch call on a tensor"
SIDE_EFFECT = "python side effect"
AUTOGRAD_FUNCTION = "custom autograd.Function"
CUSTOM_OP = "unsupported custom op"
SPECIALISATION = "shape/device specialisation"
UNSUPPORTED = "unsupported python"
DECORATED_FORWARD = "decorated forward"
OTHER = "other"

FIXES: dict[str, str] = {
    DECORATED_FORWARD: (
        "torch.fx cannot trace a `forward` behind a decorator that takes `(*args, **kwargs)` (transformers' "
        "`deprecate_kwarg`); Dynamo can: keep tracer='auto' (Dynamo first) or pass tracer='dynamo'."
    ),
    DATA_DEPENDENT_BRANCH: (
        "replace the Python `if` on a tensor with `torch.where(cond, a, b)` (both sides computed) or "
        "`torch.cond(pred, true_fn, false_fn, operands)`, or let fxprep do it with "
        "`control_flow='rewrite'`; if the condition is really a fixed flag, pass it through "
        "`concrete_args`; or keep this part as one call with `fxprep.opaque`."
    ),
    SHAPE_DEPENDENT_BRANCH: (
        "a condition on a tensor's shape (`x.dim()`, `x.shape[0] == 3`), not on its values: torch.fx traces "
        "without shapes and cannot decide it, Dynamo specialises it on the example's shape (a guard, reported "
        "with the static-shape note): prepare with example_inputs so Dynamo captures it, or, for fx, pass the "
        "value through `concrete_args` or mark the part `fxprep.opaque`."
    ),
    DATA_DEPENDENT_LOOP: (
        "a `while` loop whose trip count depends on a tensor cannot be one static graph (not even with "
        "control_flow='rewrite'): bound it by a fixed count and mask the extra iterations with "
        "`torch.where`, or keep it as one call with `fxprep.opaque` (the default fallback makes its "
        "module opaque)."
    ),
    DATA_DEPENDENT_VALUE: (
        "keep the value a tensor instead of converting it to a Python number (`.item()`, `int()`, "
        "`bool()`); use `torch._check(...)` to state what the value satisfies; or mark the "
        "enclosing function/module with `fxprep.opaque`."
    ),
    ITERATION: (
        "loop over a fixed count (a module attribute or a `concrete_args` value) instead of a traced "
        "shape or tensor; vectorise the loop; use tracer='dynamo' which specialises shapes; or mark "
        "the enclosing function/module with `fxprep.opaque`."
    ),
    CONSTRUCTOR: (
        "build the tensor from another tensor (`torch.zeros_like`, `x.new_zeros(...)`, "
        "`torch.ones_like`), or wrap the constructor call in a function marked `fxprep.opaque`."
    ),
    NON_TORCH_CALL: (
        "use the torch equivalent (`torch.sqrt` for `math.sqrt`, tensor ops for numpy), or record "
        "the call as-is with `torch.fx.wrap('name')` / `fxprep.opaque`."
    ),
    SIDE_EFFECT: (
        "move the side effect (print, logging, attribute or global mutation) out of forward(), or "
        "mark the module with `fxprep.opaque` so it runs eagerly."
    ),
    AUTOGRAD_FUNCTION: (
        "mark the autograd.Function's caller with `fxprep.opaque`, or add a `setup_context` / "
        "make its forward traceable."
    ),
    CUSTOM_OP: "register a fake (meta) implementation with `torch.library.register_fake`, or mark the caller `fxprep.opaque`.",
    SPECIALISATION: "prepare with the input shapes and device you will use, or mark the dimension dynamic.",
    UNSUPPORTED: "mark the enclosing module or function with `fxprep.opaque` so it is called, not traced.",
    OTHER: "mark the enclosing module with `fxprep.opaque` (or add it to modules_to_exclude) so it is called, not traced.",
}


@dataclass
class Issue:
    """One located, explained reason why (part of) a model could not be captured."""

    category: str
    message: str
    fix: str
    tracer: str
    module: str | None = None
    file: str | None = None
    line: int | None = None
    code: str | None = None

    @property
    def location(self) -> str:
        if self.file is None:
            return "unknown location"
        return f"{self.file}:{self.line}"

    def to_text(self) -> str:
        where = f"module '{self.module}'" if self.module is not None else "unknown module"
        if self.module == "":
            where = "the root module"
        lines = [f"{self.category.upper()} in {where} at {self.location} ({self.tracer})"]
        if self.code:
            lines.append(f"    {self.code}")
        lines.append(f"  {self.message}")
        lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])
_TORCH = os.path.normcase(os.path.dirname(torch.__file__))
_FXPREP = os.path.normcase(os.path.dirname(os.path.dirname(__file__)))  # the package (this is reporting/)


def is_user_file(filename: str) -> bool:
    """True for code that belongs to the model's author (site-packages model libraries included)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    if path.startswith(_TORCH + os.sep) or path.startswith(_FXPREP + os.sep):
        return False
    if path.startswith(_STDLIB + os.sep) and "site-packages" not in path:
        return False
    return True


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of ``err``'s message, at most ``limit`` characters ("" for an empty message):
    what a report note or a retry's reason quotes of a failure."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else ""


def describe_exception(err: BaseException) -> str:
    """``Type: first line (file:line)`` for reports and attempt lists."""
    frame = user_frame(err)
    where = f" ({frame[0]}:{frame[1]})" if frame else ""
    return f"{type(err).__name__}: {_first_line(err)}{where}"


def _tb_frames(err: BaseException) -> list[tuple[types.FrameType, int]]:
    """The traceback's frames with their line; an entry without one (a frame whose bytecode Dynamo
    rewrote can have ``tb_lineno`` None on Python 3.11) is left out rather than failing the report."""
    return [(f, lineno) for f, lineno in traceback.walk_tb(err.__traceback__) if lineno is not None]


def user_frame(err: BaseException) -> tuple[str, int, str] | None:
    """The innermost user frame of the traceback (Dynamo's own record first)."""
    summary = getattr(err, "innermost_user_frame_summary", None)
    if summary is not None and getattr(summary, "filename", None):
        if is_user_file(summary.filename):
            return summary.filename, summary.lineno, (summary.line or "").strip()
        # Dynamo stopped inside the standard library (``inspect.Signature.bind`` called by a
        # transformers decorator): the line to show is the innermost one of the model's own code
        return _innermost_user_line(str(err)) or (summary.filename, summary.lineno, (summary.line or "").strip())
    found = None
    for frame, lineno in _tb_frames(err):
        if is_user_file(frame.f_code.co_filename):
            found = (frame.f_code.co_filename, lineno, linecache.getline(frame.f_code.co_filename, lineno).strip())
    if found is None and err.__cause__ is not None and err.__cause__ is not err:
        return user_frame(err.__cause__)
    if found is None:  # Dynamo's shape errors carry the user stack only in their text
        return _innermost_user_line(str(err))
    return found


def _innermost_user_line(text: str) -> tuple[str, int, str] | None:
    """The last ``File "...", line N`` of ``text`` (an exception's message) in the user's code."""
    for filename, lineno in reversed(_FILE_LINE.findall(text)):
        if is_user_file(filename):
            return filename, int(lineno), linecache.getline(filename, int(lineno)).strip()
    return None


def _code_span(fn: object) -> tuple[str, int, int] | None:
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return os.path.normcase(os.path.abspath(code.co_filename)), code.co_firstlineno, last


def module_at(model: nn.Module | None, filename: str, line: int) -> str | None:
    """The module whose class's ``forward`` contains ``filename:line`` (the deepest one, first in
    module order). Used where no live frames are left to look at (Dynamo, draft_export)."""
    if model is None:
        return None
    target = os.path.normcase(os.path.abspath(filename))
    best: str | None = None
    for name, m in model.named_modules():
        span = _code_span(getattr(type(m), "forward", None))
        if span and span[0] == target and span[1] <= line <= span[2]:
            if best is None or name.count(".") > best.count("."):
                best = name
    return best


def module_of_failure(err: BaseException, model: nn.Module | None) -> str | None:
    """Qualified name of the innermost module whose forward was running when ``err`` was raised."""
    if model is None:
        return None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    found = None
    for frame, _ in _tb_frames(err):
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
    return found


_SHAPE_METHODS = ("dim", "size", "numel", "nelement", "ndimension")
_SHAPE_ATTRS = ("shape", "ndim")


def _condition(code: str) -> Any:
    """The expression a source line decides on: an ``if``/``elif``/``while``/``assert`` condition, a
    conditional expression's test, else the returned or assigned value (``return min(k, x.size(1))``)."""
    import ast

    text = code.strip()
    if text.startswith("elif "):
        text = text[2:]
    if text.endswith(":"):
        text += " pass"
    try:
        statement = ast.parse(text).body[0]
    except (SyntaxError, IndexError):
        return None
    if isinstance(statement, (ast.If, ast.While, ast.Assert)):
        return statement.test
    value = getattr(statement, "value", None)
    if isinstance(value, ast.IfExp):
        return value.test
    return value


def shape_only(code: str) -> bool:
    """Whether a source line's condition reads tensors only through their shapes (``x.dim() == 4``,
    ``x.shape[0] == 3``, ``len(x.shape) > 2``, ``min(k, x.size(1))``), besides constants and
    ``self`` attributes: a condition Dynamo specialises on the example's shape."""
    import ast

    condition = _condition(code)
    if condition is None:
        return False
    found = [False]

    def shape_read(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):
            return shape_read(node.value) and ok(node.slice)
        if isinstance(node, ast.Attribute) and node.attr in _SHAPE_ATTRS:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_METHODS:
            return all(ok(a) or isinstance(a, ast.Name) for a in node.args)  # x.size(axis)
        return False

    def ok(node: ast.AST) -> bool:
        if shape_read(node):
            found[0] = True
            return True
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Attribute):  # self.training, self.config.flag
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            return isinstance(base, ast.Name) and base.id == "self"
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Tuple, ast.List)):
            return all(ok(child) for child in ast.iter_child_nodes(node)
                       if not isinstance(child, (ast.cmpop, ast.boolop, ast.unaryop, ast.operator, ast.expr_context)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("len", "min", "max", "int"):
            return all(ok(a) or isinstance(a, ast.Name) for a in node.args)
        return False

    return ok(condition) and found[0]


def stopped_at_data_guard(err: BaseException) -> bool:
    """Whether Dynamo stopped at a question about a value read from data (torch's
    ``GuardOnDataDependentSymNode``, or its text re-raised by another error): the failure real
    values can get past (:mod:`fxprep.capture.dynamo.values`), and the only outer-capture failure
    block reuse takes as the model's own (:mod:`fxprep.capture.dynamo.reuse`)."""
    return type(err).__name__ == "GuardOnDataDependentSymNode" or "data-dependent expression" in str(err)


def categorise(err: BaseException, code: str | None) -> str:
    """The category of a tracer exception, from its type and message and the user's source line."""
    text = str(err)
    code = code or ""
    gb_type = str(getattr(err, "gb_type", "") or "")
    low = (text + " " + gb_type + " " + type(err).__name__).lower()  # Dynamo's Unsupported says so only in its type
    if type(err).__name__ == "DecoratedForward":  # fxprep's own explanation of an fx failure
        return DECORATED_FORWARD
    stripped = code.lstrip()
    is_branch_line = stripped.startswith(("if ", "elif ", "while ", "assert ")) or " if " in code
    if "print(" in code or "logging." in code or "logger." in code or "side effect" in low:
        return SIDE_EFFECT
    if "cannot be iterated" in low or "iteration over" in low or (
        "cannot be interpreted as an integer" in low and ("range(" in code or "for " in code)
    ):
        return ITERATION
    if any(t in low for t in ("autograd.function", "autograd function", "applytemplate", "autograd_function")):
        return AUTOGRAD_FUNCTION
    # Only the message's own words, not the stack under it: "fake" and "_call_impl" are in every
    # Dynamo stack that passes through torch's fake-tensor code.
    head = (text.split("User Stack")[0].split("Caused by:")[0].split("from user code:")[0]
            + " " + gb_type + " " + type(err).__name__).lower()
    if "pendingunbackedsymbolnotfound" in head:
        # Dynamo lost track of a size read from data (a boolean-mask index under real-value capture):
        # about data-dependent sizes, whatever the message says about "your fake implementation"
        return DATA_DEPENDENT_VALUE
    if "fake" in head and ("custom op" in head or "operator" in head or "kernel" in head or "impl" in head) \
            and type(err).__name__ not in ("GuardOnDataDependentSymNode", "InternalTorchDynamoError"):
        return CUSTOM_OP
    if "constraint" in low and ("violat" in low or "specializ" in low) or "specialized" in low and "dynamic" in low:
        return SPECIALISATION
    if "must be tuple of ints" in low or "received an invalid combination of arguments" in low or (
        "proxy" in low and "torch." in code and ("shape" in code or "size(" in code)
        and any(f"torch.{c}" in code for c in ("Tensor(", "zeros", "ones", "full", "empty", "arange", "rand", "window", "eye", "linspace"))
    ):
        return CONSTRUCTOR
    value_call = any(t in code for t in (".item()", "int(", "float(", "bool(", ".tolist()"))
    if "not 'proxy'" in low or "'len' is not supported" in text:
        return DATA_DEPENDENT_VALUE
    if "control flow" in low or "data-dependent" in low or "data dependent" in low or "guard on data" in low \
            or "dynamic control flow" in low or "jump" in gb_type.lower():
        if "guard on data" not in low and "data-dependent expression" not in low and not value_call \
                and shape_only(code):
            return SHAPE_DEPENDENT_BRANCH  # fx met `if x.dim() == 4`: a shape, not data
        if stripped.startswith("while ") and not value_call:
            return DATA_DEPENDENT_LOOP
        return DATA_DEPENDENT_BRANCH if is_branch_line or not value_call else DATA_DEPENDENT_VALUE
    if value_call and ("proxy" in low or "item" in low):
        return DATA_DEPENDENT_VALUE
    if "numpy" in low or "__array" in low or "np." in code or "math." in code:
        return NON_TORCH_CALL
    if "unsupported" in low or "not supported" in low:
        return UNSUPPORTED
    return OTHER


def diagnose(err: BaseException, tracer: str, model: nn.Module | None = None) -> list[Issue]:
    """The issues one tracer exception stands for (one per exception for now)."""
    frame = user_frame(err)
    file, line, code = frame if frame else (None, None, None)
    category = categorise(err, code)
    module = module_of_failure(err, model)
    if module is None and file is not None and line is not None:
        module = module_at(model, file, line)
    if module is None:  # a free function or a static method: the innermost module forward on
        # Dynamo's user stack (its record, or the stack its message prints: an internal error has no record)
        stack = [(f.filename, f.lineno or 0) for f in getattr(err, "real_stack", None) or []]
        for filename, lineno in stack or [(f, int(n)) for f, n in _FILE_LINE.findall(str(err))]:
            found = module_at(model, filename, lineno)
            module = found if found is not None else module
    return [
        Issue(
            category=category,
            message=f"{type(err).__name__}: {_first_line(err)}",
            fix=FIXES[category],
            tracer=tracer,
            module=module,
            file=file,
            line=line,
            code=code,
        )
    ]


__all__ = ["Issue", "diagnose", "describe_exception", "is_user_file", "shape_only", "user_frame", "FIXES"]
