"""Deliver a prepared module as ONNX or as a ``torch.export.ExportedProgram``, verified.

Both exporters see a copy of the graph without capture metadata, so scopes name the prepared
modules; ONNX nodes are renamed ``<module>/<OpType>`` and carry ``fxprep.module`` metadata.
``optimize`` chooses between folding constants only (the default: one ONNX op per prepared module
op), the exporter's full optimizer, or the raw export. Each result is run and compared with the
prepared module; an ONNX file that fails its check is removed.

See docs/delivery.md and docs/handoff/onnx.md.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..core.inputs import ExampleInputs, normalize_example_inputs
from ..errors import ExportError, FxprepError, FxprepWarning, InputMismatch, InvalidInput
from ..verify.compare import flatten_output, tensor_diff

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain_reason(err: BaseException) -> str:
    """An exporter's error in one readable line: its first line without terminal colour codes or
    torch's "This is step 1/3 ... Next steps" advice, then the first line of its root cause (the
    actual reason, e.g. a data-dependent guard), each whole: a warning must not be cut mid-word."""
    def first_line(e: BaseException) -> str:
        text = _ANSI.sub("", str(e)).strip()
        line = text.splitlines()[0] if text else ""
        return line.split(" This is step ")[0].strip()

    reason = f"{type(err).__name__}: {first_line(err)}"
    cause, seen = err.__cause__ or err.__context__, {id(err)}
    root = None
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        root = cause
        cause = cause.__cause__ or cause.__context__
    if root is not None:
        reason += f" (caused by {type(root).__name__}: {first_line(root)})"
    return reason
MODULE_KEY = "fxprep.module"


def _example(example_inputs: Any) -> ExampleInputs:
    example = normalize_example_inputs(example_inputs)
    if example is None:
        raise ExportError("exporting needs example_inputs: both exporters trace by running the module.")
    return example


def _checked(gm: Any, example_inputs: Any, what: str) -> tuple[ExampleInputs, list[torch.Tensor]]:
    """The example inputs, and the prepared module's outputs on them: what the export is compared
    with, and a check, before exporting, that ``gm`` is a prepared module these inputs fit."""
    if not isinstance(gm, fx.GraphModule):
        raise InvalidInput(
            f"{what} expects the torch.fx.GraphModule returned by fxprep.prepare_model (or fxprep.load), not "
            f"{type(gm).__name__}. Prepare the model first: gm = fxprep.prepare_model(model, example_inputs=...)."
        )
    example = _example(example_inputs)
    try:
        expected = _reference(gm, example)
    except FxprepError as err:
        if not isinstance(err, InputMismatch):
            raise
        prepared_for = getattr(getattr(gm, "fxprep_report", None), "inputs", "") or "see the report"
        reason = " ".join(line.strip() for line in str(err).splitlines())  # the guard's message, on one line
        raise InputMismatch(f"{what}: the prepared module fails on these example inputs ({reason}). Pass inputs "
                            f"of the kind it was prepared with ({prepared_for}).") from err
    except Exception as err:  # noqa: BLE001 - wrong dtype / shape / count of inputs
        prepared_for = getattr(getattr(gm, "fxprep_report", None), "inputs", "") or "see the report"
        raise InvalidInput(
            f"{what}: the prepared module fails on these example inputs ({type(err).__name__}: {str(err)[:300]}). "
            f"Pass inputs of the kind it was prepared with ({prepared_for}): same count, dtypes and shapes "
            f"(dynamic dimensions may vary)."
        ) from err
    return example, expected


def without_capture_metadata(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing ``gm``'s modules whose nodes carry no capture metadata, so exporters
    scope ops by the prepared module names rather than the original model's."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    for node in graph.nodes:
        node.meta = {}
    clean = fx.GraphModule(gm, graph, type(gm).__name__)
    clean.training = gm.training
    return clean


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [t for _, t in flatten_output(value) if isinstance(t, torch.Tensor)]


def _compare(expected: list[torch.Tensor], got: list[torch.Tensor], rtol: float, atol: float | None, what: str,
             hint: str = "") -> float:
    """Max |diff| over all outputs; ExportError past the tolerance. ``atol=None`` scales with the
    outputs (1e-5 x their largest magnitude, at least 1e-5): a lowered graph reassociates sums
    (attention, long reductions), and a fixed atol would fail on large logits for that alone."""
    if atol is None:
        scale = max((float(t.detach().abs().max()) for t in expected if t.is_floating_point() and t.numel()), default=1.0)
        atol = 1e-5 * max(1.0, scale)
    if len(expected) != len(got):
        raise ExportError(f"{what} returns {len(got)} tensors where the prepared module returns {len(expected)}.")
    worst = 0.0
    for i, (a, b) in enumerate(zip(expected, got)):
        if tuple(a.shape) != tuple(b.shape):
            raise ExportError(f"{what} output {i} has shape {tuple(b.shape)}, the prepared module's {tuple(a.shape)}.")
        diff, problem = tensor_diff(a.detach().cpu(), b.detach().cpu().to(a.dtype), rtol, atol)
        worst = max(worst, diff)
        if problem is not None:
            raise ExportError(
                f"{what} differs from the prepared module on output {i}: {problem}. {hint}"
                f"Raise rtol/atol for reduced precision, or report it with the model."
            )
    return worst


def _reference(gm: nn.Module, example: ExampleInputs) -> list[torch.Tensor]:
    fresh = example.fresh_copy()
    with torch.no_grad():
        return _tensor_leaves(gm(*fresh.args, **fresh.kwargs))


def _with_defaults(gm: fx.GraphModule, example: ExampleInputs) -> ExampleInputs:
    """``example`` with the arguments it leaves to their defaults given explicitly: torch.export
    flattens only what it is passed, and a flattened fx graph has a placeholder for each argument
    (a ``concrete_args`` None included), which would then go unfed."""
    try:
        bound = inspect.signature(gm.forward).bind(*example.args, **example.kwargs)
    except TypeError:
        return example
    bound.apply_defaults()
    return ExampleInputs(tuple(bound.args), dict(bound.kwargs))


def export_program(
    gm: fx.GraphModule,
    example_inputs: Any,
    *,
    strict: bool = False,
    verify: bool = True,
    rtol: float = 1e-4,
    atol: float | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of a prepared module, checked against it on the example inputs.

    The program's ``nn_module_stack`` metadata names the prepared modules (docs/handoff/pt2e.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model` or :func:`fxprep.load`.
        example_inputs: What ``torch.export`` traces and the check runs on, as for ``prepare_model``.
        strict: ``torch.export``'s ``strict`` mode.
        verify: Run the program on the example and compare it with ``gm``.
        rtol: Relative tolerance of the comparison.
        atol: Absolute tolerance (default: 1e-5 times the outputs' largest magnitude, at least 1e-5).

    Returns:
        The ``torch.export.ExportedProgram``.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or fails on ``example_inputs``.
        InputMismatch: ``example_inputs`` are unlike those ``gm`` was prepared for.
        ExportError: ``torch.export`` failed, or the program computes something else.
    """
    example, expected = _checked(gm, example_inputs, "export_program")
    clean = without_capture_metadata(gm)
    fresh = _with_defaults(clean, example.fresh_copy())
    try:
        with _quiet():
            program = torch.export.export(clean, fresh.args, fresh.kwargs, strict=strict)
    except Exception as err:  # noqa: BLE001 - every exporter failure becomes an ExportError
        raise ExportError(
            f"torch.export could not export the prepared module: {type(err).__name__}: {str(err)[:500]}. "
            f"Data-dependent shapes or an opaque leaf with Python control flow are the usual causes; "
            f"torch.export.draft_export(...) lists every such site."
        ) from err
    if verify:
        again = _with_defaults(clean, example.fresh_copy())
        with torch.no_grad():
            got = _tensor_leaves(program.module()(*again.args, **again.kwargs))
        _compare(expected, got, rtol, atol, "the exported program")
    return program


