"""fxprep.show: what the graph view says about each node (kinds, scopes, shapes), from a live module
and from a saved directory, and that the page is self-contained. The page in a real browser:
tests/test_show_browser.py."""

from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from torch import nn

import fxprep
from fxprep.cli.demo import ModelWithFunctionalReLU, ModelWithReusedReLU
from fxprep.view import describe, describe_saved


@fxprep.opaque
def normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.abs().max()


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: no tracer takes it, so it becomes an opaque part
            return x * 2
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + F.relu(x)


class Mixed(nn.Module):
    """Everything the view distinguishes: own modules, added ones, a reused one, an opaque part,
    an op left functional, a view op, nesting."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.gate = Gate()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        x = self.gate(self.blocks(x))
        x = normalise(self.act(x))
        return x.reshape(-1)


def _by_module(view):
    return {n["module"]: n for n in view["nodes"] if n["op"] == "call_module"}


def test_kinds_scopes_and_shapes_of_a_live_module():
    model = Mixed().eval()
    x = torch.ones(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x)
    view = describe(gm, x)
    mods = _by_module(view)
    assert mods["stem"]["kind"] == "module" and mods["stem"]["scope"] == ""
    assert mods["blocks.0.fc"]["kind"] == "module" and mods["blocks.0.fc"]["scope"] == "blocks.0"
    added = [m for m, n in mods.items() if n["kind"] == "added"]
    assert "blocks.0.relu" in added and "blocks.1.add" in added  # F.relu and + became modules
    assert mods["blocks.0.relu"]["detail"] == "torch.nn.functional.relu → nn.ReLU"
    assert mods["act"]["kind"] == "unrolled" and mods["act_1"]["kind"] == "unrolled"
    assert mods["act_1"]["detail"] == "call 2 of 2 of act: a copy sharing act's parameters"
    assert mods["gate"]["kind"] == "opaque" and mods["gate"]["detail"].startswith("data-dependent branch at ")
    functions = {n["label"].rpartition(".")[2] if "normalise" in n["label"] else n["label"]: n
                 for n in view["nodes"] if n["op"] in ("call_function", "call_method")}
    assert functions["normalise"]["kind"] == "left" and "opaque" in functions["normalise"]["detail"]
    assert functions["Tensor.reshape"]["kind"] == "functional"
    for n in view["nodes"]:  # the run on x recorded every value
        if n["op"] != "output":
            assert n["values"] and n["values"][0]["dtype"] == "float32", n
    assert mods["stem"]["values"] == [{"shape": [2, 4], "dtype": "float32"}]
    assert functions["Tensor.reshape"]["values"] == [{"shape": [8], "dtype": "float32"}]
    assert view["title"] == "Mixed" and "modules added" in view["report_text"]


def test_shapes_without_example_inputs_come_from_the_capture():
    """Dynamo records every value (fake tensors): the view shows them without running anything."""
    model = ModelWithFunctionalReLU().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(1, 3, 32, 32))
    assert gm.fxprep_report.tracer == "dynamo"
    mods = _by_module(describe(gm))
    assert mods["conv1"]["values"] == [{"shape": [1, 6, 28, 28], "dtype": "float32"}]
    assert mods["fc2"]["values"] == [{"shape": [1, 10], "dtype": "float32"}]


def test_running_for_shapes_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4), tracer="fx")
    before = model[1].running_mean.clone()
    describe(gm, torch.randn(3, 4) + 5)
    assert torch.equal(model[1].running_mean, before)


def test_saved_view_reads_the_report_and_input_shapes(tmp_path):
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    gm = fxprep.prepare_model(model, example_inputs=x)
    fxprep.save(gm, tmp_path / "saved", example_inputs=x)
    view = describe_saved(tmp_path / "saved")
    live = describe(gm)
    assert [n["name"] for n in view["nodes"]] == [n["name"] for n in live["nodes"]]
    assert [n["kind"] for n in view["nodes"]] == [n["kind"] for n in live["nodes"]]
    assert [n["module"] for n in view["nodes"] if n["kind"] == "unrolled"] == ["relu", "relu_1", "relu_2", "relu_3"]
    placeholder = view["nodes"][0]
    assert placeholder["op"] == "placeholder" and placeholder["values"] == [{"shape": [1, 3, 32, 32], "dtype": "float32"}]
    assert view["report"]["verification"]["status"] == "passed" and "reused modules unrolled" in view["report_text"]


def test_show_writes_a_self_contained_page(tmp_path):
    model = Mixed().eval()
    x = torch.ones(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x, name="</script><script>alert(1)</script>")
    path = fxprep.show(gm, tmp_path / "g.html", example_inputs=x)
    page = path.read_text()
    assert "default-src 'none'" in page  # nothing may be fetched at view time
    assert re.findall(r"<[^>]+\s(?:src|href)\s*=", page) == []  # no external script, style or image
    assert [u for u in re.findall(r"https?://[^\s\"'<>]+", page) if u != "http://www.w3.org/2000/svg"] == []
    assert page.count("<script") == 3 and page.count("</script>") == 3  # the user's name did not end a script
    data = json.loads(page.split('id="fxprep-data">')[1].split("</script>")[0])
    assert len(data["nodes"]) == len(gm.graph.nodes) and data["title"] == "</script><script>alert(1)</script>"
    assert "&lt;/script&gt;" in page.split("<title>")[1]


def test_show_from_a_saved_directory_and_errors(tmp_path):
    gm = fxprep.prepare_model(ModelWithReusedReLU().eval(), example_inputs=torch.randn(1, 3, 32, 32))
    fxprep.save(gm, tmp_path / "saved")
    page = fxprep.show(tmp_path / "saved", tmp_path / "s.html").read_text()
    assert '"kind":"unrolled"' in page
    for bad, error in [((42,), fxprep.InvalidInput), ((str(tmp_path / "nothing"),), fxprep.SerializationError),
                       ((gm, tmp_path / "no" / "dir" / "g.html"), fxprep.SerializationError)]:
        try:
            fxprep.show(*bad)
        except error:
            pass
        else:
            raise AssertionError(f"fxprep.show{bad} did not raise {error.__name__}")


def test_big_graph_folds_into_modules():
    """The page folds by module: every node of a 12-block model has a scope, so the page opens on
    twelve boxes, not a column of every node."""
    model = nn.Sequential(*[Block() for _ in range(12)]).eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 4))
    view = describe(gm)
    scopes = {n["scope"].split(".")[0] for n in view["nodes"] if n["op"] not in ("placeholder", "output")}
    assert scopes == {str(i) for i in range(12)}
