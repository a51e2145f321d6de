"""The ``fxprep`` command: outputs, JSON for scripts, exit codes, and no raw tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxprep import io
from fxprep.cli.specs import SpecError, inputs_from_strings, parse_input, resolve, zoo_specs

from .helpers_cli import as_json, invoke

pytestmark = pytest.mark.usefixtures("_restore_process_state")  # tests/conftest.py: undo what the CLI changes


# --- specs and inputs ---------------------------------------------------------------------------
def test_parse_input_forms():
    name, t = parse_input("1x3x8x8")
    assert name is None and t.shape == (1, 3, 8, 8) and t.dtype == torch.float32
    name, t = parse_input("input_ids=2x5:int64")
    assert name == "input_ids" and t.dtype == torch.int64 and int(t.max()) < 100
    assert isinstance(inputs_from_strings(["1x2", "3"]), tuple)
    assert set(inputs_from_strings(["a=1x2", "b=3:bool"])) == {"a", "b"}
    for bad in ["1x", "x=1xfoo", "1x2:complex7"]:
        with pytest.raises(SpecError):
            parse_input(bad)
    with pytest.raises(SpecError, match="mix"):
        inputs_from_strings(["a=1", "2"])


def test_resolve_specs():
    built = resolve("demo:ModelWithElementwiseAddOp")
    assert len(built.example_inputs) == 2
    assert resolve("torchvision:resnet18").example_inputs[0].shape == (1, 3, 224, 224)
    det = resolve("torchvision:ssdlite320_mobilenet_v3_large")
    assert isinstance(det.example_inputs[0], list) and det.example_inputs[0][0].shape == (3, 320, 320)
    bert = resolve("transformers:bert")
    assert bert.model.config.hidden_size == 32 and set(bert.example_inputs) == {"input_ids"}
    for bad in ["resnet18", "torchvision:nope", "keras:resnet", "transformers:NoSuchModel", "demo:nope"]:
        with pytest.raises(SpecError):
            resolve(bad)


def test_resolve_file_spec(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            EXAMPLE_INPUTS = (torch.randn(2, 4),)

            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                return torch.nn.functional.relu(self.fc(x))
    """))
    built = resolve(f"{path}:Net")
    assert built.example_inputs[0].shape == (2, 4)
    assert resolve(f"{path}:Net", ["5x4"]).example_inputs[0].shape == (5, 4)
    with pytest.raises(SpecError, match="defines no"):
        resolve(f"{path}:Missing")


def test_zoo_lists():
    specs = zoo_specs("torchvision")
    assert "torchvision:resnet50" in specs and "torchvision:fasterrcnn_resnet50_fpn" in specs and len(specs) > 100
    assert zoo_specs("torchvision", "^torchvision:resnet(18|34)$") == ["torchvision:resnet18", "torchvision:resnet34"]
    with pytest.raises(SpecError):
        zoo_specs("keras")


# --- prepare / check / show ---------------------------------------------------------------------
def test_prepare_saves_and_prints_the_report(tmp_path):
    out = tmp_path / "saved"
    result = invoke("prepare", "demo:ModelWithReusedReLU", "-o", str(out), "--verbose")
    assert result.exit_code == 0, result.output
    assert "verification: passed" in result.stdout and "relu_1" in result.stdout
    loaded = io.load(out)
    built = resolve("demo:ModelWithReusedReLU")
    assert torch.allclose(loaded(*built.example_inputs), built.model(*built.example_inputs))


def test_prepare_json(tmp_path):
    result = invoke("prepare", "demo:ModelWithElementwiseAddOp", "--input", "1x3x16x16", "--input", "1x3x16x16", "--json")
    assert result.exit_code == 0
    data = as_json(result)
    assert data["ok"] and data["exit_code"] == 0
    assert data["report"]["verification"]["status"] == "passed"
    assert data["report"]["inputs"] == "Tensor[1x3x16x16, float32], Tensor[1x3x16x16, float32]"