OPTIMIZE = ("fold", "full", "none")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters print progress and, on failure, whole graphs: keep that off the user's console."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _onnx_export(clean: fx.GraphModule, example: ExampleInputs, path: Path, opset: int | None,
                 optimize: str, dynamo: bool) -> str:
    """Export to ``path``; returns the exporter used."""
    size = sum(t.numel() * t.element_size() for t in clean.state_dict().values())
    external = size > 1_800_000_000
    fresh = example.fresh_copy()
    if not dynamo:
        torch.onnx.export(clean, fresh.args, str(path), kwargs=fresh.kwargs or None, opset_version=opset,
                          dynamo=False, external_data=external)
        return "torchscript"
    program = torch.onnx.export(clean, fresh.args, kwargs=fresh.kwargs or None, opset_version=opset, dynamo=True,
                                optimize=optimize == "full", verbose=False)
    if optimize == "fold":
        from onnxscript import optimizer
        from onnxscript.ir.passes.common import RemoveUnusedNodesPass

        optimizer.fold_constants(program.model)
        RemoveUnusedNodesPass()(program.model)
    program.save(str(path), external_data=external)
    return "dynamo"


def _module_of(scopes: list[str], modules: set[str]) -> str | None:
    """The innermost scope that is a module of the prepared graph (name_scopes end with the op)."""
    for scope in reversed(scopes[:-1]):
        if scope in modules:
            return scope
    return None


