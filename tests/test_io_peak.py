"""The self-check's forward budget (fxprep.io.peak): ``load`` runs each aten op of the loaded graph's
forward on fake tensors before it runs it, and refuses an op that would take the tensors alive past
``LIMITS["forward_bytes"]``. The tamper fuzzer found the case: an input guard edited to a probe of
2**14 x 2**14 token ids (2 GiB, within the probe budget) made a small model's self-check allocate
8 GiB at its embedding and as much at each layer after it, and the test worker was killed for memory."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from fxprep.io import format as io_format
from fxprep.io import peak
from tests.helpers_io import Tied


def _edit_guard(directory, change) -> None:
    path = directory / io.MANIFEST
    manifest = json.loads(path.read_text())
    (param,) = manifest["input_guard"]["params"].values()
    change(param)
    path.write_text(json.dumps(manifest))


def _tied_save(tmp_path):
    torch.manual_seed(0)
    gm = fxprep.prepare_model(Tied().eval(), example_inputs=torch.randint(0, 10, (2, 5)), progress=False)
    return io.save(gm, tmp_path / "tied")


class _RealCalls(TorchDispatchMode):
    """The aten ops called on real tensors (the budget's own fake runs are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(isinstance(t, FakeTensor) for t in pytree.tree_leaves((args, kwargs))):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_budget_follows_what_ops_make_and_free():
    """Sizes worked out by hand: a 1024 x 1024 float32 tensor is 4 MiB; a view or an in-place op
    makes nothing, and a view keeps its storage alive after its base is dropped; a result dropped
    before the next is made does not add to what is alive."""
    mib4 = 1024 * 1024 * 4
    budget = peak._Budget(limit=4 * mib4, held=0, max_tensors=100)
    with budget:
        x = torch.empty(1024, 1024)
        v = x.view(-1)
        x.add_(1)
        assert budget.live == mib4
        y = x + 1
        del y
        z = x * 2
        assert budget.live == 2 * mib4
        w = torch.cat([x, z])
        assert budget.live == 4 * mib4
        del z, w, x
        assert budget.live == mib4  # the view holds x's storage
        budget.node = "the_sum"
        with pytest.raises(peak.ForwardTooLarge) as refused:
            torch.stack([v, v, v, v])  # 16 MiB beside the 4 alive: past the 16 MiB limit
        assert (refused.value.node, refused.value.live, refused.value.need) == ("the_sum", mib4, 4 * mib4)
        del refused, v  # the traceback holds the op's arguments
    assert budget.live == 0 and budget.tensors == 0


def test_a_guard_edited_to_a_huge_probe_is_refused_before_the_layer_runs(tmp_path):
    """The fuzzer's case, at its real size and the real budget: the guard's shape check dropped
    (kind "leaf") and the example made 2**14 x 2**14 ids. The probe (2 GiB) is within the probe budget;
    the embedding would make 8 GiB. It never runs on the real probe."""
    directory = _tied_save(tmp_path)

    def change(param):
        param["kind"] = "leaf"
        param["example"]["shape"] = [2**14, 2**14]

    _edit_guard(directory, change)
    with _RealCalls() as calls, pytest.raises(SerializationError, match=r"would need 8,589,934,592 bytes .*forward_bytes.*"
                                                                        r"It did not run"):
        io.load(directory)
    assert "embedding" not in calls.names


def test_the_budget_counts_what_is_alive_and_names_the_node(tmp_path, monkeypatch):
    """Small sizes, a small budget: 2**12 x 5 ids (160 KiB, held by the caller throughout) embed to
    640 KiB, which runs; the first projection's 640 KiB beside both passes 1 MiB and does not run on
    the real tensors."""
    directory = _tied_save(tmp_path)
    _edit_guard(directory, lambda param: param.update(kind="leaf", example={"shape": [2**12, 5], "dtype": "int64"}))
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 2**20)
    with _RealCalls() as calls, pytest.raises(SerializationError, match=r"node '\w+' would need 655,360 bytes with "
                                                                        r"819,200 already in use"):
        io.load(directory)
    assert calls.names.count("embedding") == 1 and not {"mm", "addmm", "matmul"} & set(calls.names)


