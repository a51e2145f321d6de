"""Tamper fuzzer: real saves, mutated at random and re-signed, must never make fxprep.load run code.

Three real saves (AIMET's seed model, a small ResNet-style model, a model with tied weights,
unrolled layers and BoundOps) are mutated by hypothesis: JSON edits anywhere in graph.json,
modules.json and the manifest (values changed, deleted, inserted, entries duplicated), names in name
positions swapped for dangerous importable ones (``os.system``, ``builtins.eval``,
``subprocess.Popen``, ``torch.hub.load``, ``pickle.loads``, prefix tricks such as
``torch.nn.functional.torch.builtins.eval``), and the weights header edited (dtypes, shapes, keys).
The manifest's checksums are recomputed each time, as an attacker would.

For every mutated save:

* ``load`` raises :class:`SerializationError` or returns a module: any other exception fails;
* no dangerous object (``os.system``, ``eval``, the FakeQuantize class, the sentinel, the canary's
  own stand-ins...) may end up anywhere in the loaded module: as a graph target, a module's class,
  an op's callable or any attribute value, however deep;
* a canary (recording stand-ins for ``os.system``, ``subprocess.Popen``, ``eval``, ``exec`` other
  than fx compiling its generated forward, ``torch.hub.load``, ``pickle``, ``shutil.rmtree``,
  ``torch.load``; ``importlib.import_module`` / ``__import__`` of code from outside the installed
  packages; a planted ``hubconf.py``; a sentinel function and a sentinel file that payloads such as
  ``touch <file>`` would create) is armed around each load and each run of the loaded module, and
  checked after both;
* a mutated save that loads must run on the original input and give the original outputs, to the
  load self-check's tolerance (1e-4 of each output's magnitude, fxprep.io.selfcheck); one that fails
  when run or computes anything else had to be refused by ``load`` and fails the test.

The counts are printed (``-rP``) and recorded as user properties: ``saves_mutated`` per model.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import hashlib
import importlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torchvision.models.resnet import BasicBlock

import fxprep
from fxprep import io
from fxprep.cli.demo import ModelWithReusedReLU
from fxprep.errors import SerializationError
from fxprep.io import selfcheck
from tests.helpers_io import Tied

# hypothesis's max_examples per model; it calls the test about twice per counted example, so a CI
# run mutates about 900 saves (the printed count is exact). FXPREP_TAMPER_EXAMPLES=3000 for a longer hunt.
EXAMPLES_PER_MODEL = int(os.environ.get("FXPREP_TAMPER_EXAMPLES", "150"))

CALLS: list[str] = []
# What an os.system("touch ...") payload would create: checked with the canary.
SENTINEL = Path(tempfile.gettempdir()) / f"fxprep_tamper_fuzz_sentinel_{os.getpid()}"
PAYLOADS = [f"touch {SENTINEL}", str(SENTINEL), f"import os; os.system('touch {SENTINEL}')"]


def _sentinel(*args: Any, **kwargs: Any) -> None:
    """A function only a save that runs code could reach (tests is never trusted here)."""
    CALLS.append(f"sentinel{args!r}")


DANGEROUS = [
    "os.system", "builtins.eval", "builtins.exec", "builtins.__import__", "builtins.open", "subprocess.Popen",
    "subprocess.run", "torch.hub.load", "pickle.loads", "importlib.import_module", "shutil.rmtree", "torch.load",
    "torch.save", "posix.system", "operator.attrgetter", "operator.methodcaller", "functools.partial",
    "torch.nn.functional.torch.builtins.eval", "torch.fft.torch.os.system", "torch.special.torch.hub.load",
    "torch.nn.modules.module.torch.ao.quantization.fake_quantize.FakeQuantize",
    "torch.ao.quantization.fake_quantize.FakeQuantize", "torch.ops.aten.from_file.default", "torch.from_file",
    "tests.test_tamper_fuzz._sentinel", "torch.nn.functional.torch.fx.graph_module._exec_with_source",
    "torch.utils.cpp_extension.load_inline", "collections.namedtuple", "torch.nn.parallel.DataParallel",
    "torch.fx.graph_module.GraphModule", "fxprep.capture.leaves.OpaqueMethod", "Tensor.__reduce_ex__",
    "Tensor.tofile", "autograd:os.system", "typing.get_type_hints", "torch._C._nn._parse_to",
]
# Names a save may legitimately hold: swapping one for another changes the model, not who runs code.
HARMLESS = ["torch.relu", "torch.nn.functional.gelu", "operator.add", "torch.nn.modules.conv.Conv2d",
            "torch.nn.modules.linear.Identity", "fxprep.ops.Mul", "Tensor.view", "math.sqrt", "builtins.len"]
ODD_NAMES = ["forward", "__class__", "__dict__", "_parameters", "training", "register_buffer", "extra_repr",
             "__init__", "weight", "bias", "0", "a\"b", "x\ny", "", "..", "conv1", "relu_1"]


# --- the canary ---------------------------------------------------------------------------------
_OP_NAMES = {"make", "call", "fn", "inputs", "slice"}


def _is_op_call(text: Any) -> bool:
    """``fxprep.ops`` compiles each op's call from a fixed grammar: ``def make(fn, c0, ...): def
    call(inputs): return fn(inputs[0], k=c0)``. The canary lets exactly that through, checked on
    the source (names, integer subscripts and calls only), so text smuggled in from a save still
    trips it."""
    if not isinstance(text, str):
        return False
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    allowed = (ast.Module, ast.FunctionDef, ast.arguments, ast.arg, ast.Return, ast.Call, ast.Name, ast.Load,
               ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Dict, ast.keyword, ast.Constant)
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            return False
        if isinstance(node, ast.Name) and node.id not in _OP_NAMES and not node.id[1:].isdigit():
            return False
        if isinstance(node, ast.Constant) and type(node.value) is not int:
            return False
    return True


class Canary:
    """Recording stand-ins for every way to run code a save could reach, armed around each load and
    each run of a loaded module (hypothesis itself uses exec); ``check`` fails the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch
        self.real_rmtree = shutil.rmtree
        self.real_exec, self.real_import = builtins.exec, builtins.__import__
        self.real_import_module = importlib.import_module
        self.fx_exec = torch.fx.graph_module._exec_with_source.__code__
        self.op_exec = fxprep.ops._caller.__code__
        self.installed = tuple({sys.prefix, sys.base_prefix, str(Path(fxprep.__file__).parents[1])})
        self.bad = {id(obj) for obj in _dangerous_objects()}  # and every stand-in below
        self._keep: list[Any] = []

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        def record(name: str):
            def stand_in(*args: Any, **kwargs: Any) -> Any:
                CALLS.append(f"{name}{str(args)[:200]}")
                raise RuntimeError(f"canary: {name} called")
            self.bad.add(id(stand_in))
            self._keep.append(stand_in)  # ids stay unique while the set holds them
            return stand_in

        def exec_(source: Any, *args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            caller = frame.f_code
            # an op module compiling its call (fxprep.ops._caller execs the code of its local `source`)
            if caller is self.op_exec and _is_op_call(frame.f_locals.get("source")):
                return self.real_exec(source, *args, **kwargs)
            if caller is not self.fx_exec:  # fx compiling the forward it generated is fine
                CALLS.append(f"exec{str(source)[:200]}")
                raise RuntimeError("canary: exec")
            return self.real_exec(source, *args, **kwargs)

        def importing(real: Any, how: str) -> Any:
            def import_(name: str, *args: Any, **kwargs: Any) -> Any:
                fresh = name not in sys.modules
                module = real(name, *args, **kwargs)
                where = str(getattr(sys.modules.get(name), "__file__", "") or "")
                if fresh and where and not where.startswith(self.installed):  # code from outside the installation
                    CALLS.append(f"{how} {name} from {where}")
                return module
            self.bad.add(id(import_))
            self._keep.append(import_)
            return import_

        self.bad.add(id(exec_))
        self._keep.append(exec_)
        with self.monkeypatch.context() as m:
            for target, attr in [(os, "system"), (os, "popen"), (os, "execv"), (os, "execve"), (os, "spawnv"),
                                 (subprocess, "Popen"), (builtins, "eval"),
                                 (torch.hub, "load"), (pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                                 (shutil, "rmtree"), (torch, "load"), (torch, "save")]:
                m.setattr(target, attr, record(f"{getattr(target, '__name__', target)}.{attr}"))
            m.setattr(builtins, "exec", exec_)
            # importing installed modules is how a trusted package's class is found; importing code from
            # anywhere else (a hubconf.py next to the save) is not
            m.setattr(builtins, "__import__", importing(self.real_import, "import"))
            m.setattr(importlib, "import_module", importing(self.real_import_module, "importlib.import_module"))
            yield

    def check(self, when: str, mutation: Any) -> None:
        ran = list(CALLS)
        CALLS.clear()
        if ran or SENTINEL.exists():
            pytest.fail(f"a mutated save ran code {when}: {ran or SENTINEL} (mutation: {mutation})")


# --- the saves ----------------------------------------------------------------------------------
class SmallResNet(nn.Module):
    """Two torchvision BasicBlocks (one downsampling) on a narrow stem: residual Adds, BatchNorm
    buffers, a reused ReLU unrolled, adaptive pooling, flatten and a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
        self.layer = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2, downsample=down))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer(self.stem(x))), 1))


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "seed":
        return ModelWithReusedReLU().eval(), torch.randn(1, 3, 32, 32)
    if name == "resnet":
        model = SmallResNet().eval()
        for m in model.modules():  # non-trivial running statistics
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
        return model, torch.randn(2, 3, 16, 16)
    return Tied().eval(), torch.randint(0, 10, (2, 5))


class Save:
    """One real save held in memory: its files, parsed JSON, and the prepared module's outputs."""

    def __init__(self, name: str, root: Path):
        model, self.x = _build(name)
        gm = fxprep.prepare_model(model, example_inputs=self.x)
        self.directory = io.save(gm, root / name)
        self.files = {n: (self.directory / n).read_bytes() for n in (*io.CHECKED_FILES, io.MANIFEST)}
        self.json = {n: json.loads(self.files[n]) for n in (io.GRAPH, io.MODULES, io.MANIFEST)}
        self.header_len = struct.unpack("<Q", self.files[io.WEIGHTS][:8])[0]
        self.header = json.loads(self.files[io.WEIGHTS][8:8 + self.header_len])
        with torch.no_grad():
            self.expected = _leaves(gm(self.x))
        self.paths = {n: list(_paths(self.json[n])) for n in self.json}
        self.node_names = [n["name"] for n in self.json[io.GRAPH]["nodes"]]
        self.module_paths = [e["path"] for e in self.json[io.MODULES]["modules"]]
        self.tensor_keys = [k for k in self.header if k != "__metadata__"]


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _paths(value: Any, prefix: tuple[Any, ...] = ()):
    """Every location in a JSON document (the manifest's checksums excluded: they are recomputed)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            if prefix == () and k == "sha256":
                continue
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _is_name_position(doc: Any, path: tuple[Any, ...], value: Any) -> bool:
    """Where a string is resolved to a function, class, module or method: a graph target, an op's
    or opaque part's "fn", a module's "class" (the root's is not read), a "fn"-tagged value."""
    if len(path) < 2 or not isinstance(value, str):
        return False
    parent = _get(doc, path[:-1])
    if path[-1] == "class":
        return parent.get("kind") not in ("root", None)
    if path[-1] == "fn":
        return True
    if path[-1] == "v":
        return parent.get("$") == "fn"
    return path[-1] == "target" and parent.get("op") in ("call_method", "call_module", "get_attr")


# --- mutations ----------------------------------------------------------------------------------
SIZE_SWAPS = {"F32": ["I32", "U32"], "I32": ["F32"], "F16": ["BF16", "I16"], "BF16": ["F16", "I16"],
              "F64": ["I64"], "I64": ["F64", "U64"], "U8": ["I8", "BOOL"], "BOOL": ["U8", "I8"]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(DANGEROUS + HARMLESS + ODD_NAMES + PAYLOADS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["$", "v", "fn", "class", "id"] + ODD_NAMES), inner, max_size=3),
    max_leaves=6,
)


def tagged_values(save: Save) -> st.SearchStrategy[Any]:
    """Values in fxprep's own tagged form, pointing at real or dangerous things."""
    return st.one_of(
        st.builds(lambda v: {"$": "fn", "v": v}, st.sampled_from(DANGEROUS + HARMLESS)),
        st.builds(lambda c, a: {"$": "object", "id": 0, "class": c, "attrs": a, "parameters": {}, "buffers": {},
                                "children": {}}, st.sampled_from(DANGEROUS + HARMLESS), st.dictionaries(st.sampled_from(ODD_NAMES), st.none(), max_size=2)),
        st.builds(lambda v: {"$": "type", "v": v}, st.sampled_from(["int", "torch.Tensor", "builtins.eval", "os.system"])),
        st.builds(lambda v: {"$": "tensor", "v": v}, st.sampled_from(save.tensor_keys + ["nope"])),
        st.builds(lambda v: {"$": "node", "v": v}, st.sampled_from(save.node_names + ["nope"])),
        st.builds(lambda v: {"$": "module", "v": v}, st.sampled_from(save.module_paths + ["nope"])),
        st.builds(lambda v: {"$": "slot", "v": v}, st.integers(-3, 6)),
        st.builds(lambda t, v: {"$": t, "v": v}, st.sampled_from(["tuple", "dict", "slice", "size", "dtype", "device",
                                                                    "float", "complex", "ref", "pickle", "ellipsis"]), json_values),
        # built anew each time: a later edit may insert into it, and a shared object would carry that
        # edit into the next example (hypothesis: "data generation depending on external state")
        st.builds(lambda: json.loads("[" * 500 + "]" * 500)),
    )


def mutate_json(data: st.DataObject, save: Save, docs: dict[str, Any], log: list[str]) -> None:
    """One edit somewhere in one JSON file (dangerous names preferred where names are resolved)."""
    name = data.draw(st.sampled_from([io.GRAPH, io.MODULES, io.MANIFEST]), label="file")
    doc = docs[name]
    paths = save.paths[name] if doc == save.json[name] else list(_paths(doc))  # after an earlier edit
    path = paths[data.draw(st.integers(0, len(paths) - 1), label="at")]
    value = _get(doc, path)
    ops = ["replace", "tagged", "delete", "insert", "duplicate", "rename_key"]
    if _is_name_position(doc, path, value):
        ops += ["swap_dangerous"] * 4 + ["swap_harmless"]
    op = data.draw(st.sampled_from(ops), label="op")
    log.append(f"{op} {name}{list(path)}")
    parent = _get(doc, path[:-1]) if path else None
    if op == "swap_dangerous":
        parent[path[-1]] = data.draw(st.sampled_from(DANGEROUS), label="name")
        log.append(repr(parent[path[-1]]))
        if len(path) >= 2 and path[-2] == "target":  # and give the call a payload to run
            _get(doc, path[:-2])["args"] = [data.draw(st.sampled_from(PAYLOADS), label="payload")]
        return
    if op == "swap_harmless":
        parent[path[-1]] = data.draw(st.sampled_from(HARMLESS), label="name")
    elif op in ("replace", "tagged"):
        new = data.draw(json_values if op == "replace" else tagged_values(save), label="value")
        if path:
            parent[path[-1]] = new
        else:
            docs[name] = new
        log.append(repr(new)[:200])
    elif op == "delete" and path:
        del parent[path[-1]]
    elif op == "insert":
        target = value if isinstance(value, (dict, list)) else parent
        new = data.draw(json_values | tagged_values(save), label="value")
        if isinstance(target, dict):
            target[data.draw(st.sampled_from(ODD_NAMES + ["args", "kwargs", "attrs", "patch", "kind"]), label="key")] = new
        elif isinstance(target, list):
            target.insert(data.draw(st.integers(0, len(target)), label="index"), new)
        log.append(repr(new)[:200])
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(path[-1], copy.deepcopy(value))
    elif op == "rename_key" and isinstance(parent, dict):
        parent[data.draw(st.sampled_from(ODD_NAMES), label="key")] = parent.pop(path[-1])


def mutate_weights(data: st.DataObject, save: Save, header: dict[str, Any], log: list[str]) -> None:
    """Edit the safetensors header: a dtype of the same width, a shape with the same size, a key."""
    keys = [k for k in header if k != "__metadata__"]
    key = data.draw(st.sampled_from(keys), label="tensor")
    entry = header[key]
    op = data.draw(st.sampled_from(["dtype", "shape", "key", "swap_keys"]), label="weights op")
    if op == "dtype" and entry["dtype"] in SIZE_SWAPS:
        entry["dtype"] = data.draw(st.sampled_from(SIZE_SWAPS[entry["dtype"]]), label="dtype")
    elif op == "shape":
        n = 1
        for d in entry["shape"]:
            n *= d
        entry["shape"] = data.draw(st.sampled_from([[n], list(reversed(entry["shape"])), [1, n], [n, 1]]), label="shape")
    elif op == "key":
        header[data.draw(st.sampled_from(save.tensor_keys + ODD_NAMES[:8]), label="new key")] = header.pop(key)
    elif op == "swap_keys":
        other = data.draw(st.sampled_from(keys), label="other")
        header[key], header[other] = header[other], header[key]
    log.append(f"weights {op} {key}: {header.get(key)}")


# Input-guard edits (issue 28): dtypes torch cannot draw a probe in (qint8 raised an INTERNAL ASSERT,
# bits8 NotImplementedError, out of fxprep.load), shapes past the whole-load budget, odd structures.
GUARD_DTYPES = ["qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8", "bits16", "bits1x8", "complex32",
                "complex128", "float8_e4m3fn", "uint64", "bool", "float64", "nope", "", None, 7, ["float32"]]
GUARD_SHAPES = [[], [0], [2**28], [2**14, 2**14], [2**39], [-1, 3], [1.5], ["2"], [1] * 65, None, "1x3", [2**63]]
# Drawn values are copied before they go into a document: a later edit of the same example may
# insert into a shape list, and an edited pool entry would change every later example (hypothesis:
# FlakyStrategyDefinition, "data generation depending on external state"). The fuzz test checks
# that the pools are as written here when it ends.
_POOLS = copy.deepcopy((GUARD_DTYPES, GUARD_SHAPES))


def mutate_guard(data: st.DataObject, docs: dict[str, Any], log: list[str]) -> None:
    """One edit of the manifest's input guard: an example's dtype or shape, or the tree around it."""
    manifest = docs[io.MANIFEST]
    # an earlier edit of the same example may have replaced the manifest or its guard with any value
    guard = manifest.get("input_guard") if isinstance(manifest, dict) else None
    params = guard.get("params") if isinstance(guard, dict) else None
    if not isinstance(params, dict) or not params:
        return
    name = data.draw(st.sampled_from(sorted(params)), label="guard param")
    node = params[name]
    op = data.draw(st.sampled_from(["dtype", "shape", "many", "kind", "example"]), label="guard op")
    example = node.get("example") if isinstance(node, dict) else None
    if op == "dtype" and isinstance(example, dict):
        example["dtype"] = copy.deepcopy(data.draw(st.sampled_from(GUARD_DTYPES), label="dtype"))
    elif op == "shape" and isinstance(example, dict):
        example["shape"] = copy.deepcopy(data.draw(st.sampled_from(GUARD_SHAPES), label="shape"))
    elif op == "many":  # many inputs, each within the per-input limit: the whole-load budget
        count = data.draw(st.sampled_from([2, 64, 1000]), label="count")
        item = {"kind": "leaf", "example": copy.deepcopy({
            "shape": data.draw(st.sampled_from(GUARD_SHAPES[:5]), label="shape"),
            "dtype": data.draw(st.sampled_from(GUARD_DTYPES), label="dtype")})}
        params[name] = {"kind": "seq", "type": "list", "items": [item] * count}
    elif op == "kind" and isinstance(node, dict):
        node["kind"] = data.draw(st.sampled_from(["tensor", "seq", "dict", "value", "leaf", "none", "x", None]), label="kind")
    elif op == "example" and isinstance(node, dict):
        node["example"] = data.draw(json_values, label="example")
    log.append(f"guard {op} {name}: {str(params.get(name))[:200]}")


def write_save(save: Save, directory: Path, docs: dict[str, Any], header: dict[str, Any] | None) -> None:
    directory.mkdir()
    (directory / io.GRAPH).write_text(json.dumps(docs[io.GRAPH]))
    (directory / io.MODULES).write_text(json.dumps(docs[io.MODULES]))
    (directory / io.CODE).write_bytes(save.files[io.CODE])
    if header is None:
        os.link(save.directory / io.WEIGHTS, directory / io.WEIGHTS)
    else:
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        body = save.files[io.WEIGHTS][8 + save.header_len:]
        (directory / io.WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    # a planted hubconf.py: torch.hub.load(source="local") on this directory would import it
    (directory / "hubconf.py").write_text("import tests.test_tamper_fuzz as t\nt._sentinel('hubconf')\n")
    manifest = docs[io.MANIFEST]
    if isinstance(manifest, dict):  # re-signed, as an attacker would
        manifest["sha256"] = {n: _sha(save, directory, n, header) for n in io.CHECKED_FILES}
    (directory / io.MANIFEST).write_text(json.dumps(manifest))


_SHA: dict[tuple[str, str], str] = {}


def _sha(save: Save, directory: Path, name: str, header: Any) -> str:
    if name == io.WEIGHTS and header is None:  # the unchanged weights: hashed once
        key = (str(save.directory), name)
        if key not in _SHA:
            _SHA[key] = io.format.sha256(save.directory / name)
        return _SHA[key]
    return hashlib.sha256((directory / name).read_bytes()).hexdigest()


# --- the fuzz tests -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_saves")
    return {name: Save(name, root) for name in ("seed", "resnet", "tied")}


COUNTS: dict[str, dict[str, int]] = {}


def _dangerous_objects() -> list[Any]:
    """The real objects behind DANGEROUS (taken here by reference, never by resolving a name)."""
    import collections
    import functools
    import operator
    import typing

    from torch.ao.quantization.fake_quantize import FakeQuantize

    return [os.system, builtins.eval, builtins.exec, builtins.__import__, builtins.open, subprocess.Popen,
            subprocess.run, torch.hub.load, pickle.loads, importlib.import_module, shutil.rmtree, torch.load,
            torch.save, operator.attrgetter, operator.methodcaller, functools.partial, FakeQuantize, torch.from_file,
            torch.ops.aten.from_file.default, _sentinel, torch.fx.graph_module._exec_with_source,
            collections.namedtuple, nn.DataParallel, typing.get_type_hints, torch._C._nn._parse_to]


def _holds(loaded: nn.Module, bad: set[int]) -> str | None:
    """Where ``loaded`` holds one of ``bad`` (by identity): graph targets, classes, attributes."""
    for node in loaded.graph.nodes:
        if id(node.target) in bad:
            return f"graph target of {node.name}"
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("gm", loaded)]
    while stack:
        where, v = stack.pop()
        if id(v) in bad or id(type(v)) in bad:
            return where
        if id(v) in seen or isinstance(v, (torch.Tensor, str, bytes, int, float, type(None))):
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            stack += [(f"{where}[{k!r}]", x) for k, x in v.items()] + [(f"{where} key", k) for k in v]
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
        elif hasattr(v, "__dict__") and not isinstance(v, (type, types.ModuleType, types.FunctionType)):
            stack += [(f"{where}.{k}", x) for k, x in vars(v).items()]
    return None


def _load_and_run(directory: Path, save: Save, canary: Canary, counts: dict[str, int], log: list[str]) -> None:
    try:
        with canary.armed():
            loaded = io.load(directory)
    except SerializationError:
        counts["refused"] += 1
        canary.check("during a refused load", log)
        return
    except Exception as err:  # noqa: BLE001 - any other exception is the failure under test
        pytest.fail(f"load raised {type(err).__name__}: {err} (not a SerializationError; mutation: {log})")
    canary.check("at load", log)
    found = _holds(loaded, canary.bad)
    if found is not None:
        pytest.fail(f"a mutated save put a dangerous object into the loaded module at {found} (mutation: {log})")
    try:
        with canary.armed(), torch.no_grad():
            got = _leaves(loaded(save.x))
    except Exception as err:  # noqa: BLE001 - any other exception is the failure under test
        canary.check("when the loaded module ran", log)
        pytest.fail(f"a mutated save loaded, then failed when run ({type(err).__name__}: {str(err)[:300]}); "
                    f"load must refuse it (mutation: {log})")
    if _same(save.expected, got):
        counts["same"] += 1
    elif _close(save.expected, got):  # within the self-check's tolerance (fxprep.io.selfcheck.RTOL)
        counts["close"] += 1
    else:
        pytest.fail(f"a mutated save loaded and computed other outputs (shapes {[tuple(t.shape) for t in got]}, "
                    f"expected {[tuple(t.shape) for t in save.expected]}); load must refuse it (mutation: {log})")
    canary.check("when the loaded module ran", log)


def _close(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    """Equal to the self-check's tolerance: 1e-4 of each output's magnitude."""
    return len(expected) == len(got) and all(
        a.shape == b.shape and a.dtype == b.dtype
        and float((a.double() - b.double()).abs().max()) <= selfcheck.RTOL * float(a.double().abs().max()) + 1e-6
        for a, b in zip(expected, got))


def _same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("model", ["seed", "resnet", "tied"])
def test_mutated_saves_never_run_code(saves, model, tmp_path_factory, monkeypatch, record_property):
    save = saves[model]
    work = tmp_path_factory.mktemp(f"mutated_{model}")
    counts = COUNTS.setdefault(model, {"saves_mutated": 0, "refused": 0, "same": 0, "close": 0, "guard_edits": 0})
    # warm-up (lazy imports, the allow-list) and a clean baseline: the unmutated save loads exactly
    loaded = io.load(save.directory)
    with torch.no_grad():
        assert _same(save.expected, _leaves(loaded(save.x)))
    canary = Canary(monkeypatch)
    started = time.perf_counter()

    @settings(max_examples=EXAMPLES_PER_MODEL, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        docs = copy.deepcopy(save.json)
        header = None
        log: list[str] = []
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            where = data.draw(st.integers(0, 5), label="where")
            if where == 0:
                header = header or copy.deepcopy(save.header)
                mutate_weights(data, save, header, log)
            elif where == 1:
                counts["guard_edits"] += 1
                mutate_guard(data, docs, log)
            else:
                mutate_json(data, save, docs, log)
        counts["saves_mutated"] += 1
        directory = work / f"m{counts['saves_mutated']}"
        write_save(save, directory, docs, header)
        try:
            _load_and_run(directory, save, canary, counts, log)
        finally:
            canary.real_rmtree(directory)

    fuzz()
    fuzz()
    assert (GUARD_DTYPES, GUARD_SHAPES) == _POOLS, "an edit changed a value pool shared by every example"
    seconds = time.perf_counter() - started
    for key, value in counts.items():
        record_property(key, value)
    record_property("seconds", round(seconds, 1))
    record_property("summary", f"tamper fuzz [{model}]: {counts['saves_mutated']} saves mutated in {seconds:.1f}s: "
          f"{counts['refused']} refused, {counts['same']} same outputs, {counts['close']} outputs equal to 1e-4, "
          f"{counts['guard_edits']} input-guard edits among them, "
          f"0 failing when run, 0 ran code")
    assert counts["saves_mutated"] >= EXAMPLES_PER_MODEL
    assert counts["refused"] > 0 and counts["same"] > 0


# --- load_weights: a checkpoint index is data from whoever wrote the checkpoint (issue 28) ------------------
class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


_KEYS = ["a.weight", "a.bias", "b.weight", "b.bias"]
_SHARDS = ["a.safetensors", "b.safetensors", "../outside/b.safetensors", "/abs/b.safetensors", "sub/../b.safetensors",
           "", ".", "..", "a.safetensors/..", "\\server\\b.safetensors", "C:\\b.safetensors", "nope.safetensors",
           "x" * 300 + ".safetensors", "sub/" * 2000 + "b.safetensors", "a\x00.safetensors", "sub"]
index_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(_SHARDS) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS + ["x"]), inner, max_size=4),
    max_leaves=8,
)
_VALID_MAP = {"a.weight": "a.safetensors", "a.bias": "a.safetensors", "b.weight": "b.safetensors", "b.bias": "b.safetensors"}
index_docs = st.one_of(
    # the valid index with some entries pointed elsewhere (or kept)
    st.builds(lambda edits: {"weight_map": {**_VALID_MAP, **edits}},
              st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_SHARDS[:2] + _SHARDS[2:]) | index_values, max_size=2)),
    st.fixed_dictionaries({"weight_map": st.dictionaries(st.sampled_from(_KEYS + ["zzz"]), st.sampled_from(_SHARDS) | index_values,
                                                          max_size=5)}),
    st.fixed_dictionaries({"weight_map": index_values}),
    index_values,
)


