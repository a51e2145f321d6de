"""Issue 59: ``run_sequential`` data-parallel under ``torch.distributed`` (2 ranks, gloo, loopback),
equal to one process running every batch.

tests/ranks_worker.py runs the same calibration (weights on disk, torch.ao observers on every Linear,
a GPTQ-style on_stage that all-reduces a Hessian and updates weights on rank 0 only) under
``torchrun`` with 2 processes and alone without ``torch.distributed``. Both ranks end with the
single process's observers (min/max, per-channel, moving average, histograms) and weights bit for
bit; the all-reduced Hessians agree to float32 rounding (summed in another order); each rank's
outputs are the single run's for its batches. A rank whose on_stage raises: it raises its error,
the other ``RankFailed``, and both undid the stage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

WORKER = Path(__file__).with_name("ranks_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(WORKER.parent))
    from ranks_worker import CFG

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).save_pretrained(path, max_shard_size="20KB")
    return path


def _launch(checkpoint: Path, out: Path, ranks: int, *extra: str) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   str(WORKER), str(checkpoint), str(out), "--ranks", *extra]
    else:
        command = [sys.executable, str(WORKER), str(checkpoint), str(out), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)  # a hang guard
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(max(ranks, 1))]


def _equal_states(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_two_ranks_equal_one_process(checkpoint: Path, tmp_path: Path) -> None:
    (single,) = _launch(checkpoint, tmp_path / "single", 0)
    ranks = _launch(checkpoint, tmp_path / "ranks", 2)
    assert single["error"] is None and all(r["error"] is None for r in ranks)
    for r, got in enumerate(ranks):
        for name, trio in single["observers"].items():
            for kind, want, have in zip(("histogram", "per-channel", "moving average"), trio, got["observers"][name],
                                        strict=True):
                assert _equal_states(want, have) == [], (r, name, kind)
        assert _equal_states(single["weights"], got["weights"]) == [], r
        assert torch.equal(single["logits"], got["logits"])
        assert got["batches"] == list(range(r, 5, 2))
        assert all(torch.equal(single["outputs"][k], out) for k, out in zip(got["batches"], got["outputs"], strict=True))
        assert single["hessians"].keys() == got["hessians"].keys()
        for stage, h in single["hessians"].items():  # summed in another order: float32 rounding apart
            torch.testing.assert_close(got["hessians"][stage], h, rtol=1e-6, atol=1e-5)
    # the weights changed (rank 0's rounding reached rank 1, which changed nothing itself)
    original = tf.LlamaForCausalLM.from_pretrained(checkpoint).state_dict()
    assert not torch.equal(original["model.layers.0.mlp.down_proj.weight"], ranks[1]["weights"]["model.layers.0.mlp.down_proj.weight"])


def test_a_rank_that_fails_undoes_the_stage_on_every_rank(checkpoint: Path, tmp_path: Path) -> None:
    (single,) = _launch(checkpoint, tmp_path / "single", 0, "--fail-rank", "0")
    ranks = _launch(checkpoint, tmp_path / "ranks", 2, "--fail-rank", "1")
    assert single["error"] == "ValueError: on_stage failed on rank 0"
    assert ranks[1]["error"] == "ValueError: on_stage failed on rank 1"
    assert ranks[0]["error"] == ("RankFailed: rank 1 failed in on_stage of stage 'model.layers.1'; every rank undid "
                                 "the stage.")
    for got in ranks:  # layer 0 written (rank 0's update), layer 1 undone, the rest never reached
        assert _equal_states(single["weights"], got["weights"]) == []
    original = tf.LlamaForCausalLM.from_pretrained(checkpoint).state_dict()
    for key in ("model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        assert torch.equal(original[key], ranks[0]["weights"][key])
    assert not torch.equal(original["model.layers.0.mlp.down_proj.weight"], ranks[1]["weights"]["model.layers.0.mlp.down_proj.weight"])