class _NonzeroRows(nn.Module):
    """``nonzero``'s output size depends on the values: the fake run cannot follow it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > -100).float().sum(0)


def test_an_op_the_fake_run_cannot_size_is_bounded_by_its_input(tmp_path, monkeypatch):
    x = torch.randn(64, 64)
    gm = fxprep.prepare_model(_NonzeroRows(), example_inputs=x, progress=False)
    directory = io.save(gm, tmp_path / "nonzero")
    assert io.load(directory) is not None  # within the default budget
    # at most every element kept: 4096 rows of two int64 indices, 64 KiB, beside the 16 KiB input and
    # its 4 KiB boolean mask; then the rows as float32 (32 KiB) beside the input and the indices: 112 KiB
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 112 * 1024)
    assert io.load(directory) is not None
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 48 * 1024)
    with _RealCalls() as calls, pytest.raises(SerializationError, match=r"node 'nonzero' would need 65,536 bytes with "
                                                                        r"20,480 already in use"):
        io.load(directory)
    assert "gt" in calls.names and "nonzero" not in calls.names  # refused before it ran


class _ValueSized(nn.Module):
    """An op whose output size is a value in the module's state: what an edited weights file sets."""

    def __init__(self, op: str, n: int):
        super().__init__()
        self.op = op
        self.register_buffer("n", torch.tensor([n]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "bincount":
            made = torch.bincount(self.n)  # n + 1 int64 counts
        else:
            made = torch.repeat_interleave(self.n)  # n int64 indices
        return x + made.sum()


@pytest.mark.parametrize("op", ["bincount", "repeat_interleave"])
def test_an_op_sized_by_a_value_is_read_from_the_value_before_it_runs(tmp_path, monkeypatch, op):
    """2**24 counts or indices are 128 MiB: past a 64 MiB budget, refused before the op runs on the real
    tensors; 2**20 (8 MiB) pass."""
    x = torch.randn(4)
    small = fxprep.prepare_model(_ValueSized(op, 2**20 - 1), example_inputs=x, progress=False)
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 64 * 2**20)
    assert io.load(io.save(small, tmp_path / "small")) is not None
    large = fxprep.prepare_model(_ValueSized(op, 2**24 - 1), example_inputs=x, progress=False)
    with _RealCalls() as calls, pytest.raises(SerializationError, match=r"would need 134,217,7\d\d bytes"):
        io.save(large, tmp_path / "large")
    assert op not in calls.names and not (tmp_path / "large").exists()


def test_hooks_and_python_code_run_once_on_the_real_tensors():
    """The budget runs each aten op on fake tensors, not the node's code: a forward hook on the user's
    module sees one call, with the real output."""
    torch.manual_seed(0)
    model = ModelWithReusedReLU().eval()
    seen: list[type] = []
    model.conv1.register_forward_hook(lambda module, args, out: seen.append(type(out)))
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32), progress=False)
    seen.clear()
    with torch.no_grad():
        peak.Bounded(gm, io_format.LIMITS["forward_bytes"], io_format.LIMITS["forward_tensors"]).run(torch.randn(1, 3, 32, 32))
    assert seen == [torch.Tensor]


def test_save_refuses_a_forward_past_the_budget_and_writes_nothing(tmp_path, monkeypatch):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval(), example_inputs=torch.randn(1, 3, 32, 32), progress=False)
    monkeypatch.setitem(io_format.LIMITS, "forward_bytes", 2**16)
    with pytest.raises(SerializationError, match=r"cannot save to .*load would refuse it: save a module prepared "
                                                 r"with smaller example inputs"):
        io.save(gm, tmp_path / "seed")
    assert not (tmp_path / "seed").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_model_saves_and_loads_within_the_budget(tmp_path, dtype):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).to(dtype).eval()
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    gm = fxprep.prepare_model(model, example_inputs=x, progress=False)
    loaded = io.load(io.save(gm, tmp_path / "resnet"))
    with torch.no_grad():
        assert torch.equal(loaded(x), gm(x))


