"""A bfloat16 mixture of experts saves and loads: ``torch._grouped_mm`` behind a check of its offsets.

In bfloat16 transformers' experts call ``torch._grouped_mm`` (``F.grouped_mm``), whose CUDA kernel
takes the offsets of each expert's rows without checking them, so the function is not on the
reviewed allow-list and such a graph could not be saved at all ("no importable name"). It is now
saved as ``fxprep.io.checked.grouped_mm``, which checks the offsets and calls the same kernel: a
fresh process loads it without trusting anything and gets the prepared module's logits exactly,
and offsets a crafted file could give raise instead of reaching the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import fxprep
from fxprep.io import checked

_LOAD = """
import sys, torch
import fxprep
gm = fxprep.load(sys.argv[1])
ref = torch.load(sys.argv[1] + ".ref.pt")
with torch.no_grad():
    logits = gm(input_ids=ref["ids"]).logits
print("DIFF", float((logits.float() - ref["logits"].float()).abs().max()))
print("CHECKED", any(getattr(m, "fn", None).__module__ == "fxprep.io.checked" for m in gm.modules()
                     if isinstance(m, fxprep.ops.BoundOp)))
"""


def _mixtral_bf16() -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).to(torch.bfloat16).eval()


def test_a_bfloat16_mixture_of_experts_saves_and_loads_untrusted(tmp_path: Path) -> None:
    model = _mixtral_bf16()
    ids = torch.randint(3, 90, (2, 9))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(3, 90, (1, 8))})
    called = {getattr(m, "fn", None) for m in gm.modules() if isinstance(m, fxprep.ops.BoundOp)}
    assert torch._grouped_mm in called, "the bf16 experts no longer call torch._grouped_mm: the test proves nothing"
    target = tmp_path / "saved"
    fxprep.save(gm, target)
    saved = "".join(p.read_text() for p in target.glob("*.json"))
    assert checked.NAME in saved and "\"torch._grouped_mm\"" not in saved
    with torch.no_grad():
        torch.save({"ids": ids, "logits": gm(input_ids=ids).logits}, str(target) + ".ref.pt")
    done = subprocess.run([sys.executable, "-c", _LOAD, str(target)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.split("\n") if " " in line)
    assert float(lines["DIFF"]) == 0.0
    assert lines["CHECKED"] == "True"


def _operands() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(10, 16, generator=g).bfloat16(), torch.randn(3, 16, 8, generator=g).bfloat16()


def test_good_offsets_compute_what_torch_computes() -> None:
    a, b = _operands()
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    assert torch.equal(checked.grouped_mm(a, b, offs=offs), torch._grouped_mm(a, b, offs=offs))


@pytest.mark.parametrize(("offs", "text"), [
    (torch.tensor([4, 4, 11], dtype=torch.int32), "within 0..10"),
    (torch.tensor([4, -1, 10], dtype=torch.int32), "within 0..10"),
    (torch.tensor([6, 4, 10], dtype=torch.int32), "rise"),
    (torch.tensor([4, 10], dtype=torch.int32), "2 offsets for 3 groups"),
    (torch.tensor([4, 4, 10], dtype=torch.int64), "int32"),
    (torch.tensor([[4, 4, 10]], dtype=torch.int32), "1-D"),
])
def test_offsets_a_crafted_file_could_give_raise(offs: torch.Tensor, text: str) -> None:
    a, b = _operands()
    with pytest.raises(ValueError, match=text):
        checked.grouped_mm(a, b, offs=offs)


def test_the_plain_function_stays_off_the_allow_list() -> None:
    from fxprep.io import allowlist

    assert torch._grouped_mm not in allowlist.functions().values()
    assert allowlist.functions()[checked.NAME] is checked.grouped_mm
    assert json.dumps(checked.NAME)  # a plain name in the saved JSON
