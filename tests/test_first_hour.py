"""A newcomer's first hour (issue 61): the docs' own commands work, errors say what is wrong, names
read like the model, the report is short and complete.

Each test is one item of the issue, run the way a new user met it; each failed before the fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch import nn

import fxprep
from fxprep.cli.advice import in_flag_terms

from .helpers_cli import invoke

pytestmark = pytest.mark.usefixtures("_restore_process_state")  # tests/conftest.py: undo what the CLI changes

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))


def _llama_config(layers: int = 2) -> tf.LlamaConfig:
    return tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def float32_checkpoint(tmp_path_factory) -> Path:
    """An ordinary checkpoint: float32, as save_pretrained writes a model built from a config."""
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    torch.manual_seed(0)
    tf.LlamaForCausalLM(_llama_config()).save_pretrained(path, max_shard_size="40KB")
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    return path


# --- 1: the docs' own checkpoint command --------------------------------------------------------
def test_meta_bfloat16_on_a_float32_checkpoint(float32_checkpoint, tmp_path) -> None:
    """``fxprep prepare ckpt --meta --dtype bfloat16 -o out`` (docs/checkpoints.md) exited 1 with
    "dtype torch.float32 in the checkpoint, torch.bfloat16 in the module (pass dtype=... to cast)"
    37 times over: the weights are now cast as they are read, as from_pretrained casts them."""
    saved = tmp_path / "out"
    result = invoke("prepare", str(float32_checkpoint), "--meta", "--dtype", "bfloat16", "-o", str(saved))
    assert result.exit_code == 0, result.output
    assert "use_cache=False" in result.stdout and "concrete_args" not in result.stdout  # no flag sets it
    loaded = fxprep.load(saved)
    assert loaded.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.bfloat16
    reference = tf.LlamaForCausalLM.from_pretrained(float32_checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, reference(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


# --- 2 and 3: a checkpoint folder transformers cannot read, a path that is not there --------------
def test_an_unknown_model_type_is_a_usage_error(float32_checkpoint, tmp_path) -> None:
    """It was "internal error ... This is a bug in fxprep ... please report it" (exit 1)."""
    folder = tmp_path / "newer"
    folder.mkdir()
    config = json.loads((float32_checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llamazzz"}))
    for shard in float32_checkpoint.glob("*.safetensors*"):
        (folder / shard.name).symlink_to(shard)
    result = invoke("prepare", str(folder))
    assert result.exit_code == 2, result.output
    assert "model_type 'llamazzz' is not one transformers" in result.stderr and "Did you mean llama" in result.stderr
    assert "internal error" not in result.stderr and "bug in fxprep" not in result.stderr


@pytest.mark.parametrize(("make", "says"), [
    (lambda tmp: tmp / "no" / "such" / "ckpt", "no such file or directory: {path}"),
    (lambda tmp: _folder(tmp / "weights-only", "model.safetensors"), "{path} is a directory without config.json"),
    (lambda tmp: tmp / "model.py", "no such file '{path}'"),
])
def test_a_missing_path_or_file_is_named(tmp_path, make, says) -> None:
    """Both were "cannot read model spec ...: use torchvision:NAME, ...", naming neither problem and not
    the checkpoint-folder form."""
    path = make(tmp_path)
    spec = f"{path}:Net" if path.suffix == ".py" else str(path)
    result = invoke("prepare", spec)
    assert result.exit_code == 2, result.output
    assert says.format(path=path) in result.stderr
    assert "internal error" not in result.stderr
    if path.suffix != ".py":  # the checkpoint-folder form among the forms a spec takes
        assert "a checkpoint directory (config.json + safetensors" in result.stderr


def _folder(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_bytes(b"")
    return path


# --- 4: ONNX of a bf16 model ----------------------------------------------------------------------
BF16_MODEL = """
    import torch
    from torch import nn

    def Net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).to(torch.bfloat16).eval()

    Net.example_inputs = (torch.randn(2, 8, dtype=torch.bfloat16),)
