"""Each diagnostic category: a small model that triggers it, with category, file, line and fix."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

import fxprep
from fxprep.reporting import diagnose as d


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if text in line:
            return start + i
    raise AssertionError(text)


class Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Value(nn.Module):
    def forward(self, x):
        return x * float(x.mean())


class Iterate(nn.Module):
    def forward(self, x):
        return sum(row for row in x)


class Constructor(nn.Module):
    def forward(self, x):
        return x * torch.Tensor(x.shape[0], 1).fill_(1)


class NonTorch(nn.Module):
    def forward(self, x):
        return torch.from_numpy(np.tanh(x.numpy()))


class Outer(nn.Module):
    """The failing code sits in a submodule: the issue names that submodule."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.pre(x))


FX_CASES = [
    (Branch, "if x.sum() > 0:", d.DATA_DEPENDENT_BRANCH, "torch.where"),
    (Value, "float(x.mean())", d.DATA_DEPENDENT_VALUE, "torch._check"),
    (Iterate, "for row in x", d.ITERATION, "fxprep.opaque"),
    (Constructor, "torch.Tensor(x.shape[0], 1)", d.CONSTRUCTOR, "zeros_like"),
    (NonTorch, "np.tanh", d.NON_TORCH_CALL, "torch equivalent"),
]


@pytest.mark.parametrize(("cls", "code", "category", "fix"), FX_CASES, ids=[c[2] for c in FX_CASES])
def test_fx_categories(cls, code, category, fix):
    model = Outer(cls())
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(model, tracer="fx", fallback="error", example_inputs=torch.randn(3, 4))
    issue = info.value.issues[0]
    assert issue.category == category
    assert issue.module == "inner"
    assert issue.file == __file__
    assert issue.line == _line_of(cls.forward, code)
    assert code in issue.code
    assert fix in issue.fix
    assert issue.tracer == "fx"
    text = str(info.value)
    assert f"test_diagnose.py:{issue.line}" in text and category.upper() in text


class Printing(nn.Module):
    def forward(self, x):
        print("mean is", x.mean().item())
        return x * 2