# Shard bytes damaged (issue 28): truncated, emptied, extended, a header byte changed, a header whose
# sizes, offsets or dtypes lie, the header length field itself. safetensors validates the header when the
# file is opened; what load_weights makes of its errors must be a WeightsError naming the file.
_HEADER_EDITS = {"shape": [[1000, 1000], [4], [2, 2], [0], [], [2**40, 2**40], [-1], "4", None],
                 "dtype": ["F64", "F16", "I32", "U8", "BOOL", "F8_E8M0", "ZZ", 3, None],
                 "data_offsets": [[0, 10**12], [4, 2], [0, 0], [-1, 16], [0], None, "x"]}


def _corrupt(data: st.DataObject, raw: bytes) -> tuple[bytes, str]:
    """``raw`` (a safetensors file) damaged one way; says how. ``values`` edits (inside the tensor data)
    keep the file valid: such a file loads, with other values, which no reader can tell."""
    length = struct.unpack("<Q", raw[:8])[0]
    op = data.draw(st.sampled_from(["truncate", "empty", "extend", "header_byte", "header_field", "length", "values"]),
                   label="shard op")
    if op == "truncate":
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
        return raw[:cut], f"truncated to {cut} bytes"
    if op == "empty":
        return b"", "empty"
    if op == "extend":
        return raw + b"\0" * data.draw(st.integers(1, 64), label="extra"), "extended"
    if op == "length":
        value = data.draw(st.sampled_from([0, 1, length - 1, length + 1, len(raw), 2**32, 2**63]), label="length")
        return struct.pack("<Q", value) + raw[8:], f"header length {value}"
    if op == "header_byte":
        at = data.draw(st.integers(8, 8 + length - 1), label="at")
        byte = data.draw(st.integers(0, 255), label="byte")
        return raw[:at] + bytes([byte]) + raw[at + 1:], f"header byte {at} = {byte}"
    if op == "values":
        at = data.draw(st.integers(8 + length, len(raw) - 1), label="at")
        return raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:], f"values byte {at} flipped"
    header = json.loads(raw[8:8 + length])
    key = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")), label="tensor")
    field = data.draw(st.sampled_from(sorted(_HEADER_EDITS)), label="field")
    header[key][field] = data.draw(st.sampled_from(_HEADER_EDITS[field]), label="value")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + length:], f"header {key}.{field} = {header[key][field]}"


