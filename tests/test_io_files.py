"""Nothing blocks, nothing raw (issue 63): ``load`` and ``load_weights`` refuse a file that is not a
regular file before reading it (a FIFO, as an unpacked archive can leave, blocked ``load_weights``
forever), and a device map naming a device this machine does not have is refused before anything is
placed (it ended in a raw ``RuntimeError`` from inside torch). Each is an FxprepError naming the file
or the device. A read that may block runs in a forked child: one that blocks fails the test instead
of hanging it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fxprep
from fxprep import io

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")


def _in_child(call: Callable[[], object]) -> tuple[str, str]:
    """``call()`` in a forked child: (its exception's type, message), or a test failure when it is
    still running after 60 s (a read blocked on the FIFO: safetensors' Rust open is not interrupted by
    signals, so the child is killed)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            call()
            send.send(("returned", ""))
        except BaseException as err:  # noqa: BLE001 - what it raised is the result
            send.send((type(err).__name__, str(err)))

    process = context.Process(target=child)
    process.start()
    try:
        if not receive.poll(60):
            pytest.fail("the read blocked (still waiting after 60 s): a FIFO was opened and read")
        return receive.recv()
    finally:
        process.kill()
        process.join()


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


@pytest.mark.parametrize("check_integrity", [True, False])
@pytest.mark.parametrize("name", [io.MANIFEST, io.GRAPH, io.MODULES, io.WEIGHTS])
def test_load_refuses_a_save_file_that_is_a_fifo(seed_save, name, check_integrity):
    directory, _, _ = seed_save
    _fifo(directory / name)
    kind, message = _in_child(lambda: io.load(directory, check_integrity=check_integrity))
    assert kind == "SerializationError" and f"{name} is not a regular file" in message, (kind, message)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _prepared_on_meta() -> torch.fx.GraphModule:
    with torch.device("meta"):
        model = _Two().eval()
    return fxprep.prepare_model(model, example_inputs=torch.randn(2, 4, device="meta"), tracer="fx", progress=False)


def _checkpoint(directory: Path, sharded: bool) -> dict[str, torch.Tensor]:
    state = {k: torch.randn(v.shape) for k, v in _Two().state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    if not sharded:
        save_file(state, str(directory / "model.safetensors"))
        return state
    first, second = {k: v for k, v in state.items() if k.startswith("a.")}, {k: v for k, v in state.items() if k.startswith("b.")}
    save_file(first, str(directory / "a.safetensors"))
    save_file(second, str(directory / "b.safetensors"))
    index = {"weight_map": {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


@pytest.mark.parametrize("what", ["single file", "file in a directory", "index", "shard", "config.json"])
def test_load_weights_refuses_a_fifo_before_reading(tmp_path, what):
    directory = tmp_path / "ckpt"
    _checkpoint(directory, sharded=what in ("index", "shard", "config.json"))
    fifo = {"single file": "model.safetensors", "file in a directory": "model.safetensors",
            "index": "model.safetensors.index.json", "shard": "b.safetensors", "config.json": "config.json"}[what]
    _fifo(directory / fifo)
    source = directory / fifo if what == "single file" else directory
    gm = _prepared_on_meta()
    kind, message = _in_child(lambda: fxprep.load_weights(gm, source))
    assert kind == "WeightsError" and f"{fifo} is a FIFO, not a regular file" in message, (kind, message)


def test_load_weights_still_follows_links_to_regular_files(tmp_path):
    """The Hugging Face cache is made of symlinks: a link to a regular file is read."""
    blobs = tmp_path / "blobs"
    state = _checkpoint(blobs, sharded=False)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "model.safetensors")
    gm = fxprep.load_weights(_prepared_on_meta(), snapshot)
    assert torch.equal(gm.get_parameter("a.weight"), state["a.weight"])


@pytest.mark.parametrize("device", ["cuda:{n}", "{n}", "xpu:3"])
def test_a_device_map_naming_a_device_this_machine_lacks_is_refused_before_placing(tmp_path, device):
    missing = torch.cuda.device_count() + 7  # an index past every GPU this machine has (or any, on a CPU host)
    device = int(device.format(n=missing)) if device == "{n}" else device.format(n=missing)
    import accelerate  # noqa: F401 - a test dependency (device maps)
    directory = tmp_path / "ckpt"
    _checkpoint(directory, sharded=False)
    gm = _prepared_on_meta()
    with pytest.raises(fxprep.InvalidInput, match=r"device_map\['b'\] = .*, but this machine has"):
        fxprep.load_weights(gm, directory, device_map={"a": "cpu", "b": device})
    assert all(t.is_meta for t in gm.parameters())  # nothing was placed


def test_max_memory_naming_a_device_this_machine_lacks_is_refused(tmp_path):
    """device_map="auto" asks accelerate, which asks each max_memory device for its memory: a raw
    torch error for a device that is not there."""
    missing = torch.cuda.device_count() + 5  # an index past every GPU this machine has
    import accelerate  # noqa: F401 - a test dependency (device maps)
    directory = tmp_path / "ckpt"
    _checkpoint(directory, sharded=False)
    with pytest.raises(fxprep.InvalidInput, match=rf"max_memory\[{missing}\] = {missing}, but this machine has"):
        fxprep.load_weights(_prepared_on_meta(), directory, device_map="auto",
                            max_memory={missing: "1GB", "cpu": "1GB"})