def test_prepare_with_onnx(tmp_path):
    result = invoke("prepare", "demo:ModelWithFunctionalReLU", "--onnx", str(tmp_path / "m.onnx"), "--json")
    assert result.exit_code == 0, result.output
    assert as_json(result)["onnx"]["max_abs_diff"] < 1e-4
    assert (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("args, code, text", [
    (["prepare", "torchvision:not_a_model"], 2, "torchvision has no model"),
    (["prepare", "nonsense"], 2, "'nonsense' is neither a directory here nor a model spec"),
    (["prepare", "demo:ModelWithReusedReLU", "--input", "1x3xx"], 2, "cannot read --input '1x3xx'"),
    (["prepare", "demo:ModelWithReusedReLU", "--input", "1x4x32x32"], 2, "The model itself failed"),
    (["prepare", "demo:ModelWithReusedReLU", "--tracer", "jit"], 2, "tracer must be one of"),
    (["show", "/nonexistent/dir"], 4, "not a directory"),
])
def test_errors_are_messages_with_exit_codes(args, code, text):
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert text in result.stderr


def test_errors_in_json_mode():
    result = invoke("prepare", "torchvision:not_a_model", "--json")
    assert result.exit_code == 2
    data = as_json(result)
    assert data == {"ok": False, "exit_code": 2, "error_type": "SpecError", "error": data["error"]}


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_verification_failure_exits_3(tmp_path):
    """A forward with a Python side effect: the traced constant is not what the next call computes."""
    spec = _write(tmp_path, """
        import torch
        from torch import nn

        class Counter(nn.Module):
            EXAMPLE_INPUTS = (torch.ones(3),)

            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                return x * self.calls
    """) + ":Counter"
    result = invoke("prepare", spec)
    assert result.exit_code == 3, result.output
    assert "EquivalenceError" in result.stderr


def test_trace_failure_exits_1(tmp_path):
    spec = _write(tmp_path, """
        import torch
        from torch import nn

        class Branchy(nn.Module):
            EXAMPLE_INPUTS = (torch.ones(3),)

            def forward(self, x):
                if x.sum() > 0:
                    return x + 1
                return x - 1
    """) + ":Branchy"
    result = invoke("check", spec, "--tracer", "fx")
    assert result.exit_code == 1, result.output
    assert "data-dependent" in result.stdout + result.stderr
    assert "W1122" not in result.stderr and "symbolic_shapes" not in result.stderr  # no torch log noise


def test_check_prints_attempts():
    result = invoke("check", "demo:ModelWithFunctionalReLU", "--json")
    assert result.exit_code == 0
    data = as_json(result)
    assert data["ok"]
    attempts = data.get("report", data).get("attempts", [])
    assert attempts and attempts[-1]["ok"]


def test_show_text_html_dot(tmp_path):
    out = tmp_path / "saved"
    assert invoke("prepare", "demo:ModelWithElementwiseAddOp", "-o", str(out), "--json").exit_code == 0
    text = invoke("show", str(out))
    assert text.exit_code == 0 and "conv1: Conv2d" in text.stdout and "add: Add(operator.add)" in text.stdout
    html = invoke("show", str(out), "-o", str(tmp_path / "g.html"))
    assert html.exit_code == 0 and "(html, 6 nodes)" in html.stdout  # x1, x2, conv1, conv2, add, output
    page = (tmp_path / "g.html").read_text()
    assert 'id="fxprep-data"' in page and "Content-Security-Policy" in page
    dot = invoke("show", str(out), "--format", "dot")
    data = as_json(invoke("show", str(out), "--json"))
    conv1, conv2, add = (next(n for n in data["nodes"] if n.get("module") == w) for w in ("conv1", "conv2", "add"))
    assert add["label"] == "Add(operator.add)" and add["kind"] == "added" and conv1["kind"] == "module"
    assert add["inputs"] == [conv1["name"], conv2["name"]]
    assert dot.exit_code == 0 and f'"{conv1["name"]}" -> "{add["name"]}"' in dot.stdout


# --- survey and demo ----------------------------------------------------------------------------
def test_survey_writes_markdown_and_json(tmp_path):
    report = tmp_path / "s.md"
    result = invoke("survey", "--zoo", "demo", "--filter", "ElementwiseAdd|FunctionalReLU", "--timeout", "300",
                    "-o", str(report), "--json")
    assert result.exit_code == 0, result.output
    summary = as_json(result)["summary"]
    assert summary["models"] == 2 and summary["passed"] == 2 and summary["failed"] == 0
    data = json.loads(report.with_suffix(".json").read_text())
    assert {r["spec"] for r in data["results"]} == {"demo:ModelWithElementwiseAddOp", "demo:ModelWithFunctionalReLU"}
    assert all(r["verification"] == "passed" and r["seconds"] > 0 for r in data["results"])
    md = report.read_text()
    assert "| models | passed | opaque | failed | median prepare time |" in md and "demo:ModelWithFunctionalReLU" in md


def test_survey_timeout_is_a_row(tmp_path):
    from fxprep.cli.survey import run_in_subprocess

    result = run_in_subprocess("demo:ModelWithReusedReLU", timeout=0.5)
    assert result.status == "timeout"


def test_survey_crash_is_a_row(tmp_path):
    from fxprep.cli.survey import run_in_subprocess

    spec = _write(tmp_path, """
        import os

        def Dies():
            os._exit(7)
    """) + ":Dies"
    result = run_in_subprocess(spec, timeout=120)
    assert result.status == "crashed" and result.error_type == "exit 7"


def test_survey_with_no_match_is_a_usage_error(tmp_path):
    result = invoke("survey", "--zoo", "demo", "--filter", "^nothing$", "-o", str(tmp_path / "s.md"))
    assert result.exit_code == 2


def test_demo_seeds():
    result = invoke("demo", "--only", "ModelWith", "--json")
    assert result.exit_code == 0, result.output
    demos = as_json(result)["demos"]
    assert [d["name"] for d in demos] == ["ModelWithFunctionalReLU", "ModelWithReusedReLU", "ModelWithElementwiseAddOp"]
    assert all(d["ok"] for d in demos)
    reused = demos[1]["report"]
    assert [u["copies"] for u in reused["unrolled"]] == [["relu_1", "relu_2", "relu_3"]]


def test_console_script_exit_code():
    """The real entry point (what `make demo` runs), in a subprocess."""
    proc = subprocess.run([sys.executable, "-c", "from fxprep.cli import main; main()", "prepare", "demo:nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no demo model 'nope'" in proc.stderr and "Traceback" not in proc.stderr


# --- the options of prepare, end to end (issue 16) ----------------------------------------------
NESTED = """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.fc(x)) + x

    class Net(nn.Module):
        EXAMPLE_INPUTS = (torch.randn(2, 4),)

        def __init__(self):
            super().__init__()
            self.block1 = Block()
            self.block2 = Block()
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.block2(self.block1(x)))

    def llama():
        return Net().eval()
"""


def _called(directory) -> list[str]:
    return [n["what"].split(":")[0] for n in io.inspect_saved(directory)["nodes"] if n["op"] == "call_module"]


def test_exclude_and_exclude_class(tmp_path):
    spec = _write(tmp_path, NESTED) + ":Net"
    out = tmp_path / "plain"
    assert invoke("prepare", spec, "-o", str(out), "--json").exit_code == 0
    assert "block1.fc" in _called(out) and "block1" not in _called(out)
    out = tmp_path / "one"
    result = invoke("prepare", spec, "--exclude", "block1", "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert "block1" in _called(out) and "block2.fc" in _called(out)
    for cls in ("Block", f"{resolve(spec).model.block1.__class__.__module__}.Block"):
        out = tmp_path / f"cls{len(cls)}"
        result = invoke("prepare", spec, "--exclude-class", cls, "-o", str(out), "--json")
        assert result.exit_code == 0, result.output
        assert {"block1", "block2"} <= set(_called(out)) and "block1.fc" not in _called(out)


def test_exclude_class_by_import_path(tmp_path):
    out = tmp_path / "r"
    result = invoke("prepare", "torchvision:resnet18", "--input", "1x3x32x32", "--exclude-class",
                    "torchvision.models.resnet.BasicBlock", "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    called = _called(out)
    assert "layer1.0" in called and "layer1.0.conv1" not in called


@pytest.mark.parametrize("args, text", [
    (["--exclude", "blok1"], "closest: block1"),
    (["--exclude", ""], "has no submodule"),
    (["--exclude-class", "Blok"], "closest first): Block"),
    (["--exclude-class", "no.such.module.Cls"], "cannot import"),
    (["--exclude-class", "torch.nn.functional.relu"], "is not a torch.nn.Module class"),
    (["--dynamic", "x:zero"], "cannot read --dynamic"),
    (["--dynamic", "y:0=batch"], "'y' is not an input of Net.forward; its inputs: x"),
    (["--dynamic", "batch", "--dynamic", "x:0"], "do not combine"),
    (["--verify-input", "2x4,2x"], "cannot read --verify-input '2x'"),
    (["--no-verify", "--verify-grad"], "cannot go with --no-verify"),
    (["--input", "1x999999999x999999"], "more than half of this machine's memory"),
])
def test_option_mistakes_are_usage_errors(tmp_path, args, text):
    result = invoke("prepare", _write(tmp_path, NESTED) + ":Net", *args)
    assert result.exit_code == 2, result.output
    assert text in result.stderr and "internal error" not in result.stderr


def test_dynamic_batch_and_named_dims(tmp_path):
    result = invoke("prepare", _write(tmp_path, NESTED) + ":Net", "--dynamic", "batch", "--json")
    assert result.exit_code == 0, result.output
    report = as_json(result)["report"]
    assert report["tracer"] == "dynamo"
    assert any(n.startswith("verified on a second input size") for n in report["notes"])
    result = invoke("prepare", "transformers:llama", "--input", "input_ids=2x5:int64", "--dynamic", "input_ids:0=batch,1=seq",
                    "--json")
    assert result.exit_code == 0, result.output
    notes = as_json(result)["report"]["notes"]
    assert not any("static shapes" in n for n in notes)
    second = next(n for n in notes if n.startswith("verified on a second input size"))
    assert "input_ids=Tensor[2x5" not in second and "input_ids=Tensor[" in second  # the dims grew


def test_verify_options(tmp_path):
    spec = _write(tmp_path, NESTED) + ":Net"
    off = as_json(invoke("prepare", spec, "--no-verify", "--json"))["report"]["verification"]
    assert off["status"] == "skipped" and off["detail"] == "verify=False"
    grad = as_json(invoke("prepare", spec, "--verify-grad", "--json"))["report"]["verification"]
    assert grad["status"] == "passed" and grad["grad"] and grad["grad_max_abs_diff"] is not None
    result = invoke("prepare", "demo:ModelWithElementwiseAddOp", "--verify-input", "1x3x32x32,1x3x32x32",
                    "--verify-input", "1x3x32x32, 1x3x32x32", "--json")
    assert result.exit_code == 0, result.output
    extra = as_json(result)["report"]["extra_verifications"]
    assert [v["status"] for v in extra] == ["passed", "passed"]


def test_verify_input_that_disagrees_exits_3(tmp_path):
    """Dynamo specialises a branch on the example's shape: a --verify-input of another size shows it."""
    spec = _write(tmp_path, """
        import torch
        from torch import nn

        class BySize(nn.Module):
            EXAMPLE_INPUTS = (torch.randn(2, 4),)

            def forward(self, x):
                return x * 2 if x.shape[0] > 2 else x + 1
    """) + ":BySize"
    assert invoke("prepare", spec, "--tracer", "dynamo", "--verify-input", "2x4").exit_code == 0
    result = invoke("prepare", spec, "--tracer", "dynamo", "--verify-input", "3x4")
    assert result.exit_code == 3, result.output
    assert "EquivalenceError" in result.stderr


def test_progress_quiet_and_forced(tmp_path):
    spec = _write(tmp_path, NESTED) + ":Net"
    default = invoke("prepare", spec)
    assert default.exit_code == 0 and "capture 1/2" not in default.stderr  # not a terminal: silent
    forced = invoke("prepare", spec, "--progress")
    stages = [line for line in forced.stderr.splitlines() if line.startswith("fxprep: m.py:Net: ")]
    assert stages[:3] == ["fxprep: m.py:Net: reference run", "fxprep: m.py:Net: capture 1/2: dynamo", "fxprep: m.py:Net: passes"]
    for flag in ("--quiet", "-q"):
        quiet = invoke("prepare", spec, "--progress", flag)
        assert quiet.exit_code == 0 and "fxprep: m.py:Net" not in quiet.stderr


def test_output_that_cannot_be_written_is_a_save_error(tmp_path):
    spec = _write(tmp_path, NESTED) + ":Net"
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for target, text in [(a_file, "a file of that name exists"), (a_file / "sub", "is a file"),
                         ("/proc/fxprep-test/out", "-o /proc/fxprep-test/out"), ("/sys/fxprep-test", "/sys/fxprep-test")]:
        result = invoke("prepare", spec, "-o", str(target))
        assert result.exit_code == 4, (target, result.output)
        assert "internal error" not in result.stderr and text in result.stderr.replace("\n", " ")


def test_model_names_are_not_markup_and_pipes_are_not_wrapped(tmp_path):
    spec = _write(tmp_path, NESTED) + ":llama"
    out = tmp_path / ("a-long-directory-name-" * 5) / "saved"
    result = invoke("prepare", spec, "-o", str(out))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "m.py:llama: passed" and "\U0001f999" not in result.stdout  # no llama emoji
    assert f"saved to {out} (load with fxprep.load)" in lines  # one line, well past 80 columns
    table = invoke("show", str(out)).stdout.splitlines()
    row = next(line for line in table if "block1.fc: Linear" in line)
    assert "added by fxprep" in next(line for line in table if "block1.add: Add(operator.add)" in line)
    assert len(row) > 80


def test_onnx_fallback_warning_in_full(tmp_path):
    spec = _write(tmp_path, """
        import torch
        from torch import nn

        class Gate(nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x * 2
                return x

        class Outer(nn.Module):
            EXAMPLE_INPUTS = (torch.randn(2, 4),)

            def __init__(self):
                super().__init__()
                self.gate = Gate()
                self.out = nn.Linear(4, 4)

            def forward(self, x):
                return self.out(self.gate(x)).relu()
    """) + ":Outer"
    result = invoke("prepare", spec, "--onnx", str(tmp_path / "m.onnx"))
    assert result.exit_code == 0, result.output
    warning = result.stderr[result.stderr.index("warning: the torch.export-based ONNX exporter failed"):]
    assert "\x1b[" not in warning
    assert warning.rstrip().endswith("taken on the example inputs.")
    assert "GuardOnDataDependentSymNode" in warning or "data-dependent" in warning  # the cause, not cut off


def test_prepare_writes_the_view_with_shapes(tmp_path):
    page = tmp_path / "view.html"
    result = invoke("prepare", _write(tmp_path, NESTED) + ":Net", "--tracer", "fx", "--show", str(page), "--json")
    assert result.exit_code == 0, result.output
    text = page.read_text()
    data = json.loads(text[text.index('id="fxprep-data">') + 17:text.index("</script>", text.index('id="fxprep-data"'))])
    head = next(n for n in data["nodes"] if n.get("module") == "head")
    assert head["values"] == [{"shape": [2, 2], "dtype": "float32"}]


def test_import_and_help_stay_light():
    """`import fxprep` and `fxprep --help` import no model zoo, no ONNX, and (for --help) no rich."""
    heavy = ("transformers", "onnx", "onnxruntime", "timm", "torchvision")
    code = textwrap.dedent(f"""
        import sys
        import fxprep
        after_import = sorted(m for m in sys.modules if m.split(".")[0] in {heavy + ("rich",)!r})
        from fxprep.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        after_help = sorted(m for m in sys.modules if m.split(".")[0] in {heavy + ("rich",)!r})
        print("RESULT", after_import, after_help)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert line == "RESULT [] []", line


# --- issue 28: specs and inputs a careless user (or a script) may give ------------------------------------
def test_file_spec_in_a_directory_whose_name_holds_a_colon(tmp_path):
    """``path:Class`` is split at the last colon: before, ``runs/10:00/model.py:Net`` was read as source
    ``runs/10`` and refused."""
    folder = tmp_path / "run 2024-01-01T10:00"
    folder.mkdir()
    path = folder / "model.py"
    path.write_text("import torch\nfrom torch import nn\n\nclass Net(nn.Linear):\n"
                    "    EXAMPLE_INPUTS = (torch.randn(2, 4),)\n\n    def __init__(self):\n        super().__init__(4, 3)\n")
    assert resolve(f"{path}:Net").example_inputs[0].shape == (2, 4)
    result = invoke("prepare", f"{path}:Net", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output


def test_an_existing_file_wins_over_a_builder_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("demo:net.py").write_text("import torch\nfrom torch import nn\n\ndef Net():\n    return nn.Linear(4, 3)\n\n"
                                   "Net.example_inputs = (torch.randn(2, 4),)\n")
    assert isinstance(resolve("demo:net.py:Net").model, torch.nn.Linear)


@pytest.mark.parametrize("text", ["1x" + "9" * 5000, "9" * 13, "x=" + "1x" * 70 + "1"])
def test_absurd_input_sizes_are_usage_errors(text):
    """``--input 1x<5000 digits>`` said "internal error ... a bug in fxprep" (int() refuses more than
    4300 digits); now it is a usage error, exit 2, saying what is wrong."""
    with pytest.raises(SpecError, match="digits|dimensions"):
        parse_input(text)
    result = invoke("prepare", "demo:ModelWithReusedReLU", "--input", text)
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output + result.stderr


def test_a_transformers_type_whose_config_does_not_tell_its_inputs_is_told_to_name_them() -> None:
    """The inputs built from BLIP-2's config (an image) are not what its forward needs (token ids as
    well): the command says so and how to name them, instead of every tracer's failure. Once the
    user names inputs, a failure is the model's own again (random ids hold no image tokens)."""
    result = invoke("prepare", "transformers:blip-2", "--json")
    assert result.exit_code == 2, result.output
    error = as_json(result)
    assert error["error_type"] == "InputsNotRun" and "(tried on cpu)" in error["error"]
    assert "--input pixel_values=1x3x" in error["error"] and "(required: pixel_values, input_ids)" in error["error"]
    named = invoke("prepare", "transformers:blip-2", "--json", "-i", "pixel_values=1x3x32x32", "-i",
                   "input_ids=1x8:int64")
    assert named.exit_code == 2 and as_json(named)["error_type"] == "ModelError", named.output
