"""The ``fxprep`` command: a thin layer over the library API.

Commands: ``prepare`` (prepare, verify, save, optionally export ONNX and write the graph view),
``check`` (can it be captured, and how), ``show`` (a saved graph as an HTML page, text, DOT or SVG),
``survey`` (a model zoo, one subprocess per model) and ``demo``. ``--json`` prints one JSON object
for scripts instead of the human output.

Exit codes (also in ``fxprep --help``)::

    0  success
    1  fxprep could not prepare the model (capture or a pass failed)
    2  usage error: bad spec, input, option, or the model itself failed on the inputs
    3  verification failed: the prepared module computes something else
    4  saving, loading or exporting failed (including an -o that cannot be written)
    130 interrupted

Errors are printed as the readable message of the :class:`~fxprep.errors.FxprepError` raised, never
as a traceback (``FXPREP_DEBUG=1`` shows it); fxprep's own warnings are printed in full on standard
error, other libraries' warnings are silenced. Progress is shown on a terminal (``--quiet`` hides it,
``--progress`` forces plain lines into a pipe or a log).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import (
    EquivalenceError,
    ExportError,
    FxprepError,
    FxprepWarning,
    InvalidInput,
    ModelError,
    SerializationError,
)
from . import console as out

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY, EXIT_DELIVERY, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 fxprep could not prepare the model; 2 usage error (bad spec, input or "
    "option, or the model itself failed on the inputs); 3 verification failed; 4 save/load/export failed "
    "(including an -o that cannot be written)."
)

app = typer.Typer(
    help=f"Turn PyTorch models into clean, verified, module-level torch.fx graphs.\n\n{EXIT_CODES_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def exit_code_for(err: BaseException) -> int:
    """The documented exit code of an exception."""
    if isinstance(err, EquivalenceError):
        return EXIT_VERIFY
    if isinstance(err, (SerializationError, ExportError)):
        return EXIT_DELIVERY
    if isinstance(err, (InvalidInput, ModelError)):
        return EXIT_USAGE
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILURE


def _fail(err: BaseException, as_json: bool) -> typer.Exit:
    code = exit_code_for(err)
    if as_json:
        print(json.dumps({"ok": False, "exit_code": code, "error_type": type(err).__name__, "error": str(err)}))
    else:
        out.error(type(err).__name__, code, str(err))
    return typer.Exit(code)


def _file_error(err: OSError) -> SerializationError:
    """A file the command could not read or write (a full disk, a read-only place): exit 4, in words."""
    where = f" {err.filename}" if err.filename else ""
    return SerializationError(f"cannot write or read{where}: {err.strerror or err}.")


def _guarded(fn: Callable[[], int], as_json: bool) -> None:
    """Run a command body; FxprepErrors become readable messages and their exit codes, fxprep's own
    warnings are printed in full on standard error, and any other exception is an internal error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", FxprepWarning)
        try:
            code = fn()
        except typer.Exit:
            raise
        except (FxprepError, KeyboardInterrupt, OSError) as err:
            if os.environ.get("FXPREP_DEBUG"):
                raise
            raise _fail(_file_error(err) if isinstance(err, OSError) else err, as_json) from None
        except Exception as err:  # noqa: BLE001 - a bug: still no raw traceback unless asked
            if os.environ.get("FXPREP_DEBUG"):
                raise
            wrapped = FxprepError(
                f"internal error: {type(err).__name__}: {err}\nThis is a bug in fxprep (or in the model's own code). "
                f"Re-run with FXPREP_DEBUG=1 for the traceback and please report it."
            )
            raise _fail(wrapped, as_json) from None
        finally:
            for w in caught:
                if issubclass(w.category, FxprepWarning):
                    out.warn(str(w.message))
    raise typer.Exit(code)


def _quiet_libraries() -> None:
    import logging

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("torch").setLevel(logging.ERROR)
    try:  # Dynamo / export log their guard and shape warnings through torch._logging
        import torch._logging

        torch._logging.set_logs(all=logging.ERROR)
    except (ImportError, TypeError, ValueError):
        pass