def test_the_fake_run_writes_nothing_into_the_module():
    """Train-mode BatchNorm counts its batches in a buffer (in place): with each op run on fake tensors
    first, it counts one batch, as eager does, and computes what eager computes."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    gm = fxprep.prepare_model(model, example_inputs=x, progress=False)
    before = int(model.bn1.num_batches_tracked)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = peak.Bounded(gm, io_format.LIMITS["forward_bytes"], io_format.LIMITS["forward_tensors"]).run(x)
    assert int(model.bn1.num_batches_tracked) == before + 1
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(out, model(x))


class _Pieces(nn.Module):
    """Splits its input into one tensor per element (views: no new storage, ~640 bytes each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(x.flatten().unbind()[:2]).sum() + x


def test_a_guard_edited_to_split_a_huge_probe_into_views_is_refused_before_it_splits(tmp_path):
    """2**28 views of a 1 GiB probe would be 170 GB of tensor objects: the unbind is refused by the
    number of pieces its argument asks for, before it runs (or runs on fake tensors)."""
    gm = fxprep.prepare_model(_Pieces(), example_inputs=torch.randn(2, 5), progress=False)
    directory = io.save(gm, tmp_path / "pieces")
    assert io.load(directory) is not None
    _edit_guard(directory, lambda param: param.update(kind="leaf", example={"shape": [2**14, 2**14], "dtype": "float32"}))
    with _RealCalls() as calls, pytest.raises(SerializationError, match=r"would make 268,435,456 tensors with \d+ "
                                                                        r"already alive.*forward_tensors"):
        io.load(directory)
    assert "unbind" not in calls.names


def _graph(build) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return fx.GraphModule(nn.Module(), graph)


def test_pieces_made_op_by_op_are_counted_as_they_are_made():
    """``tensor_split`` into sections is no single aten op (slice after slice): its pieces are
    counted as each is made, and the op that passes the limit is refused."""
    gm = _graph(lambda graph, x: graph.call_function(torch.tensor_split, (x, 5000)))
    x = torch.randn(10)
    assert len(peak.Bounded(gm, 2**30, 5000).run(x)) == 5000
    with pytest.raises(peak.ForwardTooLarge, match=r"node 'tensor_split' would need 1 tensors with 1,000 alive"):
        peak.Bounded(gm, 2**30, 1000).run(x)


def test_tolist_is_checked_for_the_python_objects_it_makes():
    """``tolist`` reads values without an aten op: its node is checked at 32 bytes an element."""
    gm = _graph(lambda graph, x: graph.call_method("tolist", (x,)))
    x = torch.randn(1000)
    assert len(peak.Bounded(gm, 4000 + 32_000, 10).run(x)) == 1000
    with pytest.raises(peak.ForwardTooLarge, match=r"node 'tolist' would need 32,000 bytes with 4,000 alive"):
        peak.Bounded(gm, 4000 + 31_999, 10).run(x)


def test_an_in_place_op_makes_no_new_tensor():
    """A thousand in-place additions on one tensor: one tensor alive, not a thousand."""
    def build(graph, x):
        y = graph.call_function(torch.clone, (x,))
        for _ in range(1000):
            y = graph.call_method("add_", (y, 1.0))
        return y

    x = torch.zeros(4)
    assert torch.equal(peak.Bounded(_graph(build), 2**20, 3).run(x), torch.full((4,), 1000.0))


def test_what_an_op_makes_is_kept_by_its_arguments_and_every_budget_still_checks_it():
    """The second run of an op on arguments of the same metadata takes its size and flops from the
    per-process table instead of a fake run, and a budget with a lower limit still refuses it; an
    argument of other metadata (another shape, or a view sharing the first's storage) is its own entry."""
    mib4 = 1024 * 1024 * 4
    peak._NEEDS.clear()
    x = torch.ones(1024, 1024)
    with peak._Budget(limit=8 * mib4, held=0, max_tensors=100):
        y = x + 1
        del y
    key = peak._op_key(torch.ops.aten.add.Tensor, (x, 1), {})
    assert peak._NEEDS[key][0] == mib4
    assert peak._op_key(torch.ops.aten.add.Tensor, (x[:2], 1), {}) != key
    assert peak._op_key(torch.ops.aten.add.Tensor, (x, x), {}) != peak._op_key(torch.ops.aten.add.Tensor, (x, x.clone()), {})
    with peak._Budget(limit=mib4 // 2, held=0, max_tensors=100), pytest.raises(peak.ForwardTooLarge):
        x + 1  # noqa: B018 - the op is the test
    with peak._Budget(limit=8 * mib4, held=0, max_tensors=100, max_flops=10), pytest.raises(peak.ForwardTooLarge):
        torch.mm(x, x)
    with peak._Budget(limit=8 * mib4, held=0, max_tensors=100, max_flops=10), pytest.raises(peak.ForwardTooLarge):
        torch.mm(x, x)  # the second time from the table: still over the flops budget
