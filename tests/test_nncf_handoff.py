"""fxprep.compat.nncf on a prepared graph against NNCF on the original model (issue 29)."""

from __future__ import annotations

import nncf
import torch
from nncf.torch.function_hook.wrapper import get_hook_storage

import fxprep
from fxprep.compat import nncf as fx_nncf

from .toolkit_cases import build, inputs


def test_nncf_quantizes_the_prepared_graph_like_the_original_inputs_included():
    """NNCF quantizes a model's inputs by the names of ``forward``'s parameters: the graph handed
    over as ``forward(*args)`` lost resnet18's input quantizer (22.64 dB against 22.81 dB)."""
    x, calibration = inputs("resnet18")
    calibration = calibration[:1]
    original = nncf.quantize(build("resnet18"), nncf.Dataset(calibration), subset_size=1)
    gm = fxprep.prepare_model(build("resnet18"), example_inputs=(x,))
    ours = fx_nncf.quantize(gm, nncf.Dataset(calibration), subset_size=1)

    input_hooks = [name for name, _ in get_hook_storage(ours).named_modules() if name.startswith("post_hooks.x__")]
    assert input_hooks, "no quantizer on the graph's input x"
    with torch.no_grad():
        torch.testing.assert_close(ours(x), original(x), rtol=0, atol=1e-5)
    assert sorted(type(m).__name__ for m in get_hook_storage(ours).modules()) == sorted(
        type(m).__name__ for m in get_hook_storage(original).modules())
