"""dynamo+values: values read from data decided from the example, checked on every call (issue 13).

Pixtral slices each image to its ``image_sizes``; Dynamo stops at the size that slice makes, and
the opaque-leaf fallback then hid the whole vision tower. Capturing again with the example's real
values gets every layer into the graph; the graph keeps each decision as a check, so another input
that decides the same way runs and one that decides otherwise raises InputMismatch (never a torch
assert). Taken only when the opaque parts would hide layers and the decisions do not follow the
activations (a branch on computed values stays an opaque part, which runs both ways).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprep
from fxprep.capture.dynamo.recording import perturbed
from fxprep.core.inputs import ExampleInputs

from .helpers import assert_unchanged, module_snapshot
from .helpers_models import Tower


class Head(nn.Module):
    """Keeps the first ``n`` positions (``n`` an integer input's value), then branches on how many."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = h[:, : int(n)]
        if h.shape[1] > 1:  # a question about a size read from data: Dynamo alone cannot answer it
            h = h - h.mean(1, keepdim=True)
        return self.proj(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = Head()

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x), n)


def test_sizes_from_an_integer_input_are_decided_and_every_layer_is_captured() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    before = module_snapshot(model)
    x = torch.randn(2, 6, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x, torch.tensor(4)))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+values" and report.verification.status == "passed"
    assert report.leaves == {}  # the fallback had made 'head' opaque, hiding head.proj
    tried = [a.tracer for a in report.attempts]
    assert tried[0] == "dynamo" and not report.attempts[0].ok and "dynamo+leaves" in tried
    calls = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert {"stem", "head.proj"} <= calls and gm.get_submodule("head.proj") is model.head.proj
    assert any("rather than with opaque parts hiding 1 layer(s) (head.proj)" in note for note in report.notes)
    assert any("test_values.py" in note and "checked on every call" in note for note in report.notes)
    # another value deciding the same way: the same result as the model
    other = torch.randn(2, 6, 8)
    for n in (2, 3, 6):
        torch.testing.assert_close(gm(other, torch.tensor(n)), model(other, torch.tensor(n)))
    # one deciding otherwise (one position kept: the branch goes the other way) is refused, by name
    with pytest.raises(fxprep.InputMismatch, match=r"test_values\.py:\d+.*modules_to_exclude"):
        gm(other, torch.tensor(1))
    assert_unchanged(model, before)


