"""Code of a trusted package behind a wrapper object at its own name (the ``kernels`` package's
function modules over transformers' mamba scans) saves and loads by that name, by identity."""

from __future__ import annotations

import pytest
import torch

import fxprep
from fxprep.io.trust import TrustPolicy
from tests import wrapped_code
from tests.helpers_io import tiny_causal_lm_round_trip


def test_the_function_inside_a_wrapper_at_its_name_is_found_by_identity() -> None:
    policy = TrustPolicy.of(["tests.wrapped_code"])
    assert isinstance(wrapped_code.scan, torch.nn.Module)  # the name holds the wrapper
    assert policy.function("tests.wrapped_code.scan") is wrapped_code.SCAN
    assert policy.trusted_code(wrapped_code.SCAN)
    assert policy.function("tests.wrapped_code.other") is wrapped_code.other  # a plain function, as before


def test_a_wrapper_holding_a_function_of_another_name_is_refused() -> None:
    policy = TrustPolicy.of(["tests.wrapped_code"])
    with pytest.raises(fxprep.SerializationError, match="tests.wrapped_code.elsewhere"):
        policy.function("tests.wrapped_code.elsewhere")  # holds `scan`, which does not name itself so
    with pytest.raises(fxprep.SerializationError, match="not one fxprep trusts"):
        TrustPolicy.of(["torchvision"]).function("tests.wrapped_code.scan")


def test_a_mamba_scan_kept_opaque_saves_and_loads_with_transformers_trusted() -> None:
    # with `kernels` installed, modeling_bamba.mamba2_chunk_scan is a module wrapping the function the
    # prepared graph calls; the save named the function and refused it though transformers was trusted
    ids = torch.randint(3, 99, (2, 11))
    model, loaded = tiny_causal_lm_round_trip("bamba", ids)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids)[0], model(input_ids=ids, use_cache=False).logits,
                                   rtol=0, atol=0)
