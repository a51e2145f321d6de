"""The ``fxprep`` command: a thin layer over the library API.

Commands: ``prepare`` (prepare, verify, save, optionally export ONNX), ``check`` (can it be
captured, and how), ``show`` (a saved graph), ``survey`` (a model zoo, one subprocess per model) and
``demo``. ``--json`` prints one JSON object for scripts instead of the human output.

Exit codes (also in ``fxprep --help``)::

    0  success
    1  fxprep could not prepare the model (capture or a pass failed)
    2  usage error: bad spec, input, option, or the model itself failed on the inputs
    3  verification failed: the prepared module computes something else
    4  saving, loading or exporting failed
    130 interrupted

Errors are printed as the readable message of the :class:`~fxprep.errors.FxprepError` raised, never
as a traceback (``FXPREP_DEBUG=1`` shows it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import (
    EquivalenceError,
    ExportError,
    FxprepError,
    InvalidInput,
    ModelError,
    SerializationError,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY, EXIT_DELIVERY, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 fxprep could not prepare the model; 2 usage error (bad spec, input or "
    "option, or the model itself failed on the inputs); 3 verification failed; 4 save/load/export failed."
)

app = typer.Typer(
    help=f"Turn PyTorch models into clean, verified, module-level torch.fx graphs.\n\n{EXIT_CODES_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console()
err_console = Console(stderr=True)


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
        # Plain, unwrapped text: error messages get copied into issues and searched for.
        err_console.print(f"[bold red]error[/] ({type(err).__name__}, exit {code}):", highlight=False)
        err_console.print(str(err), markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _guarded(fn: Callable[[], int], as_json: bool) -> None:
    """Run a command body; FxprepErrors become readable messages and their exit codes."""
    try:
        code = fn()
    except typer.Exit:
        raise
    except (FxprepError, KeyboardInterrupt) as err:
        if os.environ.get("FXPREP_DEBUG"):
            raise
        raise _fail(err, as_json) from None
    except Exception as err:  # noqa: BLE001 - a bug: still no raw traceback unless asked
        if os.environ.get("FXPREP_DEBUG"):
            raise
        wrapped = FxprepError(
            f"internal error: {type(err).__name__}: {err}\nThis is a bug in fxprep (or in the model's own code). "
            f"Re-run with FXPREP_DEBUG=1 for the traceback and please report it."
        )
        raise _fail(wrapped, as_json) from None
    raise typer.Exit(code)


def _quiet_libraries() -> None:
    import logging
    import warnings

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
    typer.Option("--input", "-i", help="Example input DIMS[:DTYPE] or NAME=DIMS[:DTYPE] (repeatable), e.g. 1x3x224x224."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts) instead of text.")]
TracerOpt = Annotated[str, typer.Option("--tracer", help="auto, dynamo or fx.")]


def _prepare(spec: str, inputs: list[str] | None, tracer: str) -> tuple[Any, Any]:
    import fxprep

    from .specs import resolve

    built = resolve(spec, inputs or ())
    if built.example_inputs is None:
        err_console.print("[yellow]no example inputs (give --input): the result is not verified.[/]")
    gm = fxprep.prepare_model(built.model, example_inputs=built.example_inputs, tracer=tracer, name=built.name)
    return built, gm


def _print_report(report: Any) -> None:
    status = report.verification.status
    style = {"passed": "green", "failed": "red"}.get(status, "yellow")
    console.print(f"[bold {style}]{report.model}: {status}[/]", highlight=False)
    console.print(report.to_text(), markup=False, highlight=False, soft_wrap=True)


@app.command("prepare")
def prepare_command(
    spec: Annotated[str, typer.Argument(help="torchvision:NAME, timm:NAME, transformers:TYPE, demo:NAME or file.py:Factory")],
    input: InputOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Save the prepared module to this directory.")] = None,
    onnx: Annotated[Path | None, typer.Option("--onnx", help="Also export to this ONNX file (checked in onnxruntime).")] = None,
    tracer: TracerOpt = "auto",
    trust: Annotated[list[str] | None, typer.Option(
        "--trust", help="A package whose code the saved opaque parts may name (repeatable), e.g. torchvision "
                        "for its detectors; load with fxprep.load(DIR, trusted_modules=[...]).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare a model, verify it, print the report; optionally save it (-o) and export ONNX."""
    _quiet_libraries()

    def body() -> int:
        from .. import export, io

        built, gm = _prepare(spec, input, tracer)
        report = gm.fxprep_report
        result: dict[str, Any] = {"ok": True, "spec": spec, "report": report.to_dict()}
        if output is not None:
            try:  # -o replaces an earlier fxprep save at DIR, never anything else
                io.save(gm, output, example_inputs=built.example_inputs, trusted_modules=trust or (), overwrite=True)
            except SerializationError as err:  # the report is still worth showing
                if "trusted_modules=" in str(err):
                    err = SerializationError(f"{err}\nOn the command line, that is --trust PKG (repeatable).")
                if as_json:
                    print(json.dumps({**result, "ok": False, "exit_code": EXIT_DELIVERY, "error_type": type(err).__name__,
                                      "error": str(err)}, default=str))
                    return EXIT_DELIVERY
                _print_report(report)
                raise err from None
            result["saved_to"] = str(output)
        if onnx is not None:
            if built.example_inputs is None:
                raise InvalidInput("--onnx needs example inputs (--input).")
            result["onnx"] = {"path": str(onnx), "max_abs_diff": export.export_onnx(gm, built.example_inputs, onnx)}
        code = EXIT_VERIFY if report.verification.status == "failed" else EXIT_OK
        result["exit_code"] = code
        if as_json:
            print(json.dumps(result, default=str))
        else:
            _print_report(report)
            if output is not None:
                console.print(f"saved to [bold]{output}[/] (load with fxprep.load)")
            if onnx is not None:
                console.print(f"ONNX written to [bold]{onnx}[/]; onnxruntime max |diff| = {result['onnx']['max_abs_diff']:.3g}")
        return code

    _guarded(body, as_json)


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

        from .specs import resolve

        check_traceability = getattr(fxprep, "check_traceability", None)
        built = resolve(spec, input or ())
        if check_traceability is not None:
            result = check_traceability(built.model, example_inputs=built.example_inputs)
            # preparable: captured whole, or with some parts opaque (hybrid)
            ok = bool(getattr(result, "traceable", True) or getattr(result, "hybrid_ok", False))
            if as_json:
                data = result.to_dict() if hasattr(result, "to_dict") else {"result": str(result)}
                print(json.dumps({"ok": ok, "spec": spec, **data}, default=str))
            else:
                text = result.to_text() if hasattr(result, "to_text") else str(result)
                console.print(text, markup=False, highlight=False, soft_wrap=True)
            return EXIT_OK if ok else EXIT_FAILURE
        gm = fxprep.prepare_model(built.model, example_inputs=built.example_inputs, tracer=tracer, name=built.name)
        report = gm.fxprep_report
        if as_json:
            print(json.dumps({"ok": True, "spec": spec, "report": report.to_dict()}, default=str))
        else:
            _print_report(report)
        return EXIT_OK

    _guarded(body, as_json)


