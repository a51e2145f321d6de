"""A saved module whose output is a model's own container type loads in a fresh process."""

from __future__ import annotations

import torch

import fxprep
from fxprep import io


def test_a_models_own_output_container_loads_in_a_fresh_process(tmp_path):
    """Llava's output (``LlavaCausalLMOutputWithPast``) is defined in its modelling module, which
    ``import transformers`` does not import: a new interpreter refused the saved calling convention
    ("not registered") until load imported transformers' own modelling module by the type's name."""
    import subprocess
    import sys

    from tests import vlm_models

    model, _ = vlm_models.llava_pixtral()
    ids = torch.randint(3, 90, (1, 10))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids})
    directory = io.save(gm, tmp_path / "llava")
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = gm(input_ids=ids)
    assert type(expected).__module__ == "transformers.models.llava.modeling_llava"
    code = (
        "import sys, torch, fxprep.io as io\n"
        "assert 'transformers.models.llava.modeling_llava' not in sys.modules\n"
        f"gm = io.load({str(directory)!r})\n"
        f"out = gm(input_ids=torch.load({str(tmp_path / 'ids.pt')!r}))\n"
        "print(type(out).__name__)\n"
        f"torch.save(out.logits, {str(tmp_path / 'y.pt')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "LlavaCausalLMOutputWithPast"
    assert torch.equal(torch.load(tmp_path / "y.pt"), expected.logits)
