"""``fxprep prepare``: build the model a spec names, prepare and verify it, print the report; then
save it (``-o``), export ONNX (``--onnx``) and write the graph view (``--show``).

The order is the user's time: every argument a string can show wrong is checked first, before torch
is imported (:mod:`.validate`); then what needs torch (``-o``'s exact rule, ``--device``); then the
model is built and what needs it is checked (``--exclude``, ``--dynamic`` names); only then does the
slow work start. The report is short by default (``--verbose``: every module added), and the
command's own time is said after it, so that the seconds add up to what the user waited.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import InvalidInput, SerializationError
from . import console as out
from . import validate
from .outcome import EXIT_DELIVERY, EXIT_OK, EXIT_VERIFY, guarded, quiet_libraries

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


def _since_process_start() -> float:
    """Seconds since this process started (Linux: /proc), else 0: the interpreter's start and the
    command line's parsing count in the command's time."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Clock:
    """The command's own time, phase by phase, from the process's start: what it says after the
    report adds up to the time the user waited."""

    def __init__(self) -> None:
        started = _since_process_start()
        self.mark = time.perf_counter()
        self.start = self.mark - started
        self.phases: dict[str, float] = {"starting": started} if started else {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.mark
        self.mark = now

    def line(self) -> str:
        self.lap("other")
        total = time.perf_counter() - self.start
        parts = " + ".join(f"{k} {v:.1f}s" for k, v in self.phases.items() if v >= 0.05 or k == "prepare_model")
        return f"command: {total:.1f}s = {parts}"


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
    static: Annotated[bool, typer.Option("--static", help="Capture for the example's shapes only (no dimension found "
                                                          "or declared dynamic).")] = False,
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
                                                              "or auto (default: the checkpoint's own); the weights "
                                                              "are cast to it.")] = None,
    trust: Annotated[list[str] | None, typer.Option(
        "--trust", help="A package whose code the saved opaque parts may name (repeatable), e.g. torchvision "
                        "for its detectors; load with fxprep.load(DIR, trusted_modules=[...]).")] = None,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="A callable beyond fxprep's default list the saved graph may name (repeatable), e.g. "
                        "torch.special.xlogy or Tensor.resize_; load with fxprep.load(DIR, allow=[...]).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="The whole report: every module added, every "
                                                                  "reused module unrolled, every input check.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Prepare a model, verify it, print the report; optionally save it (-o), export ONNX, write the view."""
    clock = Clock()

    def body() -> int:
        validate.check_prepare(spec, inputs=input or [], verify_inputs=verify_input or [], output=output, onnx=onnx,
                               show=show, tracer=tracer, control_flow=control_flow, dynamic=dynamic or [],
                               static=static, verify=verify, verify_grad=verify_grad, meta=meta, device=device,
                               dtype=dtype)
        quiet_libraries()
        import fxprep

        from . import checkpoint as ckpt
        from . import examples, flags

        if output is not None:
            flags.check_output_dir(output)
        clock.lap("imports")
        from_checkpoint = validate.checkpoint_dir(spec) is not None
        built = _built_model(spec, input, meta=meta, device=device, dtype=dtype)
        if built.example_inputs is None:
            if onnx is not None:
                raise InvalidInput("--onnx needs example inputs (--input).")
            out.warn("no example inputs (give --input): the result is not verified.")
        options: dict[str, Any] = {
            "tracer": tracer, "name": built.name, "verify": "grad" if verify_grad else verify,
            "progress": progress, "control_flow": control_flow,
        }
        if static:
            options["dynamic"] = False
        elif dynamic:
            options["dynamic"] = flags.parse_dynamic(dynamic, built.model, built.example_inputs)
        if verify_input:
            options["verify_inputs"] = flags.verify_inputs(verify_input, built.model)
        excluded = flags.modules_to_exclude(built.model, exclude or [])
        classes = flags.classes_to_exclude(built.model, exclude_class or [])
        clock.lap("building the model")
        if from_checkpoint:
            gm = ckpt.prepare(built, spec, meta=meta, device=device, dtype=dtype, modules_to_exclude=excluded,
                              classes=classes, options=options, clock=clock)
        else:
            with examples.inputs_explained(built.name, built.model, built.input_options):
                gm = fxprep.prepare_model(built.model, excluded, classes, example_inputs=built.example_inputs,
                                          **options)
            clock.lap("prepare_model")
        report = gm.fxprep_report
        result: dict[str, Any] = {"ok": True, "spec": spec, "report": report.to_dict()}
        if not as_json:
            out.print_report(report, verbose=verbose)
        if show is not None:
            show.parent.mkdir(parents=True, exist_ok=True)  # `--show out/x.html -o out/x`: out/ made by neither yet
            fxprep.show(gm, show, example_inputs=built.example_inputs)
            result["view"] = str(show)
            clock.lap("graph view")
            if not as_json:
                out.say(f"graph view written to {show}")
        if output is not None:
            saved = _save_output(gm, output, built.example_inputs, (trust or [], allow or []), result, as_json)
            clock.lap("saving")
            if not saved:
                return EXIT_DELIVERY
        if onnx is not None:
            from ..io import export

            result["onnx"] = {"path": str(onnx), "max_abs_diff": export.export_onnx(gm, built.example_inputs, onnx)}
            clock.lap("ONNX export")
            if not as_json:
                out.say(f"ONNX written to {onnx}; onnxruntime max |diff| = {result['onnx']['max_abs_diff']:.3g}")
        code = EXIT_VERIFY if report.verification.status == "failed" else EXIT_OK
        result["exit_code"] = code
        line = clock.line()
        result["command_seconds"] = {k: round(v, 3) for k, v in clock.phases.items()}
        if as_json:
            print(json.dumps(result, default=str))
        else:
            out.say(line)
        return code

    guarded(body, as_json)


def _built_model(spec: str, input: list[str] | None, *, meta: bool, device: str | None, dtype: str | None) -> Any:
    """The model and example inputs ``spec`` names (:mod:`fxprep.cli.specs`, or a checkpoint
    directory, the only kind ``--meta``/``--device``/``--dtype`` apply to)."""
    from . import checkpoint as ckpt
    from . import flags
    from .specs import resolve

    if validate.checkpoint_dir(spec) is not None:
        return ckpt.build(spec, flags.split_inputs(input or ()), meta=meta, device=device, dtype=dtype)
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
