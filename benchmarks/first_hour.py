"""Issue 61's ten items, measured on a checkout: command, exit code, first line of output, seconds.

Runs every item the way the issue met it, against the fxprep under ``--src`` (a checkout's ``src``
folder), each command in a fresh process in a scratch directory, and writes what it saw as JSON;
``--table BEFORE.json AFTER.json`` prints the two side by side as the Markdown of
``docs/first-hour-before-after.md``. The before side is the commit issue 61's branch started from:

    git worktree add --detach /tmp/before61 10068311
    python benchmarks/first_hour.py --src /tmp/before61/src -o /tmp/fh-before.json
    python benchmarks/first_hour.py --src src -o /tmp/fh-after.json
    python benchmarks/first_hour.py --table /tmp/fh-before.json /tmp/fh-after.json

The Python-API items (the names and the report of a 4-layer Llama and of torchvision's swin_t, the
timings against the wall clock) run in one fresh process per checkout. Times are wall seconds of
the whole process on whatever machine runs it (the numbers in the docs page: the shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ("import sys; sys.argv[0] = 'fxprep'; import fxprep.cli as c; "
         "sys.exit((getattr(c, 'console_main', None) or c.main)())")

BF16_MODEL = """
    import torch
    from torch import nn

    def Net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).to(torch.bfloat16).eval()

    Net.example_inputs = (torch.randn(2, 8, dtype=torch.bfloat16),)
"""
SLOW_MODEL = """
    import pathlib, time, torch
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

#: item -> (what the issue says, command lines after ``fxprep``)
CLI = [
    ("1", "the docs' checkpoint command on a float32 checkpoint",
     "prepare ckpt/llama --meta --dtype bfloat16 -o out/llama-fx"),
    ("2", "a config with an unknown model_type", "prepare ckpt/newer"),
    ("3", "a wrong path", "prepare ./no-such-checkpoint"),
    ("3", "a folder without config.json", "prepare ./weights-only"),
    ("4", "ONNX of a bf16 model", "prepare bf16.py:Net --onnx out/bf16.onnx"),
    ("7", "-o into a non-empty folder", "prepare torchvision:resnet18 -o full"),
    ("7", "--dtype float8", "prepare ckpt/llama --dtype float8"),
    ("10", "--help", "--help"),
    ("10", "--version", "--version"),
    ("10", "a misspelt model name", "prepare torchvision:resnet181"),
    ("10", "the notes' advice on the command line", "prepare demo:ModelWithReusedReLU"),
]

API = """
import json, sys, time, torch, torchvision, transformers as tf, fxprep
out = {}
prepare = fxprep.prepare_model  # imports fxprep.api (and Dynamo) now, not inside the first timing
torch.manual_seed(0)
config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
for name, make, example in [
        ("llama-4-layers", lambda: tf.LlamaForCausalLM(config).eval(), {"input_ids": ids}),
        ("swin_t", lambda: torchvision.models.swin_t(weights=None).eval(), torch.randn(1, 3, 224, 224))]:
    model = make()
    start = time.perf_counter()
    gm = prepare(model, example_inputs=example, progress=False)
    wall = time.perf_counter() - start
    report = gm.fxprep_report
    text = str(report)
    try:
        full = report.to_text(verbose=True)
    except TypeError:
        full = text
    names = [a.name for a in report.added]
    out[name] = dict(wall=wall, total=report.timings.get("total"), timings=report.timings, lines=len(text.splitlines()),
                     verbose_lines=len(full.splitlines()), added=len(names), text=text,
                     added_lines=sum(1 for line in text.splitlines() if line.lstrip().startswith("+ ")),
                     mangled=[n for n in names if "G___" in n],
                     rotary=[n for n in names if "apply_rotary" in n][:2] + [n for n in names if "rotary_emb" in n][:1],
                     checks=[n for n in names if n.rsplit(".", 1)[-1] in ("sub", "diff", "ne", "any", "invert", "assert_async")
                             and n.count(".") == 1],
                     attention=[n for n in names if "attention" in n][:2])
print("JSON" + json.dumps(out))
"""


def fxprep(src: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "COLUMNS": "200"}
    return [sys.executable, "-c", ENTRY], env


def first_line(output: str) -> str:
    return next((line.strip() for line in output.splitlines() if line.strip() and not line.startswith("W1")), "")


