"""Modes a graph enters are left on every path (issue 63): an autocast region, balanced in the graph,
whose inside raises - during save's or load's self-check, or at a call of the prepared or the loaded
module on some input - left autocast on for the whole process (the user's next float32 matmul
returned bfloat16); so would a grad-mode toggle in a graph. Each test makes the inside raise, then
checks the process: autocast off at its nesting level 0, grad mode as it was, a float32 matmul
float32."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxprep
from fxprep import io
from fxprep.runtime.prepared import as_prepared


class _Region(nn.Module):
    """An autocast region around an embedding: token ids out of range raise inside it. ``shift``
    moves the ids down, so the self-check's probe (all ones) is out of range while the example is not."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.shift = shift

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.fc(self.emb(ids - self.shift))
        return y.float()


def _process_is_clean() -> None:
    a = torch.randn(4, 4)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # torch's default for cpu
    assert (a @ a).dtype == torch.float32
    assert torch.autocast_increment_nesting() == 1  # the nesting level was 0
    torch.autocast_decrement_nesting()
    assert torch.is_grad_enabled()


def _prepared(shift: int = 0) -> fx.GraphModule:
    gm = fxprep.prepare_model(_Region(shift).eval(), example_inputs=torch.tensor([[5, 6]]), tracer="dynamo",
                              progress=False)
    assert "_enter_autocast" in gm.code or any("autocast" in repr(m) for m in gm.modules())
    return gm


@pytest.mark.parametrize("loaded", [False, True], ids=["prepared", "loaded"])
def test_autocast_is_left_when_a_call_raises_inside_the_region(tmp_path, loaded):
    gm = _prepared()
    if loaded:
        gm = io.load(io.save(gm, tmp_path / "s"))
    with torch.no_grad():
        assert gm(torch.tensor([[1, 2]])).dtype == torch.float32
        with pytest.raises(IndexError):
            gm(torch.tensor([[1, 20]]))  # out of range, inside the region
    _process_is_clean()


def test_autocast_is_left_when_the_user_had_it_on(tmp_path):
    """The state before the call is what is put back: the user's own region stays on, at its level."""
    gm = io.load(io.save(_prepared(), tmp_path / "s"))
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(IndexError):
            gm(torch.tensor([[1, 20]]))
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    _process_is_clean()


def test_autocast_is_left_when_the_self_check_stops_inside_the_region(tmp_path):
    """save's probe (token ids all ones, minus 5) is out of range inside the region: the save records
    where it stopped, and so does load; neither leaves autocast on."""
    gm = _prepared(shift=5)
    directory = io.save(gm, tmp_path / "s")
    _process_is_clean()
    loaded = io.load(directory)
    _process_is_clean()
    with torch.no_grad():
        torch.testing.assert_close(loaded(torch.tensor([[5, 6]])), gm(torch.tensor([[5, 6]])))
    _process_is_clean()


def _grad_toggle_graph() -> fx.GraphModule:
    """A graph that switches grad off, gathers by an index input (out of range raises), switches it
    back: what Dynamo records for ``with torch.no_grad():``."""
    graph = fx.Graph()
    x, index = graph.placeholder("x"), graph.placeholder("index")
    graph.call_function(torch._C._set_grad_enabled, (False,))
    y = graph.call_function(torch.index_select, (x, 0, index))
    graph.call_function(torch._C._set_grad_enabled, (True,))
    graph.output(y)
    return as_prepared(fx.GraphModule(nn.Module(), graph))


def test_grad_mode_is_left_when_a_call_raises_inside_the_region():
    gm = _grad_toggle_graph()
    x = torch.randn(3, 2)
    assert torch.equal(gm(x, torch.tensor([2])), x[2:3])
    with pytest.raises(IndexError):
        gm(x, torch.tensor([7]))
    _process_is_clean()
    with torch.no_grad():  # the user's own mode is what is put back
        with pytest.raises(IndexError):
            gm(x, torch.tensor([7]))
        assert not torch.is_grad_enabled()
    _process_is_clean()


def test_grad_mode_cannot_be_entered_by_a_save(tmp_path):
    """The load path of grad mode: no save may name a grad toggle (it is an excluded callable), so a
    graph holding one is refused at save, and an edited save naming one at load."""
    gm = _grad_toggle_graph()
    with pytest.raises(fxprep.SerializationError, match="_set_grad_enabled"):
        io.save(gm, tmp_path / "s")
    _process_is_clean()


def test_an_autocast_region_entered_with_computed_arguments_fails_to_load(tmp_path):
    """An enter whose device type is not a literal torch.autocast knows cannot be checked (nor left)."""
    from tests.helpers_io import _edit

    directory = io.save(_prepared(), tmp_path / "s")

    def change(data):
        for entry in data["modules"]:
            if "_enter_autocast" in str(entry.get("fn")):
                entry["args"][0] = "cuda:0/../x"
    _edit(directory, io.MODULES, change)
    with pytest.raises(fxprep.SerializationError, match="autocast region opened at node"):
        io.load(directory)
    _process_is_clean()