def test_a_loaded_graph_still_names_where_a_broken_decision_was_taken(tmp_path) -> None:
    """The save format keeps no node stack traces; the check's own message carries its location."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 6, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x, torch.tensor(4)))
    fxprep.save(gm, tmp_path / "net")
    loaded = fxprep.load(tmp_path / "net")
    torch.testing.assert_close(loaded(x, torch.tensor(3)), model(x, torch.tensor(3)))
    with pytest.raises(fxprep.InputMismatch, match=r"at \S*test_values\.py:\d+: h = h\[:, : int\(n\)\]"):
        loaded(x, torch.tensor(1))


def test_decisions_that_follow_activations_stay_an_opaque_part() -> None:
    """Each block branches on values its first layer computes (``.tolist()`` of a count): decided
    from the example, the checks would refuse most other inputs."""
    torch.manual_seed(0)
    model = Tower().eval()
    x = torch.randn(4, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+leaves" and set(report.leaves) == {f"blocks.{i}" for i in range(3)}
    values = [a for a in report.attempts if a.tracer == "dynamo+values"]
    assert len(values) == 1 and not values[0].ok
    assert "decided from activations" in values[0].error
    for _ in range(3):  # the opaque part runs every input its own way
        other = torch.randn(4, 8)
        torch.testing.assert_close(gm(other), model(other))


def test_no_values_capture_when_the_opaque_parts_hide_no_layer() -> None:
    """Post-processing made opaque hides nothing a quantizer needs: the fallback's graph, which
    runs for any input, is kept, and no second capture is paid for."""

    class Post(nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return s[: int((s > 0).sum())]

    class Det(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.score = nn.Linear(8, 1)
            self.post = Post()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.score(x).squeeze(-1)
            out = self.post(s)
            return out.sum() if out.shape[0] > 1 else out.sum() * 2

    torch.manual_seed(0)
    model = Det().eval()
    x = torch.randn(6, 8)
    gm = fxprep.prepare_model(model, example_inputs=(x,))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+leaves" and "post" in report.leaves
    assert "dynamo+values" not in [a.tracer for a in report.attempts]


def test_perturbed_inputs_shuffle_floats_and_keep_integers() -> None:
    call = ExampleInputs((torch.arange(12.0).reshape(3, 4),), {"sizes": torch.tensor([3, 4])})
    a, b = perturbed(call, seed=0), perturbed(call, seed=1)
    assert not torch.equal(a.args[0], call.args[0]) and not torch.equal(a.args[0], b.args[0])
    assert torch.equal(a.args[0].flatten().sort().values, call.args[0].flatten())  # same values, other places
    assert torch.equal(a.kwargs["sizes"], call.kwargs["sizes"])


def window_lengths(grid: torch.Tensor) -> torch.Tensor:
    """Tokens per run of equal image heights: ``itertools.groupby``, which Dynamo cannot trace
    (Qwen-VL's rope index and window index are built this way)."""
    import itertools

    runs = [sum(h * w for _, h, w in group) for _, group in itertools.groupby(grid.tolist(), lambda row: row[1])]
    return torch.tensor(runs)


class Windows(nn.Module):
    """Splits the sequence by lengths an opaque helper computed, one projection per window."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        parts = torch.split(h, lengths.tolist(), dim=0)
        # a question about a size the helper decided: Dynamo alone cannot answer it
        return torch.cat([self.proj(p - p.mean(0, keepdim=True) if p.shape[0] > 1 else p) for p in parts])


class WindowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.windows = Windows()

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return self.windows(self.embed(x), window_lengths(grid))


def test_a_value_an_opaque_part_computes_is_decided_from_its_real_output() -> None:
    """Qwen2.5-VL's shape: a helper Dynamo cannot trace computes window lengths, and a layer splits
    by ``lengths.tolist()``. The helper stays opaque; under real-value capture it runs on the real
    inputs so the split is decided from its true output (not from the empty tensor Dynamo
    would otherwise carry), and the layer after it is in the graph."""
    torch.manual_seed(0)
    model = WindowNet().eval()
    grid = torch.tensor([[1, 2, 2], [1, 2, 1], [1, 3, 2]])  # runs of heights 2, 2, 3 -> windows 6, 6
    x = torch.randn(12, 4)
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=(x, grid))
    report = gm.fxprep_report
    assert report.tracer == "dynamo+values" and report.verification.status == "passed"
    assert list(report.leaves) == ["window_lengths"], report.leaves  # only the helper, not the layer
    calls = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert {"embed", "windows.proj"} <= calls and gm.get_submodule("windows.proj") is model.windows.proj
    other = torch.randn(12, 4)
    torch.testing.assert_close(gm(other, grid), model(other, grid))
    # windows of other lengths decide the split otherwise: refused by name, never a wrong result
    with pytest.raises(fxprep.InputMismatch, match=r"test_values\.py:\d+"):
        gm(other, torch.tensor([[1, 2, 2], [1, 3, 2], [1, 3, 2]]))
    assert_unchanged(model, before)


def test_an_onnx_export_that_cannot_hold_an_opaque_part_says_which(tmp_path) -> None:
    """No ONNX graph can hold Python that reads values from data; the TorchScript exporter's
    fallback folds the grid into constants. The error names both exporters' reasons and the
    opaque part, not only the folded input."""
    torch.manual_seed(0)
    model = WindowNet().eval()
    grid = torch.tensor([[1, 2, 2], [1, 2, 1], [1, 3, 2]])
    x = torch.randn(12, 4)
    gm = fxprep.prepare_model(model, example_inputs=(x, grid))
    with pytest.raises(fxprep.ExportError) as raised:
        fxprep.export_onnx(gm, (x, grid), tmp_path / "windows.onnx")
    text = str(raised.value)
    assert "torch.export-based exporter had failed first" in text
    assert "opaque parts (window_lengths)" in text


class _Frequencies(nn.Module):
    """A 3-axis table read one axis at a time (Qwen2-VL's multimodal rotary frequencies), scaled by
    a value read from data: each ``table[i]`` is a view whose storage offset is ``i * seq * 4``."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        table = torch.stack([x, 2 * x, 3 * x])
        k = int(n)
        if k > 1:  # decided from the example's value
            return table[1] * k + table[2]
        return table[0]


def test_a_view_with_a_symbolic_offset_leaves_a_declared_dimension_dynamic_under_real_values() -> None:
    # torch's real-value cross-check compares each output's storage offset with `!=`, whatever
    # its flag says; on `table[1]` (offset seq*4) that guard specialised seq to the example's 5
    from torch.export import Dim

    from fxprep.capture.dynamo.export import dynamo_export

    x, n = torch.randn(1, 5, 4), torch.tensor(3)
    seq = Dim("seq")
    result = dynamo_export(_Frequencies(), ExampleInputs((x, n), {}), "flag", {"x": {1: seq}, "n": None},
                           real_values=True)
    gm = result.graph_module
    for length in (2, 5, 11):
        y = torch.randn(1, length, 4)
        torch.testing.assert_close(gm(y, n), _Frequencies()(y, n))


class _Routed(nn.Module):
    """Tokens gathered in the order of their sorted expert ids, ``top_k`` choices each (transformers'
    grouped mixture-of-experts forward: ``hidden_states[perm // num_top_k]``), scaled by a value
    read from data."""

    def forward(self, x: torch.Tensor, experts: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        _, perm = torch.sort(experts.reshape(-1))
        k = int(n)
        return x[perm // experts.shape[-1]] * k


def test_an_integer_floor_division_leaves_a_declared_dimension_dynamic_under_real_values() -> None:
    # `perm // 2` on integers decomposes through prims.signbit, whose fake kernel gives int64 where
    # the real one gives bool; torch's repair of the mismatch made the sizes fresh unbacked symbols
    # (PendingUnbackedSymbolNotFound), so the whole part became opaque with the length declared
    from torch.export import Dim

    from fxprep.capture.dynamo.export import dynamo_export

    x, experts, n = torch.randn(6, 4), torch.randint(0, 4, (6, 2)), torch.tensor(3)
    seq = Dim("seq")
    result = dynamo_export(_Routed(), ExampleInputs((x, experts, n), {}), "flag",
                           {"x": {0: seq}, "experts": {0: seq}, "n": None}, real_values=True)
    gm = result.graph_module
    assert "floordiv" in gm.code
    for length in (2, 6, 13):
        y, e = torch.randn(length, 4), torch.randint(0, 4, (length, 2))
        out = gm(y, e, n)
        assert out.shape == (2 * length, 4)
        torch.testing.assert_close(out, _Routed()(y, e, n))
