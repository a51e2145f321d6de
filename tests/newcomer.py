"""A newcomer's first hour, scripted (issue 61): the docs' own commands, and the usual mistakes.

Runs every ``fxprep`` command of the README's, docs/cli.md's and docs/checkpoints.md's shell blocks
as a new user would paste it (optional ``[...]`` parts left out; a checkpoint made where the page's
``./my-llama`` is; ``--device cuda`` on the CPU when there is no GPU; the survey of 121 models
filtered to one), then the mistakes a newcomer makes on purpose or by accident (a misspelt model, a
path that is not there, a ``--dtype`` fxprep does not know, an ``-o`` into a folder of one's own),
each in a fresh process in a scratch directory. Each is checked for its exit code, for a first line
that says something, and for what a newcomer must never see (a traceback, "internal error").

``make newcomer`` runs it in a fresh virtual environment with what ``pip install ".[demo]"``
installs; ``tests/test_newcomer.py`` runs it (the mistakes, and the command list) in the test
environment. Standalone: ``python tests/newcomer.py [--fxprep PATH] [--only-mistakes]``; exit 0 when
everything behaved.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/cli.md", "docs/checkpoints.md")
NEVER = ("Traceback (most recent call last)", "internal error", "This is a bug in fxprep")


@dataclass
class Case:
    """One command line, what its exit code must be and what its output must say."""

    source: str
    args: list[str]
    exit_code: int = 0
    says: str = ""


def page_commands(page: str) -> list[str]:
    """The ``fxprep ...`` lines of ``page``'s shell blocks, as written (comments dropped)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("fxprep "):
                lines.append(re.sub(r"\s+#.*$", "", line))
    return lines


def without_optional(command: str) -> str:
    """``a [--onnx x] b`` -> ``a b``: a synopsis's optional parts, nested or not, left out."""
    while True:
        shorter = re.sub(r"\s*\[[^\[\]]*\]", "", command)
        if shorter == command:
            return command.strip()
        command = shorter


def as_pasted(command: str, cuda: bool) -> list[str]:
    """The arguments a newcomer runs for a documented command (see the module docstring)."""
    command = without_optional(command)
    if "--device cuda" in command and not cuda:
        command = command.replace("--device cuda", "--device cpu")
    args = shlex.split(command)[1:]
    if args[:1] == ["survey"]:
        args += ["--filter", r"^torchvision:alexnet$"]
    return args


#: what a documented command must answer, when it is not exit 0
EXPECTED = {
    "check examples/non_traceable.py:NonTraceableModel": (1, "verdict: not traceable as written"),
}


def documented(cuda: bool) -> list[Case]:
    cases = []
    for page in PAGES:
        for command in page_commands(page):
            args = as_pasted(command, cuda)
            code, says = next((v for k, v in EXPECTED.items() if " ".join(args).startswith(k)), (0, ""))
            cases.append(Case(page, args, code, says))
    return cases


def mistakes(version: str) -> list[Case]:
    return [
        Case("mistake", ["--version"], 0, f"fxprep {version}"),
        Case("mistake", ["--help"], 0, "Usage: fxprep"),
        Case("mistake", ["prepare", "torchvision:resnet181"], 2, "Did you mean resnet18"),
        Case("mistake", ["prepare", "resnet18"], 2, "torchvision:resnet18"),
        Case("mistake", ["prepare", "./no-such-checkpoint"], 2, "no such file or directory: ./no-such-checkpoint"),
        Case("mistake", ["prepare", "./examples"], 2, "examples is a directory without config.json"),
        Case("mistake", ["prepare", "./my-llama", "--dtype", "float8"], 2, "--dtype must be one of"),
        Case("mistake", ["prepare", "torchvision:resnet18", "-o", "examples"], 4, "is not an fxprep save"),
        Case("mistake", ["prepare", "torchvision:resnet18", "--tracer", "dynamoo"], 2, "Did you mean dynamo?"),
    ]


def make_checkpoint(path: Path) -> None:
    """A small float32 Llama where the checkpoint page's ``./my-llama`` is (sharded, as save_pretrained writes)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="40KB")


def environment() -> dict[str, str]:
    """The commands' environment: this process's, with the fxprep it imports first on the path (the
    commands run in a scratch directory, where a relative ``PYTHONPATH=src`` finds nothing and an
    installed fxprep, another checkout's, would answer instead)."""
    import fxprep

    paths = [str(Path(fxprep.__file__).resolve().parents[1])]
    paths += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "COLUMNS": "200", "PYTHONPATH": os.pathsep.join(paths)}


def run(case: Case, fxprep: list[str], cwd: Path, env: dict[str, str]) -> tuple[bool, str]:
    start = time.perf_counter()
    proc = subprocess.run([*fxprep, *case.args], cwd=cwd, capture_output=True, text=True, timeout=1800,
                          env=env)
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    first = next((line for line in output.splitlines() if line.strip()), "")
    problems = [f"exit {proc.returncode}, expected {case.exit_code}"] if proc.returncode != case.exit_code else []
    problems += [f"says {bad!r}" for bad in NEVER if bad in output]
    if case.says and case.says not in output:
        problems.append(f"does not say {case.says!r}")
    if not first:
        problems.append("prints nothing")
    line = f"{'ok ' if not problems else 'BAD'} exit {proc.returncode:>3} {seconds:6.1f}s  fxprep {shlex.join(case.args)}\n" \
           f"      first line: {first[:160]}" + "".join(f"\n      ! {p}" for p in problems)
    if problems:
        line += "\n      output:\n" + "\n".join("        " + s for s in output.splitlines()[-15:])
    return not problems, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fxprep", help="the fxprep command to run (default: this Python's fxprep.cli)")
    parser.add_argument("--only-mistakes", action="store_true", help="the mistakes only (seconds, not minutes)")
    opts = parser.parse_args(argv)
    fxprep = [os.path.abspath(opts.fxprep)] if opts.fxprep else [sys.executable, "-c", "from fxprep.cli import console_main; console_main()"]
    env = {**os.environ, "COLUMNS": "200"} if opts.fxprep else environment()  # an installed command as it is
    version = subprocess.run([*fxprep, "--version"], capture_output=True, text=True, env=env).stdout.split()[-1:] or ["?"]
    import torch

    cases = mistakes(version[0]) + ([] if opts.only_mistakes else documented(torch.cuda.is_available()))
    ok = True
    with tempfile.TemporaryDirectory(prefix="fxprep-newcomer-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "examples", work / "examples")
        make_checkpoint(work / "my-llama")
        print(f"newcomer check: {len(cases)} commands in {work}, with {' '.join(fxprep)}", flush=True)
        for case in cases:
            good, line = run(case, fxprep, work, env)
            ok &= good
            print(f"[{case.source}] {line}", flush=True)
    print("newcomer check: " + ("every command behaved" if ok else "SOME COMMANDS DID NOT BEHAVE (BAD above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
