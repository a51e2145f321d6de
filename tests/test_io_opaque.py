"""Opaque parts of a hybrid capture (OpaqueMethod / OpaqueFunction) are saved by the name of the
code they run, only when that code is in a package the caller trusts, and loaded under the same
identity rule. Checked on torchvision's detectors, whose post-processing runs as opaque parts."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision

import fxprep
from fxprep import io
from fxprep.capture.leaves import OpaqueFunction, OpaqueMethod
from fxprep.errors import SerializationError
from tests.helpers_io import WithMethods, _edit, _module


@pytest.fixture(scope="module")
def with_methods():
    model = WithMethods().eval()
    gm = fxprep.prepare_model(model, example_inputs=torch.randn(3, 4))
    assert {type(m) for m in gm.modules()} >= {OpaqueMethod, OpaqueFunction}
    return gm


def test_opaque_parts_need_their_package_trusted_to_save(with_methods, tmp_path):
    with pytest.raises(SerializationError) as info:
        io.save(with_methods, tmp_path / "s")
    message = str(info.value)
    assert "opaque part" in message and "tests.helpers_io.WithMethods.post" in message
    assert "trusted_modules=['tests']" in message and not (tmp_path / "s").exists()
    with pytest.raises(SerializationError, match="trusted_modules=\\['torchvision'\\] does not include it"):
        io.save(with_methods, tmp_path / "s", trusted_modules=["torchvision"])


def test_methods_helpers_and_functions_round_trip_when_trusted(with_methods, tmp_path):
    gm = with_methods
    directory = io.save(gm, tmp_path / "s", trusted_modules=["tests"])
    entries = {e["path"]: e for e in json.loads((directory / io.MODULES).read_text())["modules"]}
    assert entries["post"]["kind"] == "opaque_method" and entries["post"]["owner"]["class"] == "tests.helpers_io.WithMethods"
    helper = entries["post"]["owner"]["attrs"]["helper"]
    assert helper["class"] == "tests.helpers_io.Helper"  # saved once, then referred to
    assert entries["helper_clip"]["owner"] == {"$": "ref", "v": helper["id"]}
    assert entries["_topk_like"] == {**entries["_topk_like"], "kind": "opaque_function", "fn": "tests.helpers_io._topk_like"}
    with pytest.raises(SerializationError, match="refusing to load.*tests.helpers_io"):
        io.load(directory)
    loaded = io.load(directory, trusted_modules=["tests"])
    assert loaded.code == gm.code
    assert isinstance(loaded.get_submodule("post"), OpaqueMethod)
    owner = loaded.get_submodule("post").owner
    # the owner's layers are the loaded tree's own modules, not copies
    assert owner.a is loaded.a and owner.b is loaded.b and owner.a.weight is loaded.a.weight
    assert loaded.get_submodule("helper_clip").owner is owner.helper
    for x in (torch.randn(3, 4), torch.randn(5, 4) * 3, -torch.rand(2, 4)):  # every branch of the opaque code
        assert torch.equal(loaded(x), gm(x))


def test_a_trusted_package_does_not_trust_names_leading_out_of_it(with_methods, tmp_path):
    directory = io.save(with_methods, tmp_path / "s", trusted_modules=["tests"])

    def to(method=None, fn=None, cls=None):
        def change(data):
            if method:
                _module(data, "post").update(method=method)
            if fn:
                _module(data, "_topk_like").update(fn=fn)
            if cls:
                _module(data, "post")["owner"]["attrs"]["helper"]["class"] = cls
        return change

    for change in (to(method="__init__"), to(method="__class__"), to(fn="tests.helpers_io.torch.load"),
                   to(fn="tests.helpers_io.nn.functional.torch.builtins.eval"), to(fn="os.system"),
                   to(cls="tests.helpers_io.torch.hub.Path"), to(cls="subprocess.Popen")):
        copy = tmp_path / f"c{id(change)}"
        copy.mkdir()
        for name in io.CHECKED_FILES + (io.MANIFEST,):
            (copy / name).write_bytes((directory / name).read_bytes())
        _edit(copy, io.MODULES, change)
        with pytest.raises(SerializationError, match="refusing to load"):
            io.load(copy, trusted_modules=["tests"])


DETECTORS = [("ssdlite320_mobilenet_v3_large", {"score_thresh": 0.0}),
             ("fasterrcnn_mobilenet_v3_large_320_fpn", {"box_score_thresh": 0.0})]


@pytest.mark.parametrize("name, kwargs", DETECTORS, ids=[d[0] for d in DETECTORS])
def test_torchvision_detector_saves_and_loads_with_torchvision_trusted(tmp_path, name, kwargs):
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kwargs).eval()
    # tracer="fx": the hybrid capture is what gives opaque parts (and is 10x faster than trying Dynamo first)
    gm = fxprep.prepare_model(model, example_inputs=([torch.rand(3, 64, 64)],), tracer="fx")
    assert any(isinstance(m, OpaqueMethod) for m in gm.modules())
    with pytest.raises(SerializationError, match="(?s)opaque part.*trusted_modules=\\['torchvision'\\]"):
        io.save(gm, tmp_path / "untrusted")
    assert not (tmp_path / "untrusted").exists()
    directory = io.save(gm, tmp_path / "det", trusted_modules=["torchvision"])
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)
    loaded = io.load(directory, trusted_modules=["torchvision"])
    assert loaded.code == gm.code
    images = [torch.rand(3, 64, 64)]
    with torch.no_grad():
        expected, got = gm(images), loaded(images)
    assert len(got) == 1 and set(got[0]) == set(expected[0]) and expected[0]["boxes"].shape[0] > 0
    for key in expected[0]:
        assert torch.equal(got[0][key], expected[0][key]), key


def test_cli_trust_option_saves_a_detector(tmp_path):
    from tests.helpers_cli import invoke

    spec = "torchvision:ssdlite320_mobilenet_v3_large"
    refused = invoke("prepare", spec, "--tracer", "fx", "-o", str(tmp_path / "no"))
    assert refused.exit_code == 4, refused.output
    assert "verification: passed" in refused.stdout  # the report is printed all the same
    assert "--trust torchvision" in refused.output  # the API's trusted_modules=[...] advice, in flag terms
    assert "internal error" not in refused.output
    assert not (tmp_path / "no").exists()
    saved = invoke("prepare", spec, "--tracer", "fx", "-o", str(tmp_path / "yes"), "--trust", "torchvision")
    assert saved.exit_code == 0, saved.output
    assert "verification: passed" in saved.stdout
    loaded = io.load(tmp_path / "yes", trusted_modules=["torchvision"])
    assert any(isinstance(m, OpaqueMethod) for m in loaded.modules())
