"""Write-back that follows the weight (issue 59): a disk-offloaded model whose every Linear a
GPTQ-like ``on_stage`` changes, process memory measured beside the library's own figure.

    python benchmarks/sequential_writeback_bench.py [--layers 80] [--hidden 512] [--vocab 16000]
                                                    [--batches 4] [--tokens 128] [--folders]

A Llama-shaped model (``--layers`` x ``--hidden``, intermediate 11/4 of hidden, untied ``lm_head``) is
saved as sharded safetensors (100 MB shards). Each run below is a fresh subprocess, so its peak
resident set is its own:

* ``sequential``: prepared on ``meta``, ``load_weights(device_map={"": "disk"})`` (every weight left in
  the checkpoint's files), ``run_sequential(..., offload="disk", on_stage=...)`` on ``--batches``
  batches of 2 x ``--tokens`` ids. Forward pre-hooks keep each Linear's input abs-max per channel;
  ``on_stage`` rounds every Linear of its stage to an activation-scaled 8-bit grid (AWQ/GPTQ-like),
  the q/k/v/gate projections in place (``w.mul_(...)``...), the others through ``.data``
  (``w.data.copy_(...)``, ``w.data = ...``). Process RSS is sampled every 2 ms by a thread
  (``psutil``) around ``run_sequential`` (before and after it: after a collection and glibc's ``malloc_trim``,
  so "after" is what is still referenced) and read from ``getrusage`` at the end; the library's
  figures are ``SequentialRun.peak_held_bytes`` and its parts.
* ``memory``: the same model loaded whole into memory, one plain forward over the batches with the
  same hooks, the same update applied to every Linear in memory.

The two must agree bit for bit: every weight (sha256 of its bytes, the sequential run's read back
from disk as accelerate reads it) and the logits of a last call. ``--folders``: the offload folder's
size (files, bytes) after each of three runs interrupted (``KeyboardInterrupt`` in ``on_stage``) half
way: ``load_weights``' folder with write-back, and ``run_sequential``'s own disk offload of a model in
memory. ``--tree PATH`` runs the children on another fxprep source tree (``PATH/src``), for a before/after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2 * args.tokens, tie_word_embeddings=False)


def _batches(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    return [{"input_ids": torch.randint(0, args.vocab, (2, args.tokens), generator=torch.Generator().manual_seed(i))}
            for i in range(args.batches)]


def _trimmed_rss() -> int:
    """The resident set after a full collection and glibc's ``malloc_trim`` (freed memory the
    allocator still holds given back), so what is left is what is still referenced."""
    import ctypes
    import gc

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


class Peak:
    """The process's resident set, sampled every 2 ms on a thread while the block runs; ``before``
    and ``after`` trimmed (:func:`_trimmed_rss`)."""

    def __enter__(self) -> Peak:
        import psutil

        self.process = psutil.Process()
        self.before = _trimmed_rss()
        self.peak = self.before
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.after = _trimmed_rss()


# --- the update: identical code in both runs ------------------------------------------------------------------
def _watch(gm: Any) -> dict[str, Any]:
    """A forward pre-hook on every Linear keeping its input's abs-max per channel."""
    import torch

    absmax: dict[str, Any] = {}
    for name, module in gm.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(m: Any, a: Any, name: str = name) -> None:
                seen = a[0].detach().abs().amax(dim=tuple(range(a[0].dim() - 1)))
                absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

            module.register_forward_pre_hook(hook)
    return absmax


def _update(name: str, module: Any, absmax: Any) -> None:
    """An activation-scaled round to an 8-bit grid per output channel, in place (q/k/v/gate) or through
    ``.data`` (o/up/down/lm_head: ``.data`` changed in place, or assigned)."""
    import torch

    with torch.no_grad():
        scale = absmax.clamp(min=1e-5).sqrt()
        w = module.weight
        step = (w * scale).abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj")):
            w.mul_(scale).div_(step).round_().mul_(step).div_(scale)
        elif name.endswith(("o_proj", "up_proj")):
            w.data.mul_(scale).div_(step).round_().mul_(step).div_(scale)
        else:
            w.data = ((w.data * scale) / step).round() * step / scale


