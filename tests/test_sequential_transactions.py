"""Issue 59: what ``on_stage`` changes reaches the weights wherever they live, each stage is a
transaction, offload folders do not grow.

A tiny Llama (tied embeddings) saved as sharded safetensors, its weights held five ways: in memory
with ``offload="cpu"``, ``"disk"`` or ``None``, and loaded by ``load_weights`` with every module on
disk or a map mixing CPU and disk (the tied embedding on the CPU, ``lm_head`` on disk). ``on_stage``
changes weights in each of the ways quantizers do. The result is compared with transformers'
``from_pretrained`` model with the same changes made in memory: every weight (read back the way
accelerate's hooks read them) and the logits, bit for bit, in float32 and bfloat16.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

import fxprep
from fxprep.errors import InvalidInput

CFG = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
IDS = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(0))
BATCHES = [{"input_ids": IDS}, {"input_ids": IDS.flip(1)}]
MIXED = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
         "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "disk"}
SETUPS = ["memory-cpu", "memory-disk", "memory-none", "map-disk", "map-mixed"]


FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Callable[[torch.dtype], tuple[Path, torch.dtype]]:
    """The checkpoint in a dtype (saved once per dtype)."""
    made: dict[torch.dtype, Path] = {}

    def get(dtype: torch.dtype) -> tuple[Path, torch.dtype]:
        if dtype not in made:
            made[dtype] = tmp_path_factory.mktemp("llama")
            torch.manual_seed(0)
            tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).to(dtype).eval().save_pretrained(made[dtype], max_shard_size="20KB")
        return made[dtype], dtype

    return get


def _cases(*axes: list[Any]) -> list[Any]:
    import itertools

    return list(itertools.product(*axes))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


class Held:
    """A prepared graph whose weights are held one of the SETUPS ways, and how to run it."""

    def __init__(self, setup: str, checkpoint: tuple[Path, torch.dtype], folder: Path):
        path, dtype = checkpoint
        self.setup, self.folder = setup, folder
        if setup.startswith("memory"):
            self.model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
            self.gm = fxprep.prepare_model(self.model, example_inputs={"input_ids": IDS}, verify=False)
            self.offload = setup.split("-")[1] if setup != "memory-none" else None
        else:
            with torch.device("meta"):  # as from_pretrained makes it: weights in dtype, rotary tables in float32
                self.model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**CFG), dtype=dtype).eval()
            self.gm = fxprep.prepare_model(self.model, example_inputs={"input_ids": IDS.to("meta")}, verify=False)
            device_map = {"": "disk"} if setup == "map-disk" else MIXED
            fxprep.load_weights(self.gm, path, device_map=device_map, offload_dir=folder)
            self.offload = "disk"
        self.stages = fxprep.partition(self.gm)

    def run(self, on_stage: Callable[..., None] | None, **kwargs: Any) -> fxprep.SequentialRun:
        kwargs.setdefault("offload_dir", self.folder / "own" if self.setup == "memory-disk" else None)
        return fxprep.run_sequential(self.stages, BATCHES, device="cpu", offload=self.offload, on_stage=on_stage,
                                     **kwargs)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight by its state_dict name, as the model holds it now: a module's tensor, or for a
        module accelerate offloads, what its hook's weights map reads (files on disk)."""
        out = {}
        for name, module in self.gm.named_modules():
            hook = getattr(module, "_hf_hook", None)
            for key, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is None or key in module._non_persistent_buffers_set:
                    continue
                out[f"{name}.{key}" if name else key] = hook.weights_map[key] if t.is_meta else t.detach().clone()
        return out

    def tensors(self) -> dict[tuple[int, str], torch.Tensor]:
        return {(id(m), k): t for m in self.gm.modules() for k, t in list(m._parameters.items()) + list(m._buffers.items())
                if t is not None}


def _reference(checkpoint: tuple[Path, torch.dtype], change: Callable[[str, nn.Module], None],
               stages: list[str] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """from_pretrained, the same changes made in memory (to the modules of ``stages``: all when None)."""
    path, dtype = checkpoint
    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if stages is None or any(name == s or name.startswith(s + ".") for s in stages):
                change(name, module)
        logits = model(input_ids=IDS, use_cache=False).logits
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logits


def _halve_linears(how: str) -> Callable[[str, nn.Module], None]:
    """Every Linear's weight halved and the final norm's weight plus a quarter, ``how`` quantizers
    write: in place, in place through ``.data``, ``.data`` assigned, a new Parameter assigned."""

    def change(name: str, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) or name.endswith("model.norm") or name == "norm":
            factor, shift = (0.5, 0.0) if isinstance(module, nn.Linear) else (1.0, 0.25)
            w = module.weight
            if how == "in place":
                w.mul_(factor).add_(shift)
            elif how == "through .data":
                w.data.mul_(factor).add_(shift)
            elif how == ".data assigned":
                w.data = w.data * factor + shift
            else:
                module.weight = nn.Parameter(w.detach() * factor + shift, requires_grad=w.requires_grad)

    return change


def _on_stage(change: Callable[[str, nn.Module], None], fail_at: str | None = None,
              error: BaseException | None = None) -> Callable[..., None]:
    def on_stage(stage: Any, inputs: Any, outputs: Any) -> None:
        for path, module in stage.weight_modules.items():
            change(path, module)
        if stage.name == fail_at:
            assert error is not None
            raise error

    return on_stage


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if not torch.equal(got[k], want[k])]