def test_mutated_checkpoint_indexes_never_escape_and_raise_only_fxprep_errors(tmp_path_factory, record_property):
    """``load_weights`` on a sharded directory whose index is fuzzed (weight_map a list, null, names
    with ``..``, absolute, Windows paths, names too long for the system, odd values) and whose shards
    are damaged (truncated, headers that lie about sizes, offsets, dtypes): it loads, or raises an
    WeightsError naming the problem; a shard outside the directory (holding other values) is never read."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("index_fuzz")
    torch.manual_seed(0)
    reference = _Two().eval()
    state = reference.state_dict()
    (root / "outside").mkdir()
    save_file({k: v + 100 for k, v in state.items() if k.startswith("b.")}, str(root / "outside" / "b.safetensors"))
    ckpt = root / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    save_file({k: v for k, v in state.items() if k.startswith("a.")}, str(ckpt / "a.safetensors"))
    save_file({k: v for k, v in state.items() if k.startswith("b.")}, str(ckpt / "b.safetensors"))
    shards = {name: (ckpt / name).read_bytes() for name in ("a.safetensors", "b.safetensors")}
    counts = {"indexes": 0, "shards_damaged": 0, "loaded": 0, "refused": 0}
    x = torch.randn(2, 3)

    @settings(max_examples=max(EXAMPLES_PER_MODEL // 3, 20), deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(doc=index_docs, data=st.data())
    @example(doc={"weight_map": _VALID_MAP}, data=None)
    def fuzz(doc: Any, data: st.DataObject | None) -> None:
        counts["indexes"] += 1
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(doc))
        for name, raw in shards.items():
            (ckpt / name).write_bytes(raw)
        damage = ""
        if data is not None and data.draw(st.booleans(), label="damage a shard"):
            if data.draw(st.booleans(), label="with the valid index"):
                doc = {"weight_map": _VALID_MAP}
                (ckpt / "model.safetensors.index.json").write_text(json.dumps(doc))
            name = data.draw(st.sampled_from(sorted(shards)), label="shard")
            raw, how = _corrupt(data, shards[name])
            (ckpt / name).write_bytes(raw)
            damage = f"{name} {how}"
            counts["shards_damaged"] += 1
        with torch.device("meta"):
            model = _Two().eval()
        gm = fxprep.prepare_model(model, example_inputs=torch.randn(2, 3, device="meta"), tracer="fx", verify=False,
                                  progress=False)
        try:
            fxprep.load_weights(gm, ckpt)
        except fxprep.WeightsError:  # the checkpoint's fault, never the arguments': WeightsError, not InvalidInput
            counts["refused"] += 1
            return
        except Exception as err:  # noqa: BLE001 - any other exception is the failure under test
            pytest.fail(f"load_weights raised {type(err).__name__}: {str(err)[:300]} (not a WeightsError; index: "
                        f"{str(doc)[:300]}; shard damage: {damage or 'none'})")
        counts["loaded"] += 1
        if "values byte" not in damage:  # a shard read from outside the directory holds other values
            with torch.no_grad():
                assert torch.equal(gm(x), reference(x)), \
                    f"load_weights read a shard outside the checkpoint (index: {doc}; shard damage: {damage or 'none'})"

    fuzz()
    for key, value in counts.items():
        record_property(key, value)
    record_property("summary", f"index fuzz: {counts['indexes']} indexes ({counts['shards_damaged']} with a damaged shard): {counts['refused']} "
          f"refused (WeightsError), {counts['loaded']} loaded the checkpoint's own shards, 0 read a file outside it, "
          f"0 raw exceptions")
    assert counts["refused"] > 0 and counts["loaded"] > 0 and counts["shards_damaged"] > 0
