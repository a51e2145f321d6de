"""fxprep.save writes a fresh directory beside the target and renames it into place: it never writes
through a link, never mixes with what was there, and a failed save leaves nothing behind."""

from __future__ import annotations

import os

import pytest
import torch

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithElementwiseAddOp, ModelWithReusedReLU
from fxprep.errors import SerializationError
from tests.helpers_io import Holder, Opaque

SAVE_FILES = sorted([io.MANIFEST, io.GRAPH, io.MODULES, io.WEIGHTS, io.CODE])


@pytest.fixture(scope="module")
def prepared():
    model = ModelWithReusedReLU().eval()
    x = torch.randn(1, 3, 32, 32)
    return fxprep.prepare_model(model, example_inputs=x), x


def _siblings(path):
    """Everything next to ``path`` that a save could have left (temporary directories included)."""
    return sorted(p.name for p in path.parent.iterdir())


def test_save_onto_an_existing_file_is_a_serialization_error(prepared, tmp_path):
    gm, _ = prepared
    target = tmp_path / "model.fxprep"
    target.write_text("my notes")
    with pytest.raises(SerializationError, match="existing file"):
        io.save(gm, target)
    assert target.read_text() == "my notes" and _siblings(target) == ["model.fxprep"]


def test_a_link_planted_in_the_target_is_not_written_through(prepared, tmp_path):
    gm, x = prepared
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "saved"
    target.mkdir()
    (target / io.WEIGHTS).symlink_to(victim)
    with pytest.raises(SerializationError, match="not an fxprep save"):
        io.save(gm, target)
    assert victim.read_text() == "precious"
    # a real earlier save with a link planted in it is replaced whole, the link's target untouched
    (target / io.WEIGHTS).unlink()
    target.rmdir()
    io.save(gm, target)
    (target / io.CODE).unlink()
    (target / io.CODE).symlink_to(victim)
    io.save(gm, target, overwrite=True)
    assert victim.read_text() == "precious"
    assert not (target / io.CODE).is_symlink() and sorted(os.listdir(target)) == SAVE_FILES
    assert torch.equal(io.load(target)(x), gm(x))


def test_target_that_is_a_link_is_refused(prepared, tmp_path):
    gm, _ = prepared
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(SerializationError, match="symbolic link"):
        io.save(gm, tmp_path / "link")
    assert os.listdir(real) == []


def test_non_empty_directories_that_are_not_saves_are_refused(prepared, tmp_path):
    gm, _ = prepared
    target = tmp_path / "project"
    target.mkdir()
    (target / "train.py").write_text("print('hi')")
    for overwrite in (False, True):
        with pytest.raises(SerializationError, match="not an fxprep save.*train.py"):
            io.save(gm, target, overwrite=overwrite)
    assert os.listdir(target) == ["train.py"]


def test_an_earlier_save_is_replaced_only_with_overwrite(prepared, tmp_path):
    gm, x = prepared
    target = io.save(gm, tmp_path / "s")
    with pytest.raises(SerializationError, match="already holds an fxprep save.*overwrite=True"):
        io.save(gm, target)
    other = ModelWithElementwiseAddOp().eval()
    xs = (torch.randn(1, 3, 8, 8),) * 2
    io.save(fxprep.prepare_model(other, example_inputs=xs), target, overwrite=True)
    loaded = io.load(target)
    assert type(loaded).__name__ == "ModelWithElementwiseAddOp" and sorted(os.listdir(target)) == SAVE_FILES
    assert _siblings(target) == ["s"]


def test_an_empty_directory_is_used(prepared, tmp_path):
    gm, x = prepared
    target = tmp_path / "empty"
    target.mkdir()
    io.save(gm, target)
    assert sorted(os.listdir(target)) == SAVE_FILES and torch.equal(io.load(target)(x), gm(x))


def test_failed_saves_leave_nothing_behind(prepared, tmp_path):
    gm, _ = prepared
    target = tmp_path / "bad_inputs"
    with pytest.raises(fxprep.FxprepError):
        io.save(gm, target, example_inputs=object())
    assert _siblings(target) == []
    model = Holder(Opaque(lambda t: t * 2)).eval()
    unsaveable = fxprep.prepare_model(model, [model.block], example_inputs=torch.randn(2, 4))
    with pytest.raises(SerializationError):
        io.save(unsaveable, target)
    assert _siblings(target) == []


def test_a_failed_overwrite_keeps_the_earlier_save(prepared, tmp_path):
    gm, x = prepared
    target = io.save(gm, tmp_path / "s")
    before = {n: (target / n).read_bytes() for n in SAVE_FILES}
    model = Holder(Opaque(lambda t: t * 2)).eval()
    unsaveable = fxprep.prepare_model(model, [model.block], example_inputs=torch.randn(2, 4))
    with pytest.raises(SerializationError):
        io.save(unsaveable, target, overwrite=True)
    assert {n: (target / n).read_bytes() for n in SAVE_FILES} == before and _siblings(target) == ["s"]
    assert torch.equal(io.load(target)(x), gm(x))


def test_unwritable_places_are_serialization_errors(prepared, tmp_path):
    gm, _ = prepared
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SerializationError, match="cannot save to"):
        io.save(gm, blocker / "sub" / "dir")


def test_cli_output_onto_an_existing_file_exits_4(tmp_path):
    from tests.helpers_cli import invoke

    target = tmp_path / "out.txt"
    target.write_text("keep")
    result = invoke("prepare", "demo:ModelWithReusedReLU", "-o", str(target))
    assert result.exit_code == 4, result.output
    assert "existing file" in result.output and "internal error" not in result.output
    assert target.read_text() == "keep"  # refused before minutes of preparing: nothing else to show
    # -o onto an earlier save replaces it (the command is re-run), onto anything else it refuses
    out = tmp_path / "saved"
    assert invoke("prepare", "demo:ModelWithReusedReLU", "-o", str(out)).exit_code == 0
    assert invoke("prepare", "demo:ModelWithReusedReLU", "-o", str(out)).exit_code == 0
    assert sorted(os.listdir(out)) == SAVE_FILES
