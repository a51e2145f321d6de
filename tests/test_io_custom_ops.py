"""A save whose graph calls a library's custom op (``torch.ops.transformers.grouped_mm_fallback``,
which transformers' MoE layers call) loads in a fresh process once that library is trusted.

transformers registers that op in ``transformers.integrations.moe``, which ``import transformers``
does not import: before, ``load(dir, trusted_modules=["transformers"])`` in a new process refused
the op, and the refusal told the user to trust ``torch.ops`` (all of torch). The save now records
the module that registers each custom op, and load imports it only inside a trusted package.
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
from fxprep import io
from fxprep.cli.tiny import tiny_config
from fxprep.errors import SerializationError

_LOAD = """
import sys, torch
import fxprep
assert "transformers" not in sys.modules
saved, trusted = sys.argv[1], sys.argv[2:]
try:
    gm = fxprep.load(saved, trusted_modules=trusted)
except fxprep.SerializationError as err:
    print("REFUSED", err)
    raise SystemExit(0)
ref = torch.load(saved + ".ref.pt")
with torch.no_grad():
    out = gm(input_ids=ref["ids"])
logits = out.logits if hasattr(out, "logits") else out[0]
print("DIFF", float((logits - ref["logits"]).abs().max()))
"""


@pytest.fixture(scope="module")
def moe_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("qwen2_moe")
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 50, (2, 9))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(0, 50, (1, 8))})
    called = {str(m.fn) for m in gm.modules() if isinstance(m, fxprep.ops.BoundOp)}
    called |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("grouped_mm_fallback" in c for c in called), "the MoE layer no longer calls the custom op"
    target = tmp_path_factory.mktemp("moe") / "saved"
    fxprep.save(gm, target)
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(input_ids=ids).logits}, str(target) + ".ref.pt")
    return target


def _load_in_fresh_process(saved: Path, *trusted: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _LOAD, str(saved), *trusted], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_save_names_the_module_that_registers_the_op(moe_save: Path) -> None:
    manifest = json.loads((moe_save / io.MANIFEST).read_text())
    assert manifest["op_modules"] == {"transformers::grouped_mm_fallback": "transformers.integrations.moe"}


def test_a_fresh_process_trusting_the_library_loads_and_runs_it(moe_save: Path) -> None:
    out = _load_in_fresh_process(moe_save, "transformers")
    assert out.startswith("DIFF"), out
    assert float(out.split()[1]) < 1e-5


def test_without_trust_the_refusal_names_the_library_not_torch_ops(moe_save: Path) -> None:
    out = _load_in_fresh_process(moe_save)
    assert out.startswith("REFUSED") and "torch.ops.transformers.grouped_mm_fallback" in out, out
    assert "trusted_modules=['transformers']" in out and "'torch.ops'" not in out


def test_recorded_modules_are_imported_only_inside_trusted_packages() -> None:
    """A save may name any module: it is imported only where the op's namespace is a trusted
    library and the module lies inside a trusted package (``json.tool``: harmless, rarely imported)."""
    sys.modules.pop("json.tool", None)
    io.TrustPolicy(("json",)).import_op_modules({"other::op": "json.tool"})  # namespace not trusted
    io.TrustPolicy(("other",)).import_op_modules({"other::op": "json.tool"})  # module outside the trust
    io.TrustPolicy(("json",)).import_op_modules({"aten::add": "json.tool"})  # aten is never a library's
    io.TrustPolicy(("json",)).import_op_modules({"json::op": "json..tool"})  # not a module path
    assert "json.tool" not in sys.modules
    io.TrustPolicy(("json",)).import_op_modules({"json::op": "json.tool"})
    assert "json.tool" in sys.modules
    for malformed in (["json.tool"], {"json::op": 3}, "json.tool"):
        with pytest.raises(SerializationError, match="malformed op_modules"):
            io.TrustPolicy(("json",)).import_op_modules(malformed)


def test_a_trusted_namespace_whose_op_is_missing_says_so() -> None:
    with pytest.raises(SerializationError, match="namespace is trusted, but this process has no such op"):
        io.TrustPolicy(("transformers",)).function("torch.ops.transformers.no_such_op")
