"""A save's self-check: the loaded module, run on fake inputs shaped like its example, must do what
the saved module did.

Checksums prove that files are intact, not that they are the files fxprep wrote: whoever edits one
can recompute its checksum. Every name in a save is checked by identity (:mod:`.trust`), so an edited
save cannot run code; but it can still describe a module that is broken in ways no single field
shows - a call that lost an argument, a convolution given three strides, a weight whose shape was
transposed, an input guard that no longer accepts the example. Such a module loads, and fails on its
first call, far from the file at fault (or, worse, in a calibration job hours later).

So :func:`record` runs the module at save time on *fake* tensors (``FakeTensorMode``: shapes and
dtypes only, no data, no memory, parameters never copied) built from the example the input guard
describes, and the manifest keeps what that run gave: the outputs' structure, shapes and dtypes, or
the node where it stopped (data-dependent code, such as a detector's ``nonzero``, cannot run on fake
tensors; where it stops is as much a property of the module as its outputs). :func:`check` does the
same run on the loaded module and raises :class:`SerializationError` when the two differ, naming the
node. A value edit (another weight, another constant of the same shape) is not seen: it describes
another model of the same form, which no loader can tell from a legitimate save.

A save without an input guard (a module prepared without example inputs) records that there was no
example; the loaded module must then have none either. The run leaves the module exactly as it was
(:func:`fxprep.runs.preserved_state`).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import guard
from ..errors import InputMismatch, SerializationError
from ..guard import InputSpec
from ..runs import preserved_state
from . import allowlist

_DTYPES = allowlist.dtype_table(torch.dtype)
_NO_EXAMPLE = {"run": "none", "why": "no example inputs recorded"}


class _Stopped(Exception):
    """The fake run stopped at ``node`` (an input guard refusing the example counts as a node)."""

    def __init__(self, node: str, error: BaseException):
        super().__init__(node)
        self.node, self.error = node, error


class _Interpreter(fx.Interpreter):
    """fx's interpreter, remembering which node failed."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except _Stopped:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a node is what is recorded
            raise _Stopped(n.name, err) from err


def _example_value(node: dict[str, Any], device: torch.device) -> Any:
    """The value an input-guard node describes, tensors built empty in the active fake mode; raises
    LookupError where the guard does not say (a non-tensor leaf, a tensor without its example)."""
    kind = node["kind"]
    if kind == "none":
        return None
    if kind == "value":
        return node["value"]
    if kind == "seq":
        items = [_example_value(item, device) for item in node["items"]]
        return items if node["type"] == "list" else tuple(items)
    if kind == "dict":
        return {k: _example_value(v, device) for k, v in node["items"].items()}
    example = node.get("example")
    if example is None:
        raise LookupError("an input the guard does not describe")
    dtype = _DTYPES.get(example["dtype"])
    if dtype is None:
        raise SerializationError(f"the input guard names an unknown dtype {str(example['dtype'])[:40]!r}.")
    return torch.empty(example["shape"], dtype=dtype, device=device)


def _describe(value: Any, depth: int = 0) -> Any:
    """The outputs as JSON data: tensors by shape and dtype, containers by structure."""
    if depth > 32:
        return {"type": "deep"}
    if isinstance(value, torch.Tensor):
        return {"shape": [int(s) for s in value.shape], "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "seq": [_describe(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[str(k), _describe(v, depth + 1)] for k, v in value.items()]}
    if value is None or type(value) in (bool, int, float, str):
        return {"value": value}
    return {"type": type(value).__name__}


def _device(gm: torch.nn.Module) -> torch.device:
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device
    return torch.device("cpu")


def record(gm: fx.GraphModule, spec: InputSpec | None) -> dict[str, Any]:
    """What a fake run of ``gm`` on the example ``spec`` describes gives (JSON data for the manifest)."""
    if spec is None:
        return dict(_NO_EXAMPLE)
    device = _device(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with preserved_state(gm), torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        try:
            kwargs = {name: _example_value(node, device) for name, node in spec.params.items()}
        except LookupError as err:
            return {"run": "none", "why": str(err)}
        try:
            try:
                guard.check(gm, spec, (), kwargs)
            except InputMismatch as err:
                raise _Stopped("input guard", err) from err
            # the generated forward's parameters are the placeholders, in order (their targets may differ)
            names = list(inspect.signature(gm.forward).parameters)
            if len(names) != len(placeholders) or set(names) - set(kwargs):
                raise _Stopped("input guard", TypeError(f"the forward takes {names}, the guard describes {list(kwargs)}"))
            args = [kwargs[name] for name in names]
            try:
                outputs = gm.forward(*args)  # the generated code: fast
            except Exception:  # noqa: BLE001 - run again node by node, to say where
                _Interpreter(gm).run(*args)
                raise
        except _Stopped as stop:
            return {"run": "stopped", "node": stop.node, "error": type(stop.error).__name__,
                    "detail": str(stop.error)[:300]}
        except Exception as err:  # noqa: BLE001 - outside any node (the interpreter itself)
            return {"run": "stopped", "node": "", "error": type(err).__name__, "detail": str(err)[:300]}
        return {"run": "outputs", "outputs": json.loads(json.dumps(_describe(outputs)))}


def _said(result: dict[str, Any]) -> str:
    if result.get("run") == "outputs":
        return f"it returned {_short(result.get('outputs'))}"
    if result.get("run") == "stopped":
        return f"it stopped at node {result.get('node')!r} with {result.get('error')}: {str(result.get('detail'))[:200]}"
    return f"it could not be run ({result.get('why')})"


def _short(outputs: Any) -> str:
    text = json.dumps(outputs)
    return text if len(text) <= 200 else text[:200] + "..."


def _key(result: Any) -> Any:
    """What must agree: the outputs, or where and how the run stopped (not the wording of the error,
    which may change between torch versions)."""
    if not isinstance(result, dict):
        return None
    if result.get("run") == "stopped":
        return ("stopped", result.get("node"), result.get("error"))
    if result.get("run") == "outputs":
        return ("outputs", json.dumps(result.get("outputs"), sort_keys=True))
    return ("none", result.get("why"))


def check(gm: fx.GraphModule, spec: InputSpec | None, saved: Any, where: str) -> None:
    """Raise :class:`SerializationError` unless ``gm`` run on its example does what the save recorded."""
    if not isinstance(saved, dict) or saved.get("run") not in ("outputs", "stopped", "none"):
        raise SerializationError(f"{where} has no valid self_check record (written by every fxprep.save): "
                                 f"the manifest was edited or damaged.")
    now = record(gm, spec)
    if _key(now) == _key(saved):
        return
    raise SerializationError(
        f"{where} does not describe the module that was saved: run on fake inputs shaped like its example, "
        f"{_said(now)}; when it was saved, {_said(saved)}. The files were changed after saving (their "
        f"checksums may have been recomputed): load a save as fxprep.save wrote it.")