HOWS = ["in place", "through .data", ".data assigned", "new Parameter"]
# every holder and every way in float32; in bfloat16 every way on memory-cpu and map-disk, the others through .data
CHANGES = (_cases([FP32], SETUPS, HOWS) + _cases([BF16], ["memory-cpu", "map-disk"], HOWS)
           + _cases([BF16], ["memory-disk", "memory-none", "map-mixed"], ["through .data"]))


@pytest.mark.parametrize(("dtype", "setup", "how"), CHANGES)
def test_changes_reach_the_weights_where_they_live(saved: Any, dtype: torch.dtype, setup: str, how: str,
                                                   tmp_path: Path) -> None:
    checkpoint = saved(dtype)
    held = Held(setup, checkpoint, tmp_path)
    objects = held.tensors()
    checkpoint_files = _digest(checkpoint[0])
    run = held.run(_on_stage(_halve_linears(how)))
    assert held.tensors().keys() == objects.keys() and all(held.tensors()[k] is t for k, t in objects.items())
    # in memory, in place: a new Parameter assigned to a tied weight (lm_head's) is the tied weight's new
    # value in the sequential run (its ties stay), where eager assignment would untie it
    want, logits = _reference(checkpoint, _halve_linears("in place"))
    assert _same(held.weights(), want) == []
    with torch.no_grad():
        assert torch.equal(held.gm(input_ids=IDS).logits, logits)
    # what changed: the 21 Linears of the layers, lm_head and the final norm; nothing kept in memory
    assert len(run.written) == 3 * 7 + 2 and run.kept_bytes == 0
    assert _digest(checkpoint[0]) == checkpoint_files  # the checkpoint is never written
    if setup.startswith("map"):  # on disk, where accelerate reads them: the loader holds nothing in memory
        loader = held.gm.get_submodule("model.layers.0.mlp.down_proj")._hf_hook.weights_map.dataset
        assert loader.state_dict == {}
        index = json.loads((tmp_path / "index.json").read_text())
        assert index == loader.index and "safetensors_file" not in index["model.layers.0.mlp.down_proj.weight"]
    if setup == "memory-disk":
        assert not (tmp_path / "own" / "fxprep-sequential").exists()


FAILURES = (_cases([FP32], SETUPS, ["ValueError", "KeyboardInterrupt"])
            + _cases([BF16], ["memory-none", "map-disk"], ["ValueError", "KeyboardInterrupt"]))


@pytest.mark.parametrize(("dtype", "setup", "kind"), FAILURES)
def test_a_failing_on_stage_undoes_its_stage(saved: Any, dtype: torch.dtype, setup: str, kind: str,
                                             tmp_path: Path) -> None:
    """on_stage changes every weight of model.layers.1, then raises: layer 0's changes stay (its stage
    committed), layer 1's are undone, nothing after it ran; the exception is the one raised; the model
    holds the tensor objects and hooks it held; the offload folder holds what it held after layer 0."""
    checkpoint = saved(dtype)
    error: BaseException = ValueError("stop") if kind == "ValueError" else KeyboardInterrupt()
    held = Held(setup, checkpoint, tmp_path)
    objects = held.tensors()
    hooks = {id(m): getattr(m, "_hf_hook", None) for m in held.gm.modules()}
    change = _halve_linears("through .data")
    seen: dict[str, Any] = {}

    def on_stage(stage: Any, inputs: Any, outputs: Any) -> None:
        if stage.name == "model.layers.1" and setup.startswith("map"):
            seen["folder"] = _digest(tmp_path)  # layer 0 written, layer 1 not yet
        _on_stage(change, "model.layers.1", error)(stage, inputs, outputs)

    with pytest.raises(type(error)) as raised:
        held.run(on_stage)
    assert raised.value is error
    assert held.tensors().keys() == objects.keys() and all(held.tensors()[k] is t for k, t in objects.items())
    assert {id(m): getattr(m, "_hf_hook", None) for m in held.gm.modules()} == hooks
    want, logits = _reference(checkpoint, change, ["model.layers.0"])
    assert _same(held.weights(), want) == []
    with torch.no_grad():
        assert torch.equal(held.gm(input_ids=IDS).logits, logits)
    if setup.startswith("map"):
        assert _digest(tmp_path) == seen["folder"]
    if setup == "memory-disk":
        assert not (tmp_path / "own" / "fxprep-sequential").exists()


