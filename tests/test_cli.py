"""The ``fxprep`` command: outputs, JSON for scripts, exit codes, and no raw tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from fxprep import cli, io
from fxprep.cli.specs import SpecError, inputs_from_strings, parse_input, resolve, zoo_specs

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_process_state(monkeypatch):
    """The CLI quiets torch's logging and Python warnings for its (short-lived) process; undo that
    after each in-process invocation so other test files see the defaults."""
    import logging
    import os
    import warnings

    import torch._logging

    for var in ("TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, os.environ.get(var, "")) if var in os.environ else monkeypatch.delenv(var, raising=False)
    level = logging.getLogger("torch").level
    filters = list(warnings.filters)
    yield
    warnings.filters[:] = filters
    logging.getLogger("torch").setLevel(level)
    torch._logging.set_logs()


def invoke(*args: str):
    result = runner.invoke(cli.app, list(args))
    assert "Traceback" not in result.output + (result.stderr or ""), result.output
    return result


def as_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    result = invoke("prepare", "demo:ModelWithReusedReLU", "-o", str(out))
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
    (["prepare", "nonsense"], 2, "cannot read model spec"),
    (["prepare", "demo:ModelWithReusedReLU", "--input", "1x3xx"], 2, "cannot read input"),
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
    assert text.exit_code == 0 and "conv1: Conv2d" in text.stdout and "Add(operator.add)" in text.stdout
    html = invoke("show", str(out), "-o", str(tmp_path / "g.html"))
    assert html.exit_code == 0 and "<table>" in (tmp_path / "g.html").read_text()
    dot = invoke("show", str(out), "--format", "dot")
    data = as_json(invoke("show", str(out), "--json"))
    conv1, conv2, add = (next(n for n in data["nodes"] if n["what"].startswith(w)) for w in ("conv1:", "conv2:", "add:"))
    assert add["what"] == "add: Add(operator.add)" and add["inputs"] == [conv1["name"], conv2["name"]]
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
