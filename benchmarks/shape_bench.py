"""Default prepare time of a tiny Llama, by stage: what shape-general capture costs and what the batch
probe cost before it (issue 27, item 3).

    python benchmarks/shape_bench.py [--runs 5]
    PYTHONPATH=/path/to/other/src python benchmarks/shape_bench.py   # the same for another checkout

Each run is a fresh one-thread process: a 2-layer Llama (hidden 32) is built, fxprep imported and
one eager forward run before the clock starts; then ``prepare_model(model, example_inputs={"input_ids":
1x8})`` with every option at its default. The table shows the medians of ``--runs`` runs of the report's
stage timings (wall clock) and of the process CPU time of the call (a busy shared machine disturbs the
CPU time far less), and says whether the result accepts batch 3 / 13 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def child() -> dict[str, Any]:
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    ids = torch.randint(0, 101, (1, 8))
    with torch.no_grad():
        model(input_ids=ids)
    import fxprep

    cpu, wall = time.process_time(), time.perf_counter()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    timings = fxprep.get_report(gm).timings
    try:
        with torch.no_grad():
            gm(input_ids=torch.randint(0, 101, (3, 13)))
        general = True
    except fxprep.InputMismatch:
        general = False
    return {"cpu": cpu, "wall": wall, "general": general, "fxprep": os.path.dirname(fxprep.__file__),
            **{k: v for k, v in timings.items() if k in ("capture", "passes", "verify", "total")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(child()))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    rows = []
    for _ in range(ns.runs):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], capture_output=True, text=True,
                              env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if not lines:
            print((proc.stderr.strip().splitlines() or ["?"])[-1], file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1]))
    med = {k: statistics.median(r[k] for r in rows) for k in ("cpu", "wall", "capture", "passes", "verify", "total")}
    print(f"fxprep from {rows[0]['fxprep']}, load average {os.getloadavg()[0]:.1f}, median of {ns.runs} runs")
    print("| CPU time (s) | wall (s) | capture | passes | verify | runs at 3x13 |")
    print("|---:|---:|---:|---:|---:|---|")
    print(f"| {med['cpu']:.2f} | {med['wall']:.2f} | {med['capture']:.2f} | {med['passes']:.2f} | {med['verify']:.2f} "
          f"| {'yes' if rows[0]['general'] else 'no (InputMismatch)'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