@pytest.mark.parametrize("setup", ["memory-none", "map-disk"])
def test_a_failing_batch_undoes_its_stage(saved: Any, setup: str, tmp_path: Path) -> None:
    """A forward hook of layer 1 changes its weight in place, then raises: undone, the error as raised."""
    held = Held(setup, saved(FP32), tmp_path)
    before = held.weights()
    error = RuntimeError("a module failed")

    def hook(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.weight.mul_(3.0)
        raise error

    handle = held.gm.get_submodule("model.layers.1.mlp.up_proj").register_forward_pre_hook(hook)
    try:
        with pytest.raises(RuntimeError) as raised:
            held.run(_on_stage(lambda name, module: None))
    finally:
        handle.remove()
    assert raised.value is error
    assert _same(held.weights(), before) == []


def test_a_change_no_home_can_hold_writes_nothing_of_its_stage(saved: Any, tmp_path: Path) -> None:
    """Layer 1's Linears halved, then one of them given another shape: refused, the whole stage undone."""
    held = Held("map-disk", saved(FP32), tmp_path)
    before = held.weights()

    def on_stage(stage: Any, inputs: Any, outputs: Any) -> None:
        if stage.name == "model.layers.1":
            for module in stage.weight_modules.values():
                if isinstance(module, nn.Linear):
                    module.weight.data.mul_(0.5)
            q = stage.weight_modules["model.layers.1.self_attn.q_proj"]
            q.weight = nn.Parameter(q.weight.detach()[:, :4].clone())

    with pytest.raises(InvalidInput, match=r"q_proj.weight .*shape \[32, 4\].*change its values, not its shape"):
        held.run(on_stage)
    assert _same(held.weights(), before) == []


def test_offload_dir_does_not_grow_over_interrupted_runs(tmp_path: Path) -> None:
    """run_sequential's own disk offload (weights in memory, ``offload="disk"``): files named by each
    tensor's path in offload_dir/fxprep-sequential, the same while every run is at the same stage,
    removed when a run ends, interrupted or not; another file the user put there stays."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS}, verify=False)
    stages = fxprep.partition(gm)
    (tmp_path / "mine.txt").write_text("the user's")
    during: list[tuple[int, int]] = []

    def interrupted(stage: Any, inputs: Any, outputs: Any) -> None:
        if stage.name == "model.layers.1":
            files = list((tmp_path / "fxprep-sequential").iterdir())
            during.append((len(files), sum(f.stat().st_size for f in files)))
            raise KeyboardInterrupt

    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            fxprep.run_sequential(stages, BATCHES, device="cpu", offload="disk", offload_dir=tmp_path, on_stage=interrupted)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    weights = {id(t) for t in gm.state_dict(keep_vars=True).values() if t.is_floating_point()}
    assert during[0] == during[1] == during[2] and during[0][0] == len(weights)  # one file per tensor object


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_a_load_weights_offload_dir_is_reused_by_name(saved: Any, dtype: torch.dtype, tmp_path: Path) -> None:
    """load_weights from a state_dict writes every weight to offload_dir; three runs that change every
    Linear rewrite the same files (count and size unchanged); loading into the folder again replaces
    what was there (the user's other files stay)."""
    path, _ = saved(dtype)
    state = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).state_dict()

    def loaded() -> Any:
        with torch.device("meta"):
            model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**CFG), dtype=dtype).eval()
        gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS.to("meta")}, verify=False)
        return fxprep.load_weights(gm, state, device_map={"": "disk"}, offload_dir=tmp_path)

    (tmp_path / "mine.txt").write_text("the user's")
    gm = loaded()
    first = _digest(tmp_path)
    sizes = []
    for _ in range(3):
        fxprep.run_sequential(fxprep.partition(gm), BATCHES, device="cpu", offload="disk",
                              on_stage=_on_stage(_halve_linears("through .data")))
        files = list(tmp_path.iterdir())
        sizes.append((len(files), sum(f.stat().st_size for f in files if f.name != "index.json")))
    assert sizes[0] == sizes[1] == sizes[2] and sizes[0][0] == len(first)
    loaded()
    assert _digest(tmp_path) == first


def test_clearing_an_offload_folder_removes_nothing_outside_it(tmp_path: Path) -> None:
    """The folder's index.json is read from a folder the user chose: names in it that reach outside
    the folder (``../x``, absolute paths) are not removed when the folder is cleaned."""
    from fxprep.big import weight_store

    folder, outside = tmp_path / "offload", tmp_path / "precious"
    folder.mkdir()
    outside.mkdir()
    (outside / "keep.dat").write_text("not fxprep's")
    (folder / "w.dat").write_text("fxprep's")
    names = {"w": {}, "../precious/keep": {}, str(outside / "keep"): {}}
    (folder / "index.json").write_text(json.dumps(names))
    assert weight_store.clear_folder(str(folder)) == 2  # w.dat and index.json
    assert (outside / "keep.dat").read_text() == "not fxprep's"
    assert not (folder / "w.dat").exists()
