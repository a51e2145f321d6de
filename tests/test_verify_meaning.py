"""Verification that proves little says so, and says what it did compare (issue 10).

Before the fix: a meta model died with a raw ``NotImplementedError`` (``aten::equal`` on Meta); an
all-NaN output "passed" with max |diff| 0; a model returning None "passed" with 0 outputs compared;
and a transformers model captured with ``use_cache=False`` passed verification against an original
also run with ``use_cache=False``, so the report never said the prepared Llama returns no
``past_key_values`` while the user's model does. ``check_traceability`` called that Llama "not
traceable" although ``prepare_model`` prepared it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep

from .helpers_models import llama_inputs, tiny_llama

torch.set_num_threads(1)


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> None:
        self.fc(x)
        return None


class NaNOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float("nan")


class HalfNaN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y * float("nan")


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_meta_model_is_verified_on_structure_shapes_and_dtypes(tracer: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.BatchNorm1d(2))
    x = torch.randn(3, 4, device="meta")
    gm = fxprep.prepare_model(model, example_inputs=x, tracer=tracer, progress=False)
    v = fxprep.get_report(gm).verification
    assert v.status == "inconclusive", v
    assert "meta" in v.detail and "shapes and dtypes match" in v.detail
    assert v.outputs_compared == 1
    assert "inconclusive" in fxprep.get_report(gm).to_text()


def test_meta_model_with_wrong_output_shape_still_fails() -> None:
    """On meta, what can be checked is checked: a shape difference is an EquivalenceError."""
    from fxprep.core.inputs import ExampleInputs
    from fxprep.verify import verify

    with torch.device("meta"):
        model = nn.Linear(4, 2)
        other = fxprep.prepare_model(nn.Linear(4, 3), tracer="fx", progress=False)
    with pytest.raises(fxprep.EquivalenceError, match="shape"):
        verify(model, other, ExampleInputs((torch.randn(3, 4, device="meta"),)))


def test_model_returning_none_is_inconclusive_not_passed() -> None:
    gm = fxprep.prepare_model(ReturnsNone(), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    v = fxprep.get_report(gm).verification
    assert v.status == "inconclusive" and v.outputs_compared == 0
    assert "no output tensor" in v.detail


def test_all_nan_output_is_inconclusive_not_passed() -> None:
    gm = fxprep.prepare_model(NaNOut(), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    v = fxprep.get_report(gm).verification
    assert v.status == "inconclusive", v
    assert "NaN" in v.detail


class InfOut(nn.Module):
    """Every output +inf (or -inf): equal infinities gave "passed, max |diff| = 0" (issue 28)."""

    def __init__(self, sign: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.sign = sign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).abs() * (self.sign * float("inf")) + 1.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_all_inf_output_is_inconclusive_not_passed(sign) -> None:
    gm = fxprep.prepare_model(InfOut(sign), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    v = fxprep.get_report(gm).verification
    assert v.status == "inconclusive", v
    assert "non-finite" in v.detail and "inf" in v.detail


def test_one_all_nan_output_among_others_is_named() -> None:
    gm = fxprep.prepare_model(HalfNaN(), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    v = fxprep.get_report(gm).verification
    assert v.status == "passed"
    assert "not compared: out[1] (all NaN or inf)" in v.detail


def test_llama_use_cache_difference_is_stated_and_structure_compared() -> None:
    model = tiny_llama()
    ex = llama_inputs()
    gm = fxprep.prepare_model(model, example_inputs=ex, progress=False)
    report = fxprep.get_report(gm)
    assert report.tracer == "dynamo"
    original = model(**ex)
    key = "cache" if "cache" in original else "past_key_values"  # renamed in transformers 5.24
    assert key in original and key not in gm(**ex)
    assert report.verification.status == "passed"
    assert f"out['{key}'] returned by the original only (captured with use_cache=False)" in report.verification.detail
    assert any("captured with use_cache=False" in n and "past_key_values" in n for n in report.notes)


def test_llama_with_use_cache_fixed_by_the_user_has_no_stated_difference() -> None:
    model = tiny_llama()
    gm = fxprep.prepare_model(model, concrete_args={"use_cache": False}, example_inputs=llama_inputs(), progress=False)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed" and "returned by the original only" not in report.verification.detail
    assert not any("use_cache=False" in n for n in report.notes)


def test_structure_difference_other_than_the_cache_still_fails() -> None:
    """Only the cache is an accepted difference: a missing output anywhere else is a failure."""
    from fxprep.core.inputs import ExampleInputs
    from fxprep.verify import verify

    class Two(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"a": x + 1, "b": x * 2}

    class One(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"a": x + 1}

    with pytest.raises(fxprep.EquivalenceError, match="structure"):
        verify(Two(), fxprep.prepare_model(One(), tracer="fx", progress=False), ExampleInputs((torch.ones(2),)),
               absent={"past_key_values": "captured with use_cache=False"})


@pytest.mark.parametrize("with_inputs", [True, False])
def test_check_traceability_agrees_with_prepare_model_on_llama(with_inputs: bool) -> None:
    model = tiny_llama()
    ex = llama_inputs() if with_inputs else None
    check = fxprep.check_traceability(model, ex, draft_export=False, control_flow=False)
    gm = fxprep.prepare_model(model, example_inputs=ex, progress=False)
    tracer = fxprep.get_report(gm).tracer
    assert check.traceable, check.to_text()
    assert tracer in [a.tracer for a in check.attempts if a.ok], (tracer, check.to_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_output_larger_than_one_comparison_chunk_is_compared_to_its_last_element(dtype: torch.dtype) -> None:
    # outputs are compared a chunk at a time (bounded memory for a VLM's logits): a difference, a NaN
    # or an infinity only in the last chunk, at the last element, is still found
    from fxprep.verify.compare import _CHUNK
    from fxprep.verify.compare import compare as _compare

    ref = torch.randn(3, _CHUNK + 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert _compare((ref,), (ref.clone(),), 0.0, 0.0).problem is None
    off = ref.clone()
    off[-1, -1] += 1
    found = _compare((ref,), (off,), 1e-3, 1e-3)
    assert found.problem is not None and found.worst == pytest.approx(1.0, abs=0.01)
    nan = ref.clone()
    nan[-1, -1] = float("nan")
    assert "NaN at different positions (0 vs 1 NaNs)" in (_compare((ref,), (nan,), 1.0, 1.0).problem or "")
    inf_a, inf_b = ref.clone(), ref.clone()
    inf_a[-1, -1], inf_b[-1, -1] = float("inf"), float("-inf")
    assert "infinities differ" in (_compare((inf_a,), (inf_b,), 1.0, 1.0).problem or "")
    whole = ref[:, ::2]  # not contiguous
    assert _compare((whole,), (whole.clone(),), 0.0, 0.0).worst == 0.0
    ints = torch.arange(3 * (_CHUNK + 5)).reshape(3, -1)
    other = ints.clone()
    other[-1, -1] += 7
    assert _compare((ints,), (other,), 0.0, 0.0).worst == 7.0
