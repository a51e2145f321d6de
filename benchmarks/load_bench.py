"""Load time of honest saves: ``fxprep.load`` of zoo models, one source tree against another.

Issue 63 added checks to every load (the default list's lookups, bounded Python values, in-place
growth and flops in the self-check's budget, a time limit, regular files); the load of an honest save
must stay within 1.1x of what it was. Each tree saves its own files (a save and a load of the same
version), in a subprocess of its own with that tree first on ``PYTHONPATH``; then the two trees load
in turn, ``--rounds`` processes each, alternating, so a shared machine's drift falls on both. Per
model it records the first load in a process (imports done; the allow-list tables and first-use
costs included), the best of ``--repeat`` loads after it, and that load's CPU time
(``time.process_time``: on a machine shared with other work, wall time moves by tens of percent
from run to run, CPU time much less), each the best over the rounds.

    git archive main src | tar -x -C /tmp/base     # the tree before
    python benchmarks/load_bench.py --base /tmp/base/src --new src --repeat 5 --rounds 3 [--models resnet50_b8,...]

prints a markdown table (seconds and new/base ratios) and, with ``--json FILE``, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (name, what to build): torchvision / timm models at the zoo tests' sizes, tiny transformers; ResNet-50
# at batch 8 is docs/security.md's reference
MODELS = {
    "resnet50_b8": "torchvision:resnet50:8",
    "mobilenet_v3_small": "torchvision:mobilenet_v3_small:1",
    "convnext_tiny": "torchvision:convnext_tiny:1",
    "vit_b_16": "torchvision:vit_b_16:1",
    "timm_efficientvit_m0": "timm:efficientvit_msra:1",
    "timm_vit_tiny": "timm:vision_transformer:1",
    "llama_tiny": "hf:llama",
    "bert_tiny": "hf:bert",
    "t5_tiny": "hf:t5",
}

_SAVE = r"""
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
import fxprep
try:
    import fxprep.families.transformers.model
except ImportError:  # a tree from before the regroup (--base): the tests' builders import the helper by its new path
    import fxprep.capture.huggingface
    sys.modules["fxprep.families.transformers.model"] = fxprep.capture.huggingface
from tests import zoo_models
kind, name, *rest = {spec!r}.split(":")
if kind == "torchvision":
    model, example = zoo_models.build_torchvision(name)
    if int(rest[0]) > 1:
        example = (example[0].repeat(int(rest[0]), 1, 1, 1),)
elif kind == "timm":
    model, example = zoo_models.build_timm(name)
else:
    model, example = zoo_models.build_hf(name)
gm = fxprep.prepare_model(model, example_inputs=example, progress=False)
fxprep.save(gm, {directory!r}, trusted_modules=("torchvision", "timm", "transformers"), overwrite=True)
print("SAVED")
"""

_LOAD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
begin = time.perf_counter()
import fxprep
import fxprep.io  # timed apart: what `import fxprep` and fxprep.io import changed between trees
imported = time.perf_counter() - begin
times, cpu = [], []
for _ in range({repeat} + 1):
    start, start_cpu = time.perf_counter(), time.process_time()
    fxprep.load({directory!r}, trusted_modules=("torchvision", "timm", "transformers"))
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
print("RESULT", json.dumps({{"first": times[0], "fresh": imported + times[0], "best": min(times[1:]),
                            "cpu": min(cpu[1:])}}))
"""


def _child(src: str, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(ROOT)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        print(f"child with {src} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
    return done.stdout


def measure(trees: dict[str, str], spec: str, repeat: int, rounds: int) -> dict[str, dict[str, float] | None]:
    """Each tree saves the model with its own code, then the trees load in turn, ``rounds`` times
    (a fresh process each: the first load pays the tables' first use), so the drift of a shared
    machine falls on both; per tree the best first load and the best later load over the rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {which: str(Path(tmp) / which) for which in trees}
        for which, src in trees.items():
            if "SAVED" not in _child(src, _SAVE.format(root=str(ROOT), spec=spec, directory=dirs[which])):
                return {which: None for which in trees}
        found: dict[str, list[dict[str, float]]] = {which: [] for which in trees}
        for _ in range(rounds):
            for which, src in trees.items():
                for line in _child(src, _LOAD.format(directory=dirs[which], repeat=repeat)).splitlines():
                    if line.startswith("RESULT "):
                        found[which].append(json.loads(line.removeprefix("RESULT ")))
    return {which: ({key: min(r[key] for r in runs) for key in ("first", "fresh", "best", "cpu")} if runs else None)
            for which, runs in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the source tree before (its src directory)")
    parser.add_argument("--new", default=str(ROOT / "src"), help="the source tree after")
    parser.add_argument("--repeat", type=int, default=3, help="loads per process after its first")
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree, the trees in turn")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    trees = {which: str(Path(getattr(args, which)).resolve()) for which in ("base", "new")}
    for name in args.models.split(","):
        rows[name] = measure(trees, MODELS[name], args.repeat, args.rounds)
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    print(f"| model | first load: before | after | ratio | import fxprep + first load: before | after | ratio "
          f"| best of {args.repeat}: before | after | ratio | CPU time: before | after | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        base, new = row["base"], row["new"]
        if not base or not new:
            print(f"| {name} | failed | | | | | | | | | | | |")
            continue
        print(f"| {name} | {base['first']:.3f} s | {new['first']:.3f} s | {new['first'] / base['first']:.2f}x "
              f"| {base['fresh']:.3f} s | {new['fresh']:.3f} s | {new['fresh'] / base['fresh']:.2f}x "
              f"| {base['best']:.3f} s | {new['best']:.3f} s | {new['best'] / base['best']:.2f}x "
              f"| {base['cpu']:.3f} s | {new['cpu']:.3f} s | {new['cpu'] / base['cpu']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