InputOpt = Annotated[
    list[str] | None,
    typer.Option("--input", "-i", help="Example input DIMS[:DTYPE] or NAME=DIMS[:DTYPE] (repeatable, or comma-separated), "
                                       "e.g. 1x3x224x224 or input_ids=1x16:int64."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts) instead of text.")]
TracerOpt = Annotated[str, typer.Option("--tracer", help="auto, dynamo or fx.")]
ProgressOpt = Annotated[
    bool | None,
    typer.Option("--progress/--quiet", " /-q", help="Show the stages of the work: by default on a terminal only; "
                                                   "--progress also into a pipe or log (plain lines), --quiet never."),
]


DYNAMIC_HELP = (
    "Dynamic dimensions for the Dynamo tracer (repeatable): 'batch' (dim 0 of every input), or "
    "NAME:DIM=SYMBOL[,DIM=SYMBOL...] per forward() argument, e.g. input_ids:0=batch,1=seq; dimensions "
    "with the same SYMBOL share one size. The result is also verified on a second input size."
)
EXCLUDE_CLASS_HELP = (
    "Keep every module of this class as a leaf (repeatable; subclasses included): a class name used in "
    "the model (Bottleneck), its qualified name (torchvision.models.resnet.Bottleneck), or any importable "
    "class path (mypkg.layers.MyBlock)."
)


def _print_report(report: Any) -> None:
    out.print_report(report)


@app.command("prepare")
def prepare_command(
    spec: Annotated[str, typer.Argument(help="A local transformers checkpoint directory (config.json + safetensors), "
                                             "torchvision:NAME, timm:NAME, transformers:TYPE, demo:NAME or file.py:Factory")],
    input: InputOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Save the prepared module to this directory.")] = None,
    onnx: Annotated[Path | None, typer.Option("--onnx", help="Also export to this ONNX file (checked in onnxruntime).")] = None,
    show: Annotated[Path | None, typer.Option("--show", help="Also write the graph view (HTML, with every edge's shape) to this file.")] = None,
    tracer: TracerOpt = "auto",
    control_flow: Annotated[str | None, typer.Option(
        "--control-flow", help="'rewrite': data-dependent ifs become torch.where / torch.cond (reported site by site).",
    )] = None,
    dynamic: Annotated[list[str] | None, typer.Option("--dynamic", help=DYNAMIC_HELP)] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the prepared module against the original on the inputs.")] = True,
    verify_grad: Annotated[bool, typer.Option("--verify-grad", help="Also compare gradients (implies --verify).")] = False,
    verify_input: Annotated[list[str] | None, typer.Option(
        "--verify-input", help="Another input to verify on (repeatable; one call each, its tensors comma-separated, "
                               "same forms as --input), e.g. one that takes the other branch.")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        "--exclude", help="Keep this module (qualified name, e.g. backbone.layer4) as a leaf (repeatable).")] = None,
    exclude_class: Annotated[list[str] | None, typer.Option("--exclude-class", help=EXCLUDE_CLASS_HELP)] = None,
    progress: ProgressOpt = None,
    meta: Annotated[bool, typer.Option("--meta", help="Checkpoint directory only: prepare on the meta device (no weights "
                                                      "in memory), then load the weights and verify.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="Checkpoint directory only: where the weights go "
                                                                "(cpu, cuda, cuda:1...; default cpu).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Checkpoint directory only: float32, bfloat16, float16 "
                                                              "or auto (default: the checkpoint's own).")] = None,
    trust: Annotated[list[str] | None, typer.Option(
        "--trust", help="A package whose code the saved opaque parts may name (repeatable), e.g. torchvision "
                        "for its detectors; load with fxprep.load(DIR, trusted_modules=[...]).")] = None,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="A callable beyond fxprep's default list the saved graph may name (repeatable), e.g. "
                        "torch.special.xlogy or Tensor.resize_; load with fxprep.load(DIR, allow=[...]).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare a model, verify it, print the report; optionally save it (-o), export ONNX, write the view."""
    _quiet_libraries()

    def body() -> int:
        import fxprep

        from .. import export
        from . import checkpoint as ckpt
        from . import examples, flags

        if verify_grad and not verify:
            raise InvalidInput("--verify-grad compares gradients during verification; it cannot go with --no-verify.")
        if output is not None:
            flags.check_output_dir(output)
        from_checkpoint = ckpt.is_checkpoint(spec)
        built = _built_model(spec, input, meta=meta, device=device, dtype=dtype)
        if built.example_inputs is None:
            if onnx is not None:
                raise InvalidInput("--onnx needs example inputs (--input).")
            out.warn("no example inputs (give --input): the result is not verified.")
        options: dict[str, Any] = {
            "tracer": tracer, "name": built.name, "verify": "grad" if verify_grad else verify,
            "progress": progress, "control_flow": control_flow,
        }
        if dynamic:
            options["dynamic"] = flags.parse_dynamic(dynamic, built.model, built.example_inputs)
        if verify_input:
            options["verify_inputs"] = flags.verify_inputs(verify_input, built.model)
        excluded = flags.modules_to_exclude(built.model, exclude or [])
        classes = flags.classes_to_exclude(built.model, exclude_class or [])
        if from_checkpoint:
            gm = ckpt.prepare(built, spec, meta=meta, device=device, dtype=dtype, modules_to_exclude=excluded,
                              classes=classes, options=options)
        else:
            with examples.inputs_explained(built.name, built.model, built.input_options):
                gm = fxprep.prepare_model(built.model, excluded, classes, example_inputs=built.example_inputs,
                                          **options)
        report = gm.fxprep_report
        result: dict[str, Any] = {"ok": True, "spec": spec, "report": report.to_dict()}
        if not as_json:
            _print_report(report)
        if show is not None:
            fxprep.show(gm, show, example_inputs=built.example_inputs)
            result["view"] = str(show)
            if not as_json:
                out.say(f"graph view written to {show}")
        if output is not None and not _save_output(gm, output, built.example_inputs, (trust or [], allow or []), result,
                                                   as_json):
            return EXIT_DELIVERY
        if onnx is not None:
            result["onnx"] = {"path": str(onnx), "max_abs_diff": export.export_onnx(gm, built.example_inputs, onnx)}
            if not as_json:
                out.say(f"ONNX written to {onnx}; onnxruntime max |diff| = {result['onnx']['max_abs_diff']:.3g}")
        code = EXIT_VERIFY if report.verification.status == "failed" else EXIT_OK
        result["exit_code"] = code
        if as_json:
            print(json.dumps(result, default=str))
        return code

    _guarded(body, as_json)


def _built_model(spec: str, input: list[str] | None, *, meta: bool, device: str | None, dtype: str | None) -> Any:
    """The model and example inputs ``spec`` names (:mod:`fxprep.cli.specs`, or a checkpoint
    directory, the only kind ``--meta``/``--device``/``--dtype`` apply to)."""
    from . import checkpoint as ckpt
    from . import flags
    from .specs import resolve

    if ckpt.is_checkpoint(spec):
        return ckpt.build(spec, flags.split_inputs(input or ()), meta=meta, device=device, dtype=dtype)
    if meta or device or dtype:
        raise InvalidInput(f"--meta, --device and --dtype apply to a checkpoint directory (config.json + "
                           f"safetensors); {spec!r} is not one.")
    return resolve(spec, flags.split_inputs(input or ()))


def _save_output(gm: Any, output: Path, example_inputs: Any, names: tuple[list[str], list[str]],
                 result: dict[str, Any], as_json: bool) -> bool:
    """``-o``: save ``gm`` (replacing an earlier fxprep save at ``output``, never anything else); ``names``:
    the --trust packages and the --allow callables.
    False when the save was refused and said so in the JSON result (exit 3); raised otherwise, the
    report printed before it still standing."""
    from .. import io

    try:
        io.save(gm, output, example_inputs=example_inputs, trusted_modules=names[0], allow=names[1], overwrite=True)
    except OSError as err:
        raise SerializationError(f"-o {output}: cannot save there ({err.strerror or err}"
                                 f"{': ' + str(err.filename) if err.filename else ''}).") from err
    except SerializationError as err:
        if "trusted_modules=" in str(err):
            err = SerializationError(f"{err}\nOn the command line, that is --trust PKG (repeatable).")
        elif "allow=" in str(err):
            err = SerializationError(f"{err}\nOn the command line, that is --allow NAME (repeatable).")
        elif not str(err).startswith("-o "):
            err = SerializationError(f"-o {output}: {err}")
        if as_json:
            print(json.dumps({**result, "ok": False, "exit_code": EXIT_DELIVERY, "error_type": type(err).__name__,
                              "error": str(err)}, default=str))
            return False
        raise err from None
    result["saved_to"] = str(output)
    if not as_json:
        out.say(f"saved to {output} (load with fxprep.load)")
    return True


@app.command("check")
def check_command(
    spec: Annotated[str, typer.Argument(help="Model spec, as for prepare.")],
    input: InputOpt = None,
    tracer: TracerOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Can the model be captured? Prints each tracer's attempt and what blocks it (exit 1 if none can)."""
    _quiet_libraries()

    def body() -> int:
        import fxprep

        from .flags import split_inputs
        from .specs import resolve

        built = resolve(spec, split_inputs(input or ()))
        result = fxprep.check_traceability(built.model, example_inputs=built.example_inputs)
        # preparable: captured whole, or with some parts opaque (hybrid)
        ok = bool(getattr(result, "traceable", True) or getattr(result, "hybrid_ok", False))
        if as_json:
            print(json.dumps({"ok": ok, "spec": spec, **result.to_dict()}, default=str))
        else:
            out.say(result.to_text())
        return EXIT_OK if ok else EXIT_FAILURE

    _guarded(body, as_json)


SHOW_FORMATS = ("auto", "html", "text", "dot", "svg")


@app.command("show")
def show_command(
    directory: Annotated[Path, typer.Argument(help="A directory written by `fxprep prepare -o` / fxprep.save.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="auto (from -o's suffix; html for .html, text without -o), "
                                                             "html, text, dot or svg (svg needs graphviz's `dot`).")] = "auto",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a saved graph: a self-contained HTML page (what fxprep changed, shapes, report, search),
    a text table, or Graphviz DOT / SVG.

    Reads only the JSON files: nothing is imported or run, so it is safe on files from anyone."""

    def body() -> int:
        from ..view import describe_saved, render_dot, render_html

        kind = fmt
        if kind == "auto":
            suffix = output.suffix.lstrip(".").lower() if output is not None else ""
            kind = {"htm": "html"}.get(suffix, suffix) if suffix in ("html", "htm", "dot", "svg") else \
                ("html" if output is not None else "text")
        if kind not in SHOW_FORMATS[1:]:
            raise InvalidInput(f"--format must be one of {', '.join(SHOW_FORMATS)}, not {fmt!r}.")
        view = describe_saved(directory)
        if as_json:
            print(json.dumps(view, default=str))
            return EXIT_OK
        if kind == "text":
            _show_table(view)
            return EXIT_OK
        if kind == "svg" and not shutil.which("dot"):
            raise InvalidInput("--format svg needs graphviz (`dot` on PATH); use --format html or dot instead.")
        if kind == "html":
            text = render_html(view)
        else:
            text = render_dot(view)
            if kind == "svg":
                text = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, check=True).stdout
        if output is None:
            print(text)
        else:
            output.write_text(text, encoding="utf-8")
            out.say(f"wrote {output} ({kind}, {len(view['nodes'])} nodes)")
        return EXIT_OK

    _guarded(body, as_json)


def _show_table(view: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{view['title']}: {len(view['nodes'])} nodes", show_lines=False)
    for col in ("#", "node", "op", "target", "kind", "value", "inputs"):
        table.add_column(col, overflow="fold")
    for i, n in enumerate(view["nodes"]):
        what = f"{n['module']}: {n['label']}" if n.get("module") else n.get("label", "")
        values = ", ".join("x".join(map(str, v["shape"])) + f" {v['dtype']}" for v in n.get("values") or [])
        table.add_row(str(i), n["name"], n["op"], what, view["kinds"][n["kind"]]["label"], values, ", ".join(n["inputs"]))
    out.show(table)


# --- survey -------------------------------------------------------------------------------------
@app.command("survey")
def survey_command(
    zoo: Annotated[str, typer.Option("--zoo", help="torchvision, timm, transformers or demo.")],
    filter: Annotated[str | None, typer.Option("--filter", help="Only specs matching this regex.")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Models prepared in parallel.")] = 1,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds per model before it is killed.")] = 600.0,
    output: Annotated[Path, typer.Option("--output", "-o", help="Markdown report; the JSON goes next to it.")] = Path("survey.md"),
    as_json: JsonOpt = False,
) -> None:
    """Prepare every model of a zoo, each in its own subprocess, and write a markdown + JSON report."""
    _quiet_libraries()

    def body() -> int:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from .specs import zoo_specs
        from .survey import survey as run_survey

        specs = zoo_specs(zoo, filter)
        if not specs:
            raise InvalidInput(f"no model of the {zoo} zoo matches --filter {filter!r}.")
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=out.console(stderr=True), disable=as_json)
        with progress:
            task = progress.add_task(f"survey {zoo}", total=len(specs))

            def on_result(r: Any) -> None:
                progress.advance(task)
                progress.console.print(f"{r.status:>13}  {r.spec}  {r.seconds:.1f}s" + (f"  {r.error_type}" if r.error_type else ""),
                                       markup=False)

            result = run_survey(zoo, specs, jobs=jobs, timeout=timeout, on_result=on_result)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(result.to_markdown())
        json_path = output.with_suffix(".json")
        json_path.write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
        summary = result.summary()
        if as_json:
            print(json.dumps({"ok": True, "report": str(output), "json": str(json_path), "summary": summary}))
        else:
            from rich.table import Table

            table = Table(title=f"{zoo} survey")
            for col in ("models", "passed", "opaque", "failed", "median prepare s", "wall s"):
                table.add_column(col, justify="right")
            table.add_row(str(summary["models"]), str(summary["passed"]), str(summary["opaque"]), str(summary["failed"]),
                          str(summary["median_prepare_seconds"]), str(summary["wall_seconds"]))
            out.show(table)
            out.say(f"report: {output} and {json_path}")
        return EXIT_OK

    _guarded(body, as_json)


# --- demo ---------------------------------------------------------------------------------------
@app.command("demo")
def demo_command(
    only: Annotated[str | None, typer.Option("--only", help="Run only the demos whose name matches this regex.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare the built-in examples (AIMET's three, resnet18, a tiny BERT) and print each report."""
    _quiet_libraries()

    def body() -> int:
        import torch

        import fxprep

        from .demo import DEMOS

        torch.set_num_threads(min(torch.get_num_threads(), 2))
        rows = []
        code = EXIT_OK
        for d in DEMOS:
            if only and not re.search(only, d.name):
                continue
            row: dict[str, Any] = {"name": d.name, "description": d.description}
            missing = d.missing()
            if missing is not None:
                row.update(ok=None, skipped=f"needs {missing} (pip install {missing})")
                rows.append(row)
                if not as_json:
                    out.say(f"{d.name}: skipped: it needs {missing}, which is not installed (pip install {missing})")
                continue
            start = time.perf_counter()
            model, inputs = d.build()
            try:
                gm = fxprep.prepare_model(model, example_inputs=inputs, name=d.name, **dict(d.options))
            except FxprepError as err:
                row.update(ok=False, error_type=type(err).__name__, error=str(err))
                if isinstance(err, EquivalenceError):
                    code = EXIT_VERIFY
                elif not isinstance(err, (fxprep.TraceFailure, ModelError)):
                    code = max(code, EXIT_FAILURE)
                if not as_json:
                    out.say(f"{d.name}: {d.description}", style="bold")
                    out.say(f"{d.name}: {type(err).__name__}", stderr=True, style="yellow")
                    out.say(str(err), stderr=True)
            else:
                row.update(ok=gm.fxprep_report.verification.status == "passed", report=gm.fxprep_report.to_dict())
                if not as_json:
                    out.say(f"{d.name}: {d.description}", style="bold")
                    _print_report(gm.fxprep_report)
            row["seconds"] = round(time.perf_counter() - start, 3)
            rows.append(row)
        if as_json:
            print(json.dumps({"ok": code == EXIT_OK, "demos": rows}, default=str))
        else:
            done = sum(bool(r["ok"]) for r in rows)
            ran = sum(r["ok"] is not None for r in rows)
            skipped = len(rows) - ran
            out.say(f"{done}/{ran} demos prepared and verified" + (f" ({skipped} skipped)." if skipped else "."))
        return code

    _guarded(body, as_json)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``fxprep``)."""
    try:
        app(args=argv, prog_name="fxprep")
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
