"""The ``fxprep`` commands other than ``prepare``: ``check`` (can the model be captured, and how),
``show`` (a saved graph as HTML, text, DOT or SVG), ``survey`` (a model zoo, one subprocess per
model) and ``demo`` (the built-in examples).

Each body runs in :func:`.outcome.guarded` and imports torch there, not at import: ``fxprep --help``
reads these signatures without it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import EquivalenceError, FxprepError, InvalidInput, ModelError
from . import console as out
from . import validate
from .advice import in_flag_terms
from .outcome import EXIT_FAILURE, EXIT_OK, EXIT_VERIFY, guarded, quiet_libraries
from .prepare import InputOpt, JsonOpt, TracerOpt


def check_command(
    spec: Annotated[str, typer.Argument(help="Model spec, as for prepare.")],
    input: InputOpt = None,
    tracer: TracerOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Can the model be captured? Prints each tracer's attempt and what blocks it (exit 1 if none can)."""

    def body() -> int:
        validate.check_inputs("--input", input or [])
        validate.check_spec(spec, meta=False, checkpoint_options=False)
        quiet_libraries()
        import fxprep

        from .checkpoint import build
        from .flags import split_inputs
        from .specs import resolve

        if validate.checkpoint_dir(spec) is not None:
            built = build(spec, split_inputs(input or ()), meta=False, device=None, dtype=None)
        else:
            built = resolve(spec, split_inputs(input or ()))
        result = fxprep.check_traceability(built.model, example_inputs=built.example_inputs)
        # preparable: captured whole, or with some parts opaque (hybrid)
        ok = bool(getattr(result, "traceable", True) or getattr(result, "hybrid_ok", False))
        if as_json:
            print(json.dumps({"ok": ok, "spec": spec, **result.to_dict()}, default=str))
        else:
            out.say(in_flag_terms(result.to_text()))
        return EXIT_OK if ok else EXIT_FAILURE

    guarded(body, as_json)


SHOW_FORMATS = ("auto", "html", "text", "dot", "svg")


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

    guarded(body, as_json)


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


def survey_command(
    zoo: Annotated[str, typer.Option("--zoo", help="torchvision, timm, transformers or demo.")],
    filter: Annotated[str | None, typer.Option("--filter", help="Only specs matching this regex.")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Models prepared in parallel.")] = 1,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds per model before it is killed.")] = 600.0,
    output: Annotated[Path, typer.Option("--output", "-o", help="Markdown report; the JSON goes next to it.")] = Path("survey.md"),
    as_json: JsonOpt = False,
) -> None:
    """Prepare every model of a zoo, each in its own subprocess, and write a markdown + JSON report."""

    def body() -> int:
        quiet_libraries()
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

    guarded(body, as_json)


def demo_command(
    only: Annotated[str | None, typer.Option("--only", help="Run only the demos whose name matches this regex.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prepare the built-in examples (AIMET's three, resnet18, a tiny BERT) and print each report."""

    def body() -> int:
        quiet_libraries()
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
                    out.print_report(gm.fxprep_report)
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

    guarded(body, as_json)
