"""Models and save-file edits shared by the save/load tests (tests/test_io*.py, test_tamper_fuzz.py, ...).

A save names a user class by its module path: these classes are saved as ``tests.helpers_io.<name>``
and the tests that check refusals of other names reach through this module's own imports
(``tests.helpers_io.torch.load``), so it imports ``torch`` and ``nn`` under those names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fxprep import io


# --- models -------------------------------------------------------------------------------------
class Tied(nn.Module):
    """Tied embedding/output weights, a reused Linear (unrolled with shared weights), a buffer that is
    not persistent, and a parameter the forward never reads."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, ids):
        h = self.emb(ids)
        h = self.proj(F.gelu(self.proj(h))) * self.scale
        return self.head(h)


class Opaque(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.fn(self.lin(x))


class Holder(nn.Module):
    def __init__(self, leaf):
        super().__init__()
        self.block = leaf

    def forward(self, x):
        return self.block(x) + 1


# a module with a data-dependent method, a held helper object and a free function: each becomes
# an opaque part (tests/test_leaves.py), saved by name (tests/test_io_opaque.py)
class Helper:
    """A plain object held by a module, with a data-dependent method."""

    def clip(self, x):
        if x.max() > 1:
            return x.clamp(max=1)
        return x


def _topk_like(x):
    n = int(x.shape[0])
    if x.sum() > 0:
        return x[: max(n - 1, 1)]
    return x


class WithMethods(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.helper = Helper()

    def post(self, x):
        return x if x.min() > 0 else x.abs()

    def forward(self, x):
        y = self.post(self.a(x))
        y = self.helper.clip(y)
        return self.b(_topk_like(y))


# --- editing a save as an attacker would ----------------------------------------------------------
def _edit(directory: Path, name: str, change) -> None:
    """Edit one JSON file and re-sign it, as an attacker who also rewrites the manifest would."""
    path = directory / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    manifest = json.loads((directory / io.MANIFEST).read_text())
    manifest["sha256"][name] = io.format.sha256(path)
    (directory / io.MANIFEST).write_text(json.dumps(manifest))


def _node(data, target):
    """The node calling module ``target`` (or the function named ``target``): names depend on the tracer."""
    return next(n for n in data["nodes"] if n["target"] in (target, {"fn": target}))


def _module(data, path):
    return next(m for m in data["modules"] if m["path"] == path)


def _call(directory: Path, fn: str, args: list, extra: list | None = None) -> None:
    """Make the node calling conv1 a call of ``fn`` (and insert ``extra`` nodes after it)."""
    def change(data):
        node = _node(data, "conv1")
        node.update(op="call_function", target={"fn": fn}, args=args, kwargs={})
        at = data["nodes"].index(node) + 1
        data["nodes"][at:at] = extra or []
    _edit(directory, io.GRAPH, change)


# --- round trips --------------------------------------------------------------------------------
def tiny_causal_lm_round_trip(model_type: str, ids: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """The tiny transformers causal LM of ``model_type`` (cache off, seed 0) and its prepared module
    saved and loaded with transformers trusted (prepared on 1x8 token ids; ``ids`` is not used for
    it): ``(model, loaded)`` for the caller to compare on ``ids``."""
    import tempfile

    import transformers

    import fxprep
    from fxprep.cli.tiny import tiny_config

    config = tiny_config(model_type)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": torch.randint(3, 99, (1, 8))})
    with tempfile.TemporaryDirectory() as folder:
        fxprep.save(gm, folder, trusted_modules=["transformers"])
        loaded = fxprep.load(folder, trusted_modules=["transformers"])
    return model, loaded
