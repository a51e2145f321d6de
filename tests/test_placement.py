"""``load_weights(gm, checkpoint, device_map=...)``: weights placed by accelerate's device maps.

On CPU: ``"cpu"`` and ``"disk"`` entries (explicit, nested, ``"auto"`` from a ``max_memory``), from a
sharded safetensors checkpoint and from a state_dict. Outputs equal transformers' ``from_pretrained``;
tensors on disk are never loaded (still ``meta`` in the model, read from the checkpoint's own files);
``run_sequential`` runs on the hooks the map attached. Maps naming two accelerators (where the graph
moves activations between devices) cannot be run without two GPUs; where the graph moves values for
such a map is checked without them.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

import fxprep
from fxprep.errors import InvalidInput

CFG = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
IDS = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval().save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.fixture(scope="module")
def want(llama_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return tf.LlamaForCausalLM.from_pretrained(llama_dir).eval()(input_ids=IDS, use_cache=False).logits


def _meta_prepared() -> Any:
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    return fxprep.prepare_model(model, example_inputs={"input_ids": IDS.to("meta")}, verify=False)


def _on_meta(gm: Any) -> set[str]:
    return {n for n, p in gm.named_parameters(remove_duplicate=False) if p.is_meta}


MIXED = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
         "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "disk"}


@pytest.mark.parametrize("device_map", [{"": "disk"}, {"": "cpu"}, MIXED, {"": "cpu", "model.layers.1": "disk"}],
                         ids=["all-disk", "all-cpu", "mixed", "nested"])
def test_device_map_outputs_equal_from_pretrained(llama_dir: Path, want: torch.Tensor, device_map: dict[str, str],
                                                  tmp_path: Path) -> None:
    gm = _meta_prepared()
    assert fxprep.load_weights(gm, llama_dir, device_map=device_map, offload_dir=tmp_path) is gm
    with torch.no_grad():
        assert torch.equal(gm(input_ids=IDS).logits, want)
        assert torch.equal(gm(input_ids=IDS).logits, want)  # offloaded weights go back and come again
    on_disk = _on_meta(gm)
    linears = {n for n, _ in gm.named_parameters(remove_duplicate=False) if n.endswith("proj.weight")}
    disk_layers = [k for k, d in device_map.items() if d == "disk" and k.startswith("model.layers")]
    if device_map == {"": "disk"}:
        assert linears <= on_disk
    else:
        assert {n for n in linears if any(n.startswith(k + ".") for k in disk_layers)} == on_disk & linears
    if on_disk:  # read from the checkpoint's own files: nothing written but the index
        index = json.loads((tmp_path / "index.json").read_text())
        written = {k for k, e in index.items() if "safetensors_file" not in e}
        assert all(Path(e["safetensors_file"]).parent == llama_dir for k, e in index.items() if k not in written)
        # only a tensor tied to a module on the CPU (lm_head to embed_tokens) is written out, once
        assert written == ({"lm_head.weight"} if device_map is MIXED else set())
        assert {p.name for p in tmp_path.glob("*.dat")} == {f"{k}.dat" for k in written}
    # the sequential runner onloads through the hooks the map attached (and leaves them)
    run = fxprep.run_sequential(fxprep.partition(gm), [{"input_ids": IDS}], device="cpu", offload="disk")
    assert torch.equal(run.outputs[0].logits, want)
    assert _on_meta(gm) == on_disk


def test_auto_map_from_max_memory_keeps_blocks_whole(llama_dir: Path, want: torch.Tensor) -> None:
    folders = set(Path(tempfile.gettempdir()).glob("fxprep-offload-*"))
    gm = _meta_prepared()
    fxprep.load_weights(gm, llama_dir, device_map="auto", max_memory={"cpu": 60_000})
    placed = gm.hf_device_map
    assert "disk" in placed.values() and "cpu" in placed.values()
    assert not any(k.startswith("model.layers.") and k.count(".") > 2 for k in placed)  # no layer split
    with torch.no_grad():
        assert torch.equal(gm(input_ids=IDS).logits, want)
    # no offload_dir given: fxprep's own folder (the offload index) goes with the module
    made = set(Path(tempfile.gettempdir()).glob("fxprep-offload-*")) - folders
    assert len(made) == 1 and (next(iter(made)) / "index.json").exists()
    del gm
    gc.collect()
    assert not next(iter(made)).exists()


def test_a_state_dict_goes_to_the_offload_folder(llama_dir: Path, want: torch.Tensor, tmp_path: Path) -> None:
    state = tf.LlamaForCausalLM.from_pretrained(llama_dir).state_dict()
    gm = _meta_prepared()
    fxprep.load_weights(gm, state, device_map={"": "cpu", "model.layers.1": "disk"}, offload_dir=tmp_path)
    assert len(list(tmp_path.glob("model.layers.1.*.dat"))) == 9  # 7 Linear weights, 2 norms
    with torch.no_grad():
        assert torch.equal(gm(input_ids=IDS).logits, want)


def test_device_map_refusals(llama_dir: Path) -> None:
    gm = _meta_prepared()
    with pytest.raises(InvalidInput, match="'meta', which holds no values"):
        fxprep.load_weights(gm, llama_dir, device_map={"": "meta"})
    with pytest.raises(InvalidInput, match="not a module of the model"):
        fxprep.load_weights(gm, llama_dir, device_map={"decoder": "cpu"})
    with pytest.raises(InvalidInput, match="device or device_map"):
        fxprep.load_weights(gm, llama_dir, device="cpu", device_map={"": "cpu"})
    with pytest.raises(InvalidInput, match="not a device"):
        fxprep.load_weights(gm, llama_dir, device_map={"": "gpu7"})
    assert _on_meta(gm)  # nothing was loaded


def test_on_stage_updates_reach_weights_left_on_disk(llama_dir: Path, tmp_path: Path) -> None:
    """Weights changed by ``on_stage`` on modules whose weights wait on disk (load_weights' hooks) are
    what later calls of the graph use."""
    gm = _meta_prepared()
    fxprep.load_weights(gm, llama_dir, device_map={"": "disk"}, offload_dir=tmp_path)

    def halve_down_proj(stage: Any, inputs: Any, outputs: Any) -> None:
        for path, module in stage.weight_modules.items():
            if path.endswith("down_proj"):
                with torch.no_grad():
                    module.weight.mul_(0.5)

    fxprep.run_sequential(fxprep.partition(gm), [{"input_ids": IDS}], device="cpu", offload="disk",
                          on_stage=halve_down_proj)
    reference = tf.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.mlp.down_proj.weight.mul_(0.5)
        assert torch.equal(gm(input_ids=IDS).logits, reference(input_ids=IDS, use_cache=False).logits)


TWO_ACCELERATORS = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                    "model.layers.2": 1, "model.norm": 1, "lm_head": 1}


def test_values_crossing_to_another_accelerator_are_moved_once_before_their_first_use() -> None:
    """The graph's moves for a map over two accelerators, checked without them (no run on two
    devices is possible here): each value made on cuda:0 and read on cuda:1 is moved once, every
    reader on cuda:1 reads the moved value, nothing is moved where it already is; with the moves
    pointed at the CPU the graph still computes what it computed."""
    from fxprep.big import placement

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": IDS}, verify=False)
    with torch.no_grad():
        before = gm(input_ids=IDS).logits
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    made_on: dict[str, str] = {}  # each computing node: the device of its stage's weights under the map
    for stage in fxprep.partition(gm):
        hits = [d for path in stage.weight_modules for k, d in TWO_ACCELERATORS.items()
                if path == k or path.startswith(k + ".")]
        assert len(set(hits)) == 1, (stage.name, hits)  # the map puts each stage on one device
        for n in stage.graph.nodes:
            if n.op not in ("placeholder", "output", "get_attr"):
                made_on[n.name] = f"cuda:{hits[0]}"
    moves = placement.move_between_devices(gm, TWO_ACCELERATORS)
    sends = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is placement.send_to]
    assert moves == len(sends) > 0
    moved = [n.args[0] for n in sends]
    assert len({m.name for m in moved}) == len(moved)  # each value moved once
    for send in sends:
        value, device = send.args
        assert device == "cuda:1" and made_on.get(value.name, "cuda:0") == "cuda:0", (value.name, device)
        assert all(made_on[u.name] == "cuda:1" for u in send.users)
        assert all(order.get(u, len(order)) > order.get(value, -1) for u in send.users)
    # every reader on cuda:1 of a value made on cuda:0 reads it through a move
    for node in gm.graph.nodes:
        if made_on.get(node.name) == "cuda:1":
            for value in node.all_input_nodes:
                if value in sends:
                    continue
                if value.op != "get_attr" and made_on.get(value.name, "cuda:0") == "cuda:0":
                    pytest.fail(f"{node.name} on cuda:1 reads {value.name} from cuda:0 unmoved")
    for send in sends:
        send.args = (send.args[0], "cpu")
    gm.recompile()
    with torch.no_grad():
        assert torch.equal(gm(input_ids=IDS).logits, before)