@app.command("show")
def show_command(
    directory: Annotated[Path, typer.Argument(help="A directory written by `fxprep prepare -o` / fxprep.save.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="auto, text, dot, svg or html.")] = "auto",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file (format from its suffix).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a saved graph: a text table, or DOT / SVG / HTML (SVG needs graphviz's `dot`).

    Reads only the JSON files: nothing is imported or run, so it is safe on files from anyone."""

    def body() -> int:
        from ..io import inspect_saved
        from .show import render_dot, render_html

        view = inspect_saved(directory)
        kind = fmt
        if kind == "auto":
            suffix = output.suffix.lstrip(".") if output is not None else ""
            kind = suffix if suffix in ("dot", "svg", "html") else ("svg" if output and shutil.which("dot") else "text")
        if kind not in ("text", "dot", "svg", "html"):
            raise InvalidInput(f"--format must be auto, text, dot, svg or html, not {fmt!r}.")
        if as_json:
            print(json.dumps(view, default=str))
            return EXIT_OK
        if kind == "text":
            table = Table(title=f"{view['class_name']}: {len(view['nodes'])} nodes", show_lines=False)
            for col in ("#", "node", "op", "target", "inputs"):
                table.add_column(col, overflow="fold")
            for i, n in enumerate(view["nodes"]):
                table.add_row(str(i), n["name"], n["op"], n["what"], ", ".join(n["inputs"]))
            console.print(table)
            return EXIT_OK
        dot = render_dot(view)
        svg = None
        if kind in ("svg", "html") and shutil.which("dot"):
            svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
        elif kind == "svg":
            raise InvalidInput("--format svg needs graphviz (`dot` on PATH); use --format dot or html instead.")
        text = {"dot": dot, "svg": svg, "html": render_html(view, svg)}[kind]
        if output is None:
            print(text)
        else:
            output.write_text(text or "")
            console.print(f"wrote {output} ({kind})")
        return EXIT_OK

    _guarded(body, as_json)


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
                            console=err_console, disable=as_json)
        with progress:
            task = progress.add_task(f"survey {zoo}", total=len(specs))

            def on_result(r: Any) -> None:
                progress.advance(task)
                progress.console.print(f"{r.status:>13}  {r.spec}  {r.seconds:.1f}s" + (f"  {r.error_type}" if r.error_type else ""))

            result = run_survey(zoo, specs, jobs=jobs, timeout=timeout, on_result=on_result)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(result.to_markdown())
        json_path = output.with_suffix(".json")
        json_path.write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
        summary = result.summary()
        if as_json:
            print(json.dumps({"ok": True, "report": str(output), "json": str(json_path), "summary": summary}))
        else:
            table = Table(title=f"{zoo} survey")
            for col in ("models", "passed", "opaque", "failed", "median prepare s", "wall s"):
                table.add_column(col, justify="right")
            table.add_row(str(summary["models"]), str(summary["passed"]), str(summary["opaque"]), str(summary["failed"]),
                          str(summary["median_prepare_seconds"]), str(summary["wall_seconds"]))
            console.print(table)
            console.print(f"report: {output} and {json_path}")
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
            start = time.perf_counter()
            model, inputs = d.build()
            row: dict[str, Any] = {"name": d.name, "description": d.description}
            try:
                gm = fxprep.prepare_model(model, example_inputs=inputs, name=d.name, **dict(d.options))
            except FxprepError as err:
                row.update(ok=False, error_type=type(err).__name__, error=str(err))
                if isinstance(err, EquivalenceError):
                    code = EXIT_VERIFY
                elif not isinstance(err, (fxprep.TraceFailure, ModelError)):
                    code = max(code, EXIT_FAILURE)
                if not as_json:
                    console.print(f"[bold]{d.name}[/]: {d.description}")
                    err_console.print(f"[yellow]{d.name}: {type(err).__name__}[/]", highlight=False)
                    err_console.print(str(err), markup=False, highlight=False, soft_wrap=True)
            else:
                row.update(ok=gm.fxprep_report.verification.status == "passed", report=gm.fxprep_report.to_dict())
                if not as_json:
                    console.print(f"[bold]{d.name}[/]: {d.description}")
                    _print_report(gm.fxprep_report)
            row["seconds"] = round(time.perf_counter() - start, 3)
            rows.append(row)
        if as_json:
            print(json.dumps({"ok": code == EXIT_OK, "demos": rows}, default=str))
        else:
            done = sum(r["ok"] for r in rows)
            console.print(f"{done}/{len(rows)} demos prepared and verified.")
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