def _digests(weights: dict[str, Any]) -> dict[str, str]:
    import torch

    return {k: hashlib.sha256(v.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for k, v in weights.items()}


# --- the children -------------------------------------------------------------------------------------------
def child_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args))
    model.save_pretrained(args.checkpoint, max_shard_size="100MB")
    shards = [p for p in Path(args.checkpoint).iterdir() if p.suffix == ".safetensors"]
    return {"parameters": sum(p.numel() for p in model.parameters()), "shards": len(shards),
            "bytes": sum(p.stat().st_size for p in shards)}


def _prepared_on_meta(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    import fxprep

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args)).eval()
    return fxprep.prepare_model(model, example_inputs={"input_ids": _batches(args)[0]["input_ids"].to("meta")},
                                verify=False)


def _final(gm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Weights as the model holds them (offloaded ones read from disk, as accelerate reads them), one at a time."""
    import torch

    digests = {}
    for name, module in gm.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for key, t in module._parameters.items():
            if t is not None:
                value = hook.weights_map[key] if t.is_meta else t
                digests.update(_digests({f"{name}.{key}": value}))
    with torch.no_grad():
        logits = gm(**_batches(args)[0]).logits
    return {"digests": digests, "logits": hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()}


def child_sequential(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import fxprep

    torch.set_num_threads(2)
    gm = _prepared_on_meta(args)
    folder = tempfile.mkdtemp(prefix="bench-offload-")
    fxprep.load_weights(gm, args.checkpoint, device_map={"": "disk"}, offload_dir=folder)
    absmax = _watch(gm)

    def on_stage(stage: Any, inputs: Any, outputs: Any) -> None:
        for path, module in stage.weight_modules.items():
            if isinstance(module, torch.nn.Linear):
                _update(path, module, absmax.pop(path))

    stages = fxprep.partition(gm)
    with Peak() as peak:
        start = time.perf_counter()
        run = fxprep.run_sequential(stages, _batches(args), device="cpu", offload="disk", on_stage=on_stage)
        seconds = time.perf_counter() - start
    out = {"rss_before": peak.before, "rss_peak": peak.peak, "rss_after": peak.after, "seconds": seconds,
           "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "stages": len(stages)}
    for field in ("peak_held_bytes", "peak_weight_bytes", "peak_before_bytes", "peak_cache_bytes", "peak_batch_bytes",
                  "kept_bytes", "written_bytes", "total_weight_bytes"):
        out[field] = getattr(run, field, None)
    out["written"] = len(getattr(run, "written", []))
    out["stage_weight_max"] = max(run.stage_weight_bytes.values())
    loader = gm.get_submodule("model.layers.0.mlp.down_proj")._hf_hook.weights_map.dataset
    out["loader_in_memory"] = sum(t.numel() * t.element_size() for t in loader.state_dict.values())
    out["folder_bytes"] = sum(p.stat().st_size for p in Path(folder).iterdir())
    out.update(_final(gm, args))
    return out


def child_memory(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import fxprep

    torch.set_num_threads(2)
    gm = _prepared_on_meta(args)
    with Peak() as peak:
        fxprep.load_weights(gm, args.checkpoint)
        absmax = _watch(gm)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in _batches(args):
                gm(**batch)
            for name, module in gm.named_modules():
                if isinstance(module, torch.nn.Linear):
                    _update(name, module, absmax.pop(name))
        seconds = time.perf_counter() - start
    out = {"rss_before": peak.before, "rss_peak": peak.peak, "rss_after": peak.after, "seconds": seconds,
           "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    out.update(_final(gm, args))
    return out


def child_folders(args: argparse.Namespace) -> dict[str, Any]:
    """Three runs interrupted half way, each kind of folder measured after each."""
    import torch

    import fxprep

    def size(folder: Path) -> tuple[int, int]:
        files = [p for p in folder.rglob("*") if p.is_file()]
        return len(files), sum(p.stat().st_size for p in files)

    half = f"model.layers.{args.layers // 2}"

    def interrupted(stage: Any, inputs: Any, outputs: Any) -> None:
        for module in stage.weight_modules.values():
            if isinstance(module, torch.nn.Linear):
                module.weight.data.mul_(0.5)
        if stage.name == half:
            raise KeyboardInterrupt

    batches = _batches(args)[:1]
    out: dict[str, Any] = {}
    mapped = Path(tempfile.mkdtemp(prefix="bench-mapped-"))
    gm = _prepared_on_meta(args)
    fxprep.load_weights(gm, args.checkpoint, device_map={"": "disk"}, offload_dir=mapped)
    out["load_weights folder"] = [size(mapped)]
    stages = fxprep.partition(gm)
    for _ in range(3):
        try:
            fxprep.run_sequential(stages, batches, device="cpu", offload="disk", on_stage=interrupted)
        except KeyboardInterrupt:
            pass
        out["load_weights folder"].append(size(mapped))
    del gm, stages
    own = Path(tempfile.mkdtemp(prefix="bench-own-"))
    gm = _prepared_on_meta(args)
    fxprep.load_weights(gm, args.checkpoint)  # in memory: run_sequential's own disk offload
    stages = fxprep.partition(gm)
    out["run_sequential offload_dir"] = [size(own)]
    for _ in range(3):
        try:
            fxprep.run_sequential(stages, batches, device="cpu", offload="disk", offload_dir=own, on_stage=interrupted)
        except KeyboardInterrupt:
            pass
        out["run_sequential offload_dir"].append(size(own))
    return out


CHILDREN = {"save": child_save, "sequential": child_sequential, "memory": child_memory, "folders": child_folders}


def _child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.tree) / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--child", name, "--checkpoint", args.checkpoint, "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--batches", str(args.batches),
               "--tokens", str(args.tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--folders", action="store_true", help="also the offload folders over three interrupted runs")
    parser.add_argument("--tree", default=None, help="run the children on PATH/src (another fxprep tree)")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--child", choices=sorted(CHILDREN), default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    args.checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="bench-llama-")
    Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
    saved = _child("save", args)  # the model saved again where --checkpoint points (same seed: the same weights)
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {saved['parameters'] / 1e6:.1f} M "
          f"parameters, {saved['bytes'] / MIB:.0f} MiB in {saved['shards']} safetensors shards; {args.batches} batches "
          f"of 2x{args.tokens} tokens")
    seq = _child("sequential", args)
    mem = _child("memory", args)
    same = [k for k in mem["digests"] if mem["digests"][k] != seq["digests"].get(k)]
    print("\n| run | RSS before MiB | RSS peak MiB | peak - before | RSS after MiB | after - before | getrusage peak MiB"
          " | library: held at most MiB | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in (("sequential, disk", seq), ("whole model in memory", mem)):
        held = f"{r['peak_held_bytes'] / MIB:.1f}" if r.get("peak_held_bytes") is not None else "-"
        print(f"| {name} | {r['rss_before'] / MIB:.0f} | {r['rss_peak'] / MIB:.0f} | {(r['rss_peak'] - r['rss_before']) / MIB:.0f}"
              f" | {r['rss_after'] / MIB:.0f} | {(r['rss_after'] - r['rss_before']) / MIB:.0f} | {r['ru_maxrss'] / MIB:.0f}"
              f" | {held} | {r['seconds']:.1f} |")
    parts = {k: seq.get(k) for k in ("peak_weight_bytes", "peak_before_bytes", "peak_cache_bytes", "peak_batch_bytes",
                                     "kept_bytes", "stage_weight_max", "total_weight_bytes", "written_bytes",
                                     "loader_in_memory", "folder_bytes")}
    print("\nsequential, library's figures (MiB): " + ", ".join(
        f"{k} {v / MIB:.1f}" for k, v in parts.items() if isinstance(v, int)))
    print(f"weights written back: {seq['written']} of {len(seq['digests'])}; stages: {seq['stages']}")
    print(f"equal to the same updates in memory: weights {'yes' if not same else f'NO ({len(same)} differ: {same[:3]})'}, "
          f"logits {'yes' if mem['logits'] == seq['logits'] else 'NO'}")
    if args.folders:
        folders = _child("folders", args)
        print("\n| folder | after loading | run 1 | run 2 | run 3 |  (files, MiB; each run interrupted half way)")
        print("|---|---|---|---|---|")
        for name, sizes in folders.items():
            print(f"| {name} | " + " | ".join(f"{n}, {b / MIB:.1f}" for n, b in sizes) + " |")


if __name__ == "__main__":
    main()