"""


def test_onnx_of_a_bfloat16_model_advises_and_leaves_no_file(tmp_path) -> None:
    """onnxruntime's CPU build has no bf16 kernels for most ops: exit 4 with no advice, and the
    failed .onnx file was left where the user asked for a checked one."""
    spec = _write(tmp_path, "bf16.py", BF16_MODEL) + ":Net"
    target = tmp_path / "model.onnx"
    result = invoke("prepare", spec, "--onnx", str(target))
    assert result.exit_code == 4, result.output
    assert "no bfloat16 kernel" in result.stderr and "float32 copy" in result.stderr
    assert "The failed file was removed" in result.stderr
    assert not target.exists() and not (tmp_path / "model.onnx.data").exists()


def _write(folder: Path, name: str, code: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return str(path)


# --- 5: names a quantization configuration can use --------------------------------------------------
def rotate(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return q * cos + rotate(q) * sin


class GlobalFunc(nn.Module):
    """A function wrapped in a module class held as a global: what the ``kernels`` package does to
    transformers' ``apply_rotary_pos_emb`` when it is installed. Dynamo names it after the global."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return apply_rope(*args)


ROPE = GlobalFunc()


class Attention(nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.wrapped = wrapped

    def forward(self, x, cos, sin):
        q = (ROPE if self.wrapped else apply_rope)(self.q(x), cos, sin)
        return torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q


class Net(nn.Module):
    def __init__(self, wrapped: bool = False):
        super().__init__()
        self.attn = Attention(wrapped)

    def forward(self, x, cos, sin):
        return x + self.attn(x, cos, sin)


ROPE_NAMES = ["attn.apply_rope.mul", "attn.apply_rope.neg", "attn.apply_rope.cat", "attn.apply_rope.mul_1",
              "attn.apply_rope.add", "attn.matmul", "attn.softmax", "attn.matmul_1", "add"]


@pytest.mark.parametrize("tracer", ["dynamo", "fx"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["function", "global-module"])
def test_names_say_owner_function_and_op(tracer: str, wrapped: bool) -> None:
    """The rotary ops were ``G_ROPE.mul`` (Dynamo's global's name) where the function is wrapped in a
    module, ``attn.mul`` where it is not: the same code got other names on other machines. Now
    owner, function and op on both routes, wrapped or not (the innermost helper, ``rotate``, is part
    of the function the owner called)."""
    example = tuple(torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    gm = fxprep.prepare_model(Net(wrapped).eval(), example_inputs=example, tracer=tracer, progress=False)
    assert [a.name for a in gm.fxprep_report.added] == ROPE_NAMES
    assert isinstance(gm.get_submodule("attn.apply_rope.mul"), fxprep.ops.Mul)


def test_llama_names_and_its_position_check() -> None:
    """A Llama's rotary ops were ``model.layers.0.G___import_transformers_dot_models_dot_llama_dot_modeling_llama_.
    apply_rotary_pos_emb.mul`` (with the kernels package installed) and fxprep's packed-sequence
    check was six modules to quantize (``model.sub -> model.diff -> ... -> model.assert_async``)."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_llama_config()).eval()
    names = []
    for _ in range(2):  # the same names on every run
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS}, progress=False)
        names.append([a.name for a in gm.fxprep_report.added])
    assert names[0] == names[1]
    assert not any("G___" in n or "import_transformers" in n for n in names[0])
    assert "model.layers.1.self_attn.apply_rotary_pos_emb.mul" in names[0]
    assert not any(n.split(".")[-1] in ("diff", "any", "invert", "assert_async") for n in names[0])
    checks = gm.fxprep_report.checks
    assert [c.target for c in checks][-1] == "torch._assert_async" and len(checks) == 6
    assert not any(n.op == "call_module" and "assert" in str(n.target) for n in gm.graph.nodes)
    assert any(n.op == "call_function" and n.target is torch._assert_async for n in gm.graph.nodes)  # still checked


# --- 5 and 6: the report is short, complete on request, and its seconds add up ---------------------
def test_the_report_is_short_and_complete_on_request() -> None:
    """A 4-layer Llama's report was 144 lines, 127 of them one per added module."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_llama_config(4)).eval()
    start = time.perf_counter()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS}, progress=False)
    wall = time.perf_counter() - start
    report = gm.fxprep_report
    assert report.timings["total"] == pytest.approx(wall, rel=0.02)  # the whole call, its context managers' exits too
    short, full = report.to_text(), report.to_text(verbose=True)
    assert str(report) == short and len(short.splitlines()) < 30
    assert f"modules added: {len(report.added)} (Mul " in short
    for module in report.added:
        assert f"    + {module.name} ({module.cls})" in full
    assert "input checks kept as calls" in short and "? first = operator.sub" in full


MANY_OPS = """
    import torch
    from torch import nn

    class Net(nn.Module):
        EXAMPLE_INPUTS = (torch.randn(2, 4),)

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return (y * 2 + 1).relu() - y.sigmoid() * torch.tanh(y) + y.mean()
"""


def test_the_cli_prints_the_api_report_short_or_verbose(tmp_path) -> None:
    """The short report is what ``gm.fxprep_report`` prints, on the command line too; every module by
    name with ``--verbose`` and in the graph view (before, the CLI printed one line per module)."""
    spec = _write(tmp_path, "ops.py", MANY_OPS) + ":Net"
    short = invoke("prepare", spec, "-o", str(tmp_path / "saved"), "--show", str(tmp_path / "view.html"))
    verbose = invoke("prepare", spec, "--verbose")
    assert short.exit_code == 0 and verbose.exit_code == 0, (short.output, verbose.output)
    report = fxprep.load(tmp_path / "saved").fxprep_report
    assert len(report.added) > 4
    untimed = [line for line in in_flag_terms(report.to_text()).splitlines()  # the advice in flags on the command line
               if not any(part in line for part in ("route:", "timings:", "loaded from"))]  # seconds differ; load's note
    assert len(untimed) > 6 and [line for line in untimed if line not in short.stdout] == []
    view = (tmp_path / "view.html").read_text()
    for module in report.added:
        assert f"+ {module.name} ({module.cls})" in verbose.stdout
        assert f"+ {module.name} (" not in short.stdout
        assert module.name in view


class TokenBlock(nn.Module):
    """A ViT-like model whose static capture bakes its batch in (cls_token.expand(B, ...)): captured
    again with the batch dynamic, so prepare_model makes two attempts and keeps the second."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.proj(tokens).relu()


def test_timings_add_up_to_the_time_taken() -> None:
    """Swin-T took 39.6 s and its report said total 10.9 s: the second, shape-general capture was not
    counted. Now every attempt is, and the stages sum to the total."""
    start = time.perf_counter()
    gm = fxprep.prepare_model(TokenBlock().eval(), example_inputs=torch.randn(2, 3, 8), progress=False)
    wall = time.perf_counter() - start
    timings = gm.fxprep_report.timings
    assert "captured again with it declared dynamic" in gm.fxprep_report.to_text()
    assert timings["attempts not kept"] > 0
    assert sum(v for k, v in timings.items() if k != "total") == pytest.approx(timings["total"], abs=1e-6)
    assert timings["total"] == pytest.approx(wall, rel=0.05, abs=0.05)


class Lookup(nn.Module):
    """Reads its input's values (the ids) and holds weights: on ``meta`` it is prepared with stand-ins."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids):
        return self.proj(self.embed(ids)).relu()


def test_timings_add_up_with_meta_stand_ins() -> None:
    """A meta model prepared with real token ids (issue 59's stand-ins): the stand-ins' making and
    undoing were outside the report's total."""
    with torch.device("meta"):
        model = Lookup().eval()
    start = time.perf_counter()
    gm = fxprep.prepare_model(model, example_inputs={"ids": torch.randint(0, 32, (2, 5))}, verify=False, progress=False)
    wall = time.perf_counter() - start
    timings = gm.fxprep_report.timings
    assert any("stood in" in n for n in gm.fxprep_report.notes) and "meta stand-ins" in timings
    assert sum(v for k, v in timings.items() if k != "total") == pytest.approx(timings["total"], abs=1e-6)
    assert timings["total"] == pytest.approx(wall, rel=0.05, abs=0.05)


# --- 7: cheap checks come first ------------------------------------------------------------------------
SPY_MODEL = """
    import pathlib
    import torch
    from torch import nn

    def Net():
        pathlib.Path(__file__).with_name("built").write_text("the model was built")
        return nn.Linear(4, 4)

    Net.example_inputs = (torch.randn(2, 4),)
"""


@pytest.mark.parametrize("args", [["-o", "{tmp}/full"], ["--dtype", "float8"], ["--onnx", "{tmp}"],
                                  ["--tracer", "dynamoo"], ["--input", "2xx4"], ["--static", "--dynamic", "batch"]])
def test_arguments_are_checked_before_the_model_is_built(tmp_path, args) -> None:
    """``-o`` into a non-empty folder was refused after the whole prepare (20.7 s); ``--dtype
    float8`` after 14.6 s."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    spec = _write(tmp_path, "spy.py", SPY_MODEL) + ":Net"
    result = invoke("prepare", spec, *(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code in (2, 4), result.output
    assert not (tmp_path / "built").exists(), "the model was built before the arguments were checked"
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_argument_errors_are_found_before_torch_is_imported(float32_checkpoint, tmp_path) -> None:
    """A mistake a string shows is said within a second: before, ``--dtype float8`` on a checkpoint
    came after transformers had read its config (14.6 s)."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases = [
        ([str(float32_checkpoint), "--dtype", "float8"], 2, "--dtype must be one of"),
        ([str(float32_checkpoint), "-o", str(tmp_path / "full")], 4, "is not an fxprep save"),
        ([str(tmp_path / "nowhere")], 2, "no such file or directory"),
        (["torchvision:resnet18", "--tracer", "dynamoo"], 2, "Did you mean dynamo?"),
    ]
    code = textwrap.dedent(f"""
        import sys
        from fxprep.cli import main
        for args, _, _ in {cases!r}:
            try:
                main(["prepare", *args])
            except SystemExit as done:
                print("EXIT", done.code, "torch" in sys.modules, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    exits = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("EXIT")]
    assert exits == [[str(c), "False"] for _, c, _ in cases], (proc.stdout, proc.stderr)
    for _, _, says in cases:
        assert says in proc.stderr


def test_the_readme_command_writes_its_view_into_a_new_folder(tmp_path, monkeypatch) -> None:
    """The README's ``fxprep prepare ... -o out/resnet50 --show out/resnet50.html`` exited 4 in a fresh
    directory ("cannot write the graph view to out/resnet50.html: No such file or directory"): the view
    was written before the save made out/ (found by tests/newcomer.py)."""
    monkeypatch.chdir(tmp_path)
    result = invoke("prepare", "demo:ModelWithReusedReLU", "-o", "out/m", "--show", "out/m.html")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "m.html").is_file() and (tmp_path / "out" / "m" / "manifest.json").is_file()


def test_did_you_mean_for_model_names() -> None:
    result = invoke("prepare", "torchvision:resnet181")
    assert result.exit_code == 2 and "Did you mean resnet18" in result.stderr
    assert "survey" not in result.stderr  # no longer "`fxprep survey --zoo torchvision` lists them" (121 preparations)
    result = invoke("prepare", "transformers:lama")
    assert result.exit_code == 2 and "Did you mean llama" in result.stderr and "gpt-sw3" not in result.stderr


def test_advice_is_given_in_flag_terms() -> None:
    """The report's notes said "Pass dynamic=... (or tracer='fx')" on the command line."""
    result = invoke("prepare", "demo:ModelWithReusedReLU", "--static")
    assert result.exit_code == 0, result.output
    assert "Pass --dynamic ... (or --tracer fx)" in result.stdout
    assert "dynamic=" not in result.stdout and "tracer='fx'" not in result.stdout


# --- 8 and 10: Ctrl-C, --help and --version without torch -------------------------------------------
FXPREP = [sys.executable, "-c", "import sys; from fxprep.cli import console_main; sys.argv[0] = 'fxprep'; console_main()"]
SLOW_MODEL = """
    import pathlib
    import time
    import torch
    from torch import nn

    class Net(nn.Module):
        EXAMPLE_INPUTS = (torch.randn(2, 4),)

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            pathlib.Path(__file__).with_name("running").touch()
            time.sleep(0.2)
            return self.fc(x)
"""


def _interrupted(args: list[str], *, when: Path | None = None, after: float = 0.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([*FXPREP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while when is not None and not when.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("moment", ["importing", "preparing"])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, moment: str) -> None:
    """A Ctrl-C while torch was imported printed a 23-line traceback; during a prepare, exit 130
    with an empty message."""
    spec = _write(tmp_path, "slow.py", SLOW_MODEL) + ":Net"
    if moment == "importing":
        done = _interrupted(["prepare", spec], after=0.5)  # torch's import alone takes longer than that
    else:
        done = _interrupted(["prepare", spec], when=tmp_path / "running", after=0.1)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1:] == ["fxprep: interrupted (Ctrl-C)"], done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_help_and_version_do_not_import_torch() -> None:
    """``fxprep --help`` imported torch (4.6 s here) and there was no ``--version``."""
    code = textwrap.dedent("""
        import io, sys, contextlib
        from fxprep.cli import main
        for args in (["--help"], ["--version"], ["prepare", "--help"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main(args)
                except SystemExit as done:
                    assert done.code == 0, (args, done.code)
            print(args[0], out.getvalue().splitlines()[0])
        print("torch imported:", "torch" in sys.modules)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"--version fxprep {fxprep.__version__}" in proc.stdout
    assert "torch imported: False" in proc.stdout, proc.stdout