def run_cli(src: Path, work: Path, args: str) -> dict:
    command, env = fxprep(src)
    start = time.perf_counter()
    proc = subprocess.run([*command, *args.split()], cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    output = proc.stderr + proc.stdout if proc.returncode else proc.stdout + proc.stderr
    return dict(exit=proc.returncode, seconds=round(seconds, 2), first=first_line(output)[:220],
                lines=len(output.strip().splitlines()), output=output[-3000:],
                repeats=output.count("in the checkpoint, torch.bfloat16 in the module"),
                advice=re.findall(r"Pass [^.]*", output)[:2])


def interrupted(src: Path, work: Path, moment: str) -> dict:
    command, env = fxprep(src)
    (work / "running").unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen([*command, "prepare", "slow.py:Net"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if moment == "importing":
        time.sleep(0.5)
    else:
        while not (work / "running").exists() and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return dict(exit=proc.returncode, seconds=round(time.perf_counter() - start, 2),
                first=first_line(err)[:220] or "(nothing)", lines=len(err.strip().splitlines()), output=err[-3000:])


def docs_checks(root: Path) -> dict:
    """Item 9, read from the checkout's pages (what tests/test_docs_site.py checks, counted)."""
    docs = root / "docs"
    index = (docs / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)", index))
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md") if "reference" not in p.parts} - {"index.md"}
    sources = "\n".join(p.read_text() for p in (root / "src" / "fxprep").rglob("*.py"))
    return dict(
        half_tolerance_1e_2=len(re.findall(r"1e-2 for half", (docs / "concepts" / "verification.md").read_text())),
        machine_paths=len(re.findall(r"(/home/|/work/|/Users/|/tmp/fxprep)", (docs / "cli.md").read_text())),
        pages_not_linked_from_home=len(pages - linked),
        sphinx_roles_in_docstrings=len(re.findall(r":(?:class|func|meth|mod|attr):`", sources)),
        role_renderer=(docs / "_ext" / "sphinx_roles.py").exists(),
        save_says_it_holds_the_graph_only=len(re.findall(r"saved directory holds the graph;", (docs / "checkpoints.md").read_text())),
        **make_demo(root),
    )


def make_demo(root: Path) -> dict:
    """What ``make demo`` would run in a fresh clone (``make -n``: nothing installed), item 10."""
    dry = subprocess.run(["make", "-n", "-C", str(root), "demo", "VENV=.venv-none"], capture_output=True, text=True).stdout
    installs = [re.sub(r"^.*pip install", "pip install", line) for line in dry.splitlines()
                if "pip install" in line and "--upgrade pip" not in line]
    return dict(make_demo_installs="; ".join(installs), make_demo_progress_lines=dry.count("echo "))


def measure(src: Path) -> dict:
    import torch
    import transformers as tf

    result: dict = {"src": str(src.resolve()), "cli": [], "ctrl_c": {}}
    with tempfile.TemporaryDirectory(prefix="fxprep-first-hour-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        tf.LlamaForCausalLM(config).save_pretrained(work / "ckpt" / "llama", max_shard_size="40KB")
        newer = work / "ckpt" / "newer"
        newer.mkdir()
        settings = json.loads((work / "ckpt" / "llama" / "config.json").read_text())
        (newer / "config.json").write_text(json.dumps({**settings, "model_type": "llamazzz"}))
        for shard in (work / "ckpt" / "llama").glob("*.safetensors*"):
            (newer / shard.name).symlink_to(shard)
        (work / "weights-only").mkdir()
        (work / "weights-only" / "model.safetensors").write_bytes(b"")
        (work / "full").mkdir()
        (work / "full" / "notes.txt").write_text("mine")
        (work / "out").mkdir()
        (work / "bf16.py").write_text(textwrap.dedent(BF16_MODEL))
        (work / "slow.py").write_text(textwrap.dedent(SLOW_MODEL))
        for item, what, args in CLI:
            row = dict(item=item, what=what, command=f"fxprep {args}", **run_cli(src, work, args))
            if "--onnx" in args:
                row["file_left"] = (work / "out" / "bf16.onnx").exists()
            print(f"[{item}] exit {row['exit']} {row['seconds']:6.1f}s  {row['command']}\n      {row['first']}", flush=True)
            result["cli"].append(row)
        for moment in ("importing", "preparing"):
            result["ctrl_c"][moment] = interrupted(src, work, moment)
            print(f"[8] Ctrl-C {moment}: {result['ctrl_c'][moment]['exit']} {result['ctrl_c'][moment]['first']}", flush=True)
        env = {**os.environ, "PYTHONPATH": str(src.resolve())}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", API], env=env, capture_output=True, text=True, timeout=3600, cwd=work)
        result["api_process_seconds"] = round(time.perf_counter() - start, 1)
        line = next((line for line in proc.stdout.splitlines() if line.startswith("JSON")), None)
        if line is None:
            raise SystemExit(f"the Python-API run failed:\n{proc.stderr[-3000:]}")
        result["api"] = json.loads(line[4:])
    result["docs"] = docs_checks(src.resolve().parent)
    return result


def local(text: str) -> str:
    """Paths of the machine that ran it left out (site-packages as ``…/``, the checkout as ``.``)."""
    text = re.sub(r"\S*/site-packages/", "…/site-packages/", text)
    return text.replace(str(ROOT) + "/", "")


def table(before: dict, after: dict) -> str:
    def cell(text: str) -> str:
        text = local(text)
        return "`" + text.replace("|", "\\|").replace("`", "'")[:160] + "`" if text else "(nothing)"

    def said(row: dict) -> str:
        """The first line, and the message under it when the first line is only a heading ("error (...):")."""
        lines = [line.strip() for line in row["output"].splitlines() if line.strip() and not line.startswith("W1")]
        if row["first"].endswith(":") and row["first"] in lines and lines.index(row["first"]) + 1 < len(lines):
            return cell(row["first"] + " " + lines[lines.index(row["first"]) + 1][:150])
        if row["first"].endswith(":") and lines:  # the message longer than the output kept: its end
            return cell(row["first"] + " … " + lines[0][:130])
        return cell(row["first"])

    rows = ["| item | command | before: exit, s, first line | after: exit, s, first line |", "|---|---|---|---|"]
    for b, a in zip(before["cli"], after["cli"], strict=True):
        extra_b = f" ({b['repeats']} repeats of the dtype advice)" if b["repeats"] else ""
        extra_a = f" ({a['repeats']} repeats)" if a["repeats"] else ""
        if "file_left" in a:
            extra_b += f"; .onnx left on disk: {b['file_left']}; says 'no bfloat16 kernel': {'no bfloat16 kernel' in b['output']}"
            extra_a += f"; .onnx left on disk: {a['file_left']}; says 'no bfloat16 kernel': {'no bfloat16 kernel' in a['output']}"
        if (b["advice"] or a["advice"]) and ("advice" in a["what"] or a["item"] == "1"):
            extra_b += f"; advice: {b['advice'][:1]}"
            extra_a += f"; advice: {a['advice'][:1]}"
        rows.append(f"| {a['item']} | `{a['command']}` | {b['exit']}, {b['seconds']:.1f} s, {said(b)}{extra_b} "
                    f"| {a['exit']}, {a['seconds']:.1f} s, {said(a)}{extra_a} |")
    for moment in ("importing", "preparing"):
        b, a = before["ctrl_c"][moment], after["ctrl_c"][moment]
        rows.append(f"| 8 | Ctrl-C while {moment} (`fxprep prepare slow.py:Net`) | {b['exit']}, {b['lines']} lines on stderr, "
                    f"{cell(b['first'])} | {a['exit']}, {a['lines']} lines on stderr, {cell(a['first'])} |")
    lines = ["\n".join(rows), ""]
    lines += ["| report (Python API, `str(gm.fxprep_report)`) | before | after |", "|---|---|---|"]
    for model in ("llama-4-layers", "swin_t"):
        b, a = before["api"][model], after["api"][model]
        lines.append(f"| {model}: lines (verbose) | {b['lines']} | {a['lines']} ({a['verbose_lines']} with verbose=True) |")
        lines.append(f"| {model}: one line per added module | {b['added_lines']} of {b['added']} | {a['added_lines']} of {a['added']} |")
        lines.append(f"| {model}: wall s / report total s | {b['wall']:.1f} / {b['total']:.1f} | {a['wall']:.1f} / {a['total']:.1f} |")
        mangled_b, mangled_a = ([n for n in r["mangled"] if "G___" in n] for r in (b, a))
        lines.append(f"| {model}: names with Dynamo's globals (G___...) | {len(mangled_b)} {cell(mangled_b[0] if mangled_b else '')} "
                     f"| {len(mangled_a)} |")
        for key in ("rotary", "attention", "checks"):
            if b[key] or a[key]:
                lines.append(f"| {model}: {key} | {cell(', '.join(b[key]))} | {cell(', '.join(a[key]))} |")
    for model in ("llama-4-layers", "swin_t"):
        b, a = before["api"][model], after["api"][model]
        head = local("\n".join(b["text"].splitlines()[:12]))
        lines += ["", f"{model}, before (the first 12 of {b['lines']} lines):", "", "```text", head, "```", "",
                  f"{model}, after (all {a['lines']} lines):", "", "```text", local(a["text"]), "```"]
    lines += ["", "| docs (item 9, 10) | before | after |", "|---|---|---|"]
    for key in before["docs"]:
        b, a = before["docs"][key], after["docs"][key]
        if isinstance(a, str):
            b, a = cell(b), cell(a)
        lines.append(f"| {key} | {b} | {a} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the checkout's src folder")
    parser.add_argument("-o", "--output", type=Path, help="where the JSON goes (default: stdout)")
    parser.add_argument("--table", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="print the Markdown table")
    opts = parser.parse_args()
    if opts.table:
        before, after = (json.loads(p.read_text()) for p in opts.table)
        print(table(before, after))
        return 0
    result = json.dumps(measure(opts.src), indent=1)
    if opts.output:
        opts.output.write_text(result)
    else:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