def name_onnx_nodes(path: str | os.PathLike[str], gm: fx.GraphModule) -> int:
    """Rename the nodes of the ONNX file at ``path`` after the prepared modules; returns how many
    nodes were attributed to a module."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    modules = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    counts: dict[str, int] = {}
    taken = {n.name for n in model.graph.node}
    named = 0
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        try:
            scopes = ast.literal_eval(meta.get(NAME_SCOPES, "[]"))
        except (ValueError, SyntaxError):
            scopes = []
        module = _module_of([str(s) for s in scopes], modules) if isinstance(scopes, list) else None
        if module is None:
            continue
        base = f"{module}/{node.op_type}"
        k = counts.get(base, 0)
        counts[base] = k + 1
        name = base if k == 0 else f"{base}_{k}"
        while name in taken and name != node.name:
            name += "_"
        taken.discard(node.name)
        taken.add(name)
        node.name = name
        entry = node.metadata_props.add()
        entry.key, entry.value = MODULE_KEY, module
        named += 1
    onnx.save(model, str(path))
    return named


def run_onnx(path: str | os.PathLike[str], example_inputs: Any) -> list[torch.Tensor]:
    """Run the ONNX file in onnxruntime (CPU) on the example inputs; outputs as torch tensors."""
    import onnxruntime as ort

    example = _example(example_inputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    leaves = _tensor_leaves((example.args, example.kwargs))
    wanted = session.get_inputs()
    if len(wanted) != len(leaves):
        raise ExportError(
            f"the ONNX model takes {len(wanted)} inputs ({[i.name for i in wanted]}) but the example inputs hold "
            f"{len(leaves)} tensors; constant inputs may have been folded in, pass only tensors."
        )
    feed = {i.name: t.detach().cpu().numpy() for i, t in zip(wanted, leaves)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def _opaque_hint(gm: fx.GraphModule) -> str:
    """A sentence naming ``gm``'s opaque parts (the report's leaves whose reason says so), or ""."""
    report = getattr(gm, "fxprep_report", None)
    opaque = [name for name, why in (getattr(report, "leaves", None) or {}).items() if str(why).startswith("opaque")]
    if not opaque:
        return ""
    return (f"; the graph's opaque parts ({', '.join(opaque)}) run the model's own Python, which torch.export "
            f"traces into and cannot follow where it reads values from data (.tolist(), .item()): an ONNX graph "
            f"needs that code to keep its values as tensors, or export a submodule that does not contain those parts")


def export_onnx(
    gm: fx.GraphModule,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    optimize: str = "fold",
    rtol: float = 1e-4,
    atol: float | None = None,
) -> float:
    """Export ``gm`` to ONNX at ``path``, run it in onnxruntime and compare it with ``gm``.

    The ``torch.export``-based exporter first, the TorchScript one only when that fails (docs/handoff/onnx.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model` or :func:`fxprep.load`.
        example_inputs: What the exporters trace and the comparison runs on, as for ``prepare_model``.
        path: The ``.onnx`` file to write (its folder is made).
        opset: The ONNX opset (default: the exporter's).
        optimize: ``"fold"`` (constants folded), ``"full"`` (the exporter's optimizer) or ``"none"``.
        rtol: Relative tolerance of the comparison.
        atol: Absolute tolerance (default: 1e-5 times the outputs' largest magnitude, at least 1e-5).

    Returns:
        The largest absolute difference between onnxruntime's outputs and the prepared module's.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or fails on ``example_inputs``.
        InputMismatch: ``example_inputs`` are unlike those ``gm`` was prepared for.
        ExportError: Both exporters failed, or the file computes something else; no file is left at ``path``.
    """
    if optimize not in OPTIMIZE:
        raise ExportError(f"optimize must be one of {OPTIMIZE}, not {optimize!r}.")
    example, expected = _checked(gm, example_inputs, "export_onnx")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _without_failed_file(lambda: _export_checked(gm, example, expected, path, opset, optimize, rtol, atol),
                                path)


def _export_checked(gm: fx.GraphModule, example: ExampleInputs, expected: list[torch.Tensor], path: Path,
                    opset: int | None, optimize: str, rtol: float, atol: float | None) -> float:
    """:func:`export_onnx`'s work: export (the torch.export-based exporter, else TorchScript), name
    the nodes, run the file in onnxruntime and compare."""
    clean = without_capture_metadata(gm)
    errors = []
    for dynamo in (True, False):
        try:
            with _quiet():
                _onnx_export(clean, example, path, opset, optimize, dynamo)
            break
        except Exception as err:  # noqa: BLE001 - each exporter's failure is collected; ExportError names them all
            errors.append(f"{'dynamo' if dynamo else 'torchscript'} exporter: {plain_reason(err)}")
    else:
        raise ExportError(
            "ONNX export failed with both exporters:\n  " + "\n  ".join(errors)
            + "\nCheck that every leaf is exportable (export_program(gm, inputs) pinpoints torch.export problems)."
        )
    if errors:
        warnings.warn(
            f"the torch.export-based ONNX exporter failed ({errors[0]}); used the TorchScript exporter, which "
            f"records the one path through Python control flow taken on the example inputs.",
            FxprepWarning, stacklevel=5,  # the caller of export_onnx
        )
    # What the TorchScript exporter's result cannot say by itself: why the first exporter failed,
    # and which parts of the graph run the model's own Python (opaque parts), which torch.export
    # traces into and no ONNX graph can hold.
    why = f" (the torch.export-based exporter had failed first: {errors[0]}{_opaque_hint(gm)})" if errors else ""
    try:
        name_onnx_nodes(path, gm)
        got = run_onnx(path, example)
    except ExportError as err:
        raise ExportError(f"{err}{why}") from err
    except Exception as err:  # noqa: BLE001 - any onnxruntime failure becomes ExportError
        raise ExportError(f"onnxruntime could not run the exported model {path}: {type(err).__name__}: {err}{why}"
                          f"{_dtype_hint(gm, example, err)}") from err
    diff = _compare(expected, got, rtol, atol, f"ONNX model {path.name} in onnxruntime",
                    "Try optimize='none' (an optimizer rewrite may be at fault). " if optimize != "none" else "")
    return diff if math.isfinite(diff) else math.inf


def _written(path: Path) -> list[Path]:
    """The files an export to ``path`` writes: the model, and its external data (``<path>.data``)."""
    return [path, path.with_name(path.name + ".data")]


def _without_failed_file(export: Any, path: Path) -> Any:
    """Run ``export()``; on any failure (a Ctrl-C included) remove what it wrote at ``path``, say so."""
    try:
        return export()
    except BaseException as err:
        removed = [p for p in _written(path) if p.is_file()]
        for p in removed:
            with contextlib.suppress(OSError):
                p.unlink()
        if isinstance(err, ExportError) and removed:
            raise ExportError(f"{err}\nThe failed file was removed ({path}).") from err.__cause__
        raise


_NO_KERNEL = re.compile(r"NOT_IMPLEMENTED|Could not find an implementation for (\w+)")


def _dtype_hint(gm: nn.Module, example: ExampleInputs, err: BaseException) -> str:
    """Why onnxruntime has no kernel for the model, when that is its half-precision dtype: advice."""
    m = _NO_KERNEL.search(str(err))
    if m is None:
        return ""
    tensors = [*gm.parameters(), *gm.buffers(), *_tensor_leaves((example.args, example.kwargs))]
    low = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype in (torch.bfloat16, torch.float16)})
    if not low:
        return ""
    op = f" (here {m.group(1)})" if m.group(1) else ""
    return (f"\nonnxruntime's CPU build has no {' or '.join(low)} kernel for many ops{op}, and this model computes "
            f"in {' and '.join(low)}: the file cannot be checked here. Export a float32 copy instead (on the "
            f"command line --dtype float32 for a checkpoint; in Python, prepare model.float() with float32 "
            f"inputs) and convert the ONNX file to {low[0]} afterwards, or run the check on a runtime with "
            f"{low[0]} kernels (onnxruntime's CUDA provider, TensorRT).")