@torch.library.custom_op("fxprep_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class CustomOp(nn.Module):
    def forward(self, x):
        return torch.ops.fxprep_test.twice(x) + 1


DYNAMO_CASES = [
    (Printing, "print(", d.SIDE_EFFECT, "out of forward()"),
    (CustomOp, "torch.ops.fxprep_test.twice", d.CUSTOM_OP, "register_fake"),
]


@pytest.mark.parametrize(("cls", "code", "category", "fix"), DYNAMO_CASES, ids=[c[2] for c in DYNAMO_CASES])
def test_dynamo_categories(cls, code, category, fix):
    check = fxprep.check_traceability(Outer(cls()), example_inputs=torch.randn(3, 4), draft_export=False)
    dynamo = [i for i in check.issues if i.tracer == "dynamo"]
    assert dynamo, check.to_text()
    issue = dynamo[0]
    assert issue.category == category
    assert issue.file == __file__
    assert issue.line == _line_of(cls.forward, code)
    assert fix in issue.fix
    # fx records both as plain calls, so the model still prepares and verifies
    gm = fxprep.prepare_model(Outer(cls()), example_inputs=torch.randn(3, 4))
    assert gm.fxprep_report.verification.status == "passed"
    assert any(a.tracer == "dynamo" and not a.ok for a in gm.fxprep_report.attempts)


def test_user_code_includes_site_packages_models():
    import torchvision

    assert d.is_user_file(inspect.getsourcefile(torchvision.models.detection.transform.GeneralizedRCNNTransform))
    assert not d.is_user_file(torch.__file__)
    assert not d.is_user_file(inspect.getsourcefile(inspect))
    assert d.is_user_file(__file__)


def test_every_category_has_a_fix():
    categories = [d.DATA_DEPENDENT_BRANCH, d.DATA_DEPENDENT_VALUE, d.ITERATION, d.CONSTRUCTOR, d.NON_TORCH_CALL,
                  d.SIDE_EFFECT, d.AUTOGRAD_FUNCTION, d.CUSTOM_OP, d.SPECIALISATION, d.UNSUPPORTED, d.DECORATED_FORWARD, d.OTHER]
    for c in categories:
        assert c in d.FIXES and d.FIXES[c]


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 3:
            return self.lin(x) * 2
        return self.lin(x)


def test_specialisation_of_a_dynamic_dimension():
    with pytest.raises(fxprep.TraceFailure) as info:
        fxprep.prepare_model(ShapeBranch(), example_inputs=torch.randn(3, 4), tracer="dynamo", dynamic="batch",
                             fallback="error")
    issue = info.value.issues[0]
    assert issue.category == d.SPECIALISATION
    assert issue.file == __file__ and issue.line == _line_of(ShapeBranch.forward, "if x.shape[0] == 3")
    assert "dynamic" in issue.fix
    assert issue.module == ""


class DataDependentBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if grad.sum() > 0:
            return grad * 2
        return grad


class UsesFunction(nn.Module):
    def forward(self, x):
        return DataDependentBackward.apply(x)


def test_autograd_function_category_and_fx_keeps_it_one_call():
    x = torch.randn(3, requires_grad=True)
    check = fxprep.check_traceability(UsesFunction(), example_inputs=(x,), draft_export=False)
    issue = [i for i in check.issues if i.tracer == "dynamo"][0]
    assert issue.category == d.AUTOGRAD_FUNCTION
    assert issue.line == _line_of(DataDependentBackward.backward, "if grad.sum() > 0")
    assert "fxprep.opaque" in issue.fix
    gm = fxprep.prepare_model(UsesFunction(), example_inputs=(x,), verify="grad")
    assert gm.fxprep_report.tracer == "fx"
    assert gm.fxprep_report.verification.grad


def test_a_dynamo_stop_inside_the_standard_library_is_shown_at_the_models_line(tmp_path) -> None:
    """Dynamo stopped in ``inspect.Signature._bind`` (called by a transformers decorator on
    Mistral3's ``get_image_features``): the issue names the user's line that called into the
    standard library, and an ``Unsupported`` whose text does not say so is unsupported Python."""
    import inspect as inspect_module
    import traceback

    from fxprep.reporting.diagnose import UNSUPPORTED, categorise, user_frame

    user = tmp_path / "decorators.py"
    user.write_text("def wrapper(self, *args, **kwargs):\n    arguments = signature.bind(self, *args, **kwargs)\n")
    stdlib = inspect_module.__file__

    class Unsupported(Exception):  # noqa: N818 - Dynamo's own name, which categorise reads
        pass

    err = Unsupported(
        "mapping proxy affected by dictionary mutation\n\nfrom user code:\n"
        f'  File "{user}", line 2, in wrapper\n    arguments = signature.bind(self, *args, **kwargs)\n'
        f'  File "{stdlib}", line 3081, in _bind\n    parameters = iter(self.parameters.values())\n')
    err.innermost_user_frame_summary = traceback.FrameSummary(stdlib, 3081, "_bind")
    assert user_frame(err) == (str(user), 2, "arguments = signature.bind(self, *args, **kwargs)")
    assert categorise(err, "arguments = signature.bind(self, *args, **kwargs)") == UNSUPPORTED


def test_a_traceback_entry_without_a_line_number_does_not_break_the_report() -> None:
    """A frame whose bytecode Dynamo rewrote can have ``tb_lineno`` None (Python 3.11; torch 2.8 with
    transformers 5.0's Wav2Vec2): locating the user's frame raised a bare TypeError from linecache
    instead of describing the failure."""
    import sys
    import types

    def user_code() -> None:
        raise RuntimeError("shape mismatch in the user's model")

    try:
        user_code()
    except RuntimeError as caught:
        err = caught
    assert err.__traceback__ is not None
    lost = types.TracebackType(err.__traceback__, sys._getframe(), 10**6, -1)  # no line for this lasti
    assert lost.tb_lineno is None
    err = err.with_traceback(lost)
    text = d.describe_exception(err)
    assert "shape mismatch in the user's model" in text


class _Padded(nn.Module):
    @staticmethod
    def _pad(x):
        return nn.functional.pad(x, (1, 1))

    def forward(self, x):
        return self._pad(x)


class _Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = _Padded()

    def forward(self, x):
        return self.conv(x)


def test_an_internal_dynamo_error_is_placed_in_the_module_its_printed_stack_names() -> None:
    """Dynamo's internal errors (Mimi's ``PendingUnbackedSymbolNotFound`` in a static padding
    helper) carry no stack record, only the user stack printed in their text, innermost last:
    the innermost frame is the static method, no module's ``forward``; the module is the one
    whose ``forward`` called it (it was "unknown module" before)."""
    import traceback

    here = inspect.getsourcefile(_Padded)
    call = _line_of(_Padded.forward, "self._pad(x)")
    pad = _line_of(_Padded._pad, "nn.functional.pad")
    outer = _line_of(_Codec.forward, "self.conv(x)")

    class InternalTorchDynamoError(RuntimeError):
        pass

    err = InternalTorchDynamoError(
        "PendingUnbackedSymbolNotFound: Pending unbacked symbols {u0}\n\nfrom user code:\n"
        f'  File "{here}", line {outer}, in forward\n    return self.conv(x)\n'
        f'  File "{here}", line {call}, in forward\n    return self._pad(x)\n'
        f'  File "{here}", line {pad}, in _pad\n    return nn.functional.pad(x, (1, 1))\n')
    err.innermost_user_frame_summary = traceback.FrameSummary(here, pad, "_pad")
    (issue,) = d.diagnose(err, "dynamo", _Codec())
    assert issue.module == "conv" and issue.line == pad
