"""A save's self-check: the loaded module, run on a probe input shaped like its example, must compute
what the saved module computed.

An edited save cannot run code (:mod:`.trust`), but it can describe a module broken in ways no
single field shows; a loader bug can too. :func:`record` runs the module at save time on a seeded
probe built from the input guard and keeps the outputs' structure and per-tensor fingerprints in the
manifest; :func:`check` repeats the run on the loaded module and raises :class:`SerializationError`
where they differ. The run leaves the module as it was.

See docs/security.md ("The self-check" and "Under the hood") for the tolerances and limits.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from ..core.runs import SEED, preserved_state
from ..errors import InputMismatch, SerializationError
from ..runtime import guard, modes
from ..runtime.guard import InputSpec
from . import allowlist, budget, peak, pyvalues
from .format import LIMITS

_NO_EXAMPLE = {"run": "none", "why": "no example inputs recorded"}
RTOL = 1e-4
CROSS_DEVICE_RTOL = 1e-2  # saved on one device type, loaded on another


class _Stopped(Exception):
    """The probe run stopped at ``node`` (an input guard refusing the probe counts as a node)."""

    def __init__(self, node: str, error: BaseException):
        super().__init__(node)
        self.node, self.error = node, error


# what stops the probe run past a limit (not a recorded stop: a save past it is refused at save and at load)
_BUDGETS = (peak.ForwardTooLarge, peak.PythonTooLarge, peak.TooSlow)


class _Interpreter(peak.Bounded):
    """fx's interpreter within the forward budget (:class:`.peak.Bounded`), remembering which node
    failed."""

    def __init__(self, gm: fx.GraphModule, deadline: float | None):
        super().__init__(gm, LIMITS["forward_bytes"], LIMITS["forward_tensors"], LIMITS["op_flops"], deadline,
                         LIMITS["load_seconds"])

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except (_Stopped, *_BUDGETS):
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a node is what is recorded
            raise _Stopped(n.name, err) from err


# The dtypes a probe input may have: plain numbers (quantized and bit dtypes cannot be drawn: an input
# guard naming qint8 made torch raise an internal assert, bits8 NotImplementedError, from fxprep.load).
_INTEGERS = frozenset(getattr(torch, n) for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                                                   "uint64") if hasattr(torch, n))


def _probe_dtype(name: Any) -> torch.dtype:
    dtype = allowlist.dtype_table(torch.dtype).get(name) if isinstance(name, str) else None
    if dtype is None:
        raise SerializationError(f"the input guard names an unknown dtype {str(name)[:40]!r}.")
    if not (dtype in _INTEGERS or ((dtype.is_floating_point or dtype.is_complex) and dtype.itemsize >= 1)):
        raise SerializationError(f"the input guard names dtype {str(name)[:40]!r} for an example input; fxprep.save "
                                 f"records only plain number dtypes there (the file was edited).")
    return dtype


def _tensor_examples(node: Any) -> list[dict[str, Any]]:
    """Every tensor example an input-guard tree describes (walked without recursion)."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict):
            continue
        if n.get("kind") == "seq":
            stack.extend(n.get("items") or [])
        elif n.get("kind") == "dict":
            stack.extend((n.get("items") or {}).values())
        elif isinstance(n.get("example"), dict):
            found.append(n["example"])
    return found


def probe_bytes(spec: InputSpec) -> int:
    """The memory the probe inputs of ``spec`` take (each floating input is drawn in float32 and then
    cast), from the declared shapes and dtypes alone: checked against the whole-load budget
    (``LIMITS["probe_bytes"]``) before anything is allocated."""
    total = 0
    for example in _tensor_examples({"kind": "seq", "items": list(spec.params.values())}):
        dtype = _probe_dtype(example.get("dtype"))
        numel = math.prod(example.get("shape") or [])
        total += numel * (dtype.itemsize + (4 if dtype.is_floating_point or dtype.is_complex else 0))
    return total


def _probe_value(node: dict[str, Any], device: torch.device, generator: torch.Generator) -> Any:
    """The probe value for an input-guard node; raises LookupError where the guard does not say (a
    non-tensor leaf, a tensor recorded without its example)."""
    kind = node["kind"]
    if kind == "none":
        return None
    if kind == "value":
        return node["value"]
    if kind == "seq":
        items = [_probe_value(item, device, generator) for item in node["items"]]
        return items if node["type"] == "list" else tuple(items)
    if kind == "dict":
        return {k: _probe_value(v, device, generator) for k, v in node["items"].items()}
    example = node.get("example")
    if example is None:
        raise LookupError("an input the guard does not describe")
    dtype = _probe_dtype(example["dtype"])
    shape = example["shape"]
    if math.prod(shape) > 2**28:
        raise LookupError(f"an example input of {math.prod(shape)} elements")
    try:
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)
        return torch.ones(shape, dtype=dtype, device=device)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, MemoryError) as err:
        raise SerializationError(f"cannot make the probe input the input guard describes ({str(example)[:120]}): "
                                 f"{type(err).__name__}: {str(err)[:200]}") from err


def _fingerprint(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and three float64 sums of ``t``'s values (NaN and inf survive as strings)."""
    out: dict[str, Any] = {"shape": [int(s) for s in t.shape], "dtype": str(t.dtype).removeprefix("torch.")}
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return out
    v = t.detach().flatten()
    v = torch.view_as_real(v).flatten() if v.is_complex() else v
    v = v.to(device="cpu", dtype=torch.float64)
    pattern = torch.cos(torch.arange(v.numel(), dtype=torch.float64) * 0.7548776662466927)  # fixed, not periodic
    out["sums"] = [_number(float(v.sum())), _number(float(v.abs().sum())), _number(float((v * pattern).sum()))]
    return out


def _number(value: float) -> float | str:
    """JSON has no NaN or infinity: those are kept as their names."""
    return value if math.isfinite(value) else str(value)


def _describe(value: Any, depth: int = 0) -> Any:
    """The outputs as JSON data: tensors by :func:`_fingerprint`, containers by structure."""
    if depth > 32:
        return {"type": "deep"}
    if isinstance(value, torch.Tensor):
        return _fingerprint(value)
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "seq": [_describe(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[str(k), _describe(v, depth + 1)] for k, v in value.items()]}
    if value is None or type(value) in (bool, int, str):
        return {"value": value}
    if type(value) is float:
        return {"value": _number(value)}
    return {"type": type(value).__name__}


def _device(gm: torch.nn.Module) -> torch.device:
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device
    return torch.device("cpu")


def deadline() -> float:
    """When a load (or a save's self-check) starting now must be done (``LIMITS["load_seconds"]``)."""
    return time.monotonic() + LIMITS["load_seconds"]


def record(gm: fx.GraphModule, spec: InputSpec | None, where: str, saving: bool = False,
           until: float | None = None) -> dict[str, Any]:
    """What the probe run of ``gm`` gives (JSON data for the manifest). Both callers (``save`` and
    :func:`check`) have run :func:`check_budget` first: the probe inputs fit the whole-load budget.
    An op that would take the run past the forward budget (:mod:`.peak`) is a :func:`_past_budget`
    error, not a recorded stop: its memory was never allocated, and a save whose self-check cannot
    run within the budget on the loading side must not be written."""
    try:
        return _record(gm, spec, until)
    except peak.ForwardTooLarge as err:
        found, limit = {
            "tensors": (f"would make {err.need:,} tensors with {err.live:,} already alive", "forward_tensors"),
            "flops": (f"would compute {err.need:,} flops in one op", "op_flops"),
        }.get(err.unit, (f"would need {err.need:,} bytes with {err.live:,} already in use", "forward_bytes"))
        raise _past_budget(where, saving, f"run on its probe input (the example's shapes), node {err.node!r} {found}",
                           limit, "It did not run.") from None
    except peak.PythonTooLarge as err:
        raise _past_budget(where, saving, f"run on its probe input (the example's shapes), node {err.node!r} would "
                           f"build {err.what}", err.limit, "It did not run.") from None
    except peak.TooSlow as err:
        why = ("the module is too slow for its example: save one prepared with smaller example inputs" if saving
               else "the file makes it run that long (fxprep.save refuses what load would)")
        raise SerializationError(f"{where}: stopped at node {err.node!r} after {err.seconds:g} s, the time any fxprep "
                                 f"load may take (fxprep.io.format.LIMITS['load_seconds']); {why}.") from None


def _past_budget(where: str, saving: bool, found: str, limit: str, done: str) -> SerializationError:
    """The error for a save past ``LIMITS[limit]``, which every load enforces: at ``save`` (``saving``),
    that loading would refuse it and how to save one that would not; at ``load``, that the file was
    edited after it was saved (save never writes one past it)."""
    name = {"probe_bytes": "whole-load budget", "forward_bytes": "forward budget",
            "forward_tensors": "forward budget of tensors", "op_flops": "budget of one op's flops",
            "python_int_bits": "bound on Python integers", "python_items": "bound on Python sequences",
            "python_total": "bound on the Python values a run builds"}[limit]
    why = ("load would refuse it: save a module prepared with smaller example inputs or sizes" if saving
           else "the file was edited (its input guard or graph)")
    unit = limit.rpartition("_")[2]
    return SerializationError(f"{where}: {found}, more than any fxprep save's {name} allows ({LIMITS[limit]:,} "
                              f"{unit}, fxprep.io.format.LIMITS[{limit!r}]); {why}. {done}")


@contextlib.contextmanager
def _modes_left(gm: fx.GraphModule) -> Iterator[None]:
    """The modes the graph can enter (an autocast region) as they were before the probe run, on every
    path: a run that stops inside a region (which is what it records) never reaches the region's exit."""
    entered = modes.entered(gm)
    state = modes.snapshot(entered) if entered else None
    try:
        yield
    finally:
        if state is not None:
            modes.restore(state)


def _record(gm: fx.GraphModule, spec: InputSpec | None, until: float | None) -> dict[str, Any]:
    if spec is None:
        return dict(_NO_EXAMPLE)
    device = _device(gm)
    generator = torch.Generator().manual_seed(SEED)
    try:
        kwargs = {name: _probe_value(node, device, generator) for name, node in spec.params.items()}
    except LookupError as err:
        return {"run": "none", "why": str(err)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    result: dict[str, Any] = {"device": device.type}
    with preserved_state(gm), torch.no_grad(), _modes_left(gm):
        torch.manual_seed(SEED)
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
            outputs = _Interpreter(gm, until).run(*args)
        except _BUDGETS:
            raise
        except _Stopped as stop:
            return {**result, "run": "stopped", "node": stop.node, "error": type(stop.error).__name__,
                    "detail": str(stop.error)[:300]}
        except Exception as err:  # noqa: BLE001 - outside any node (the interpreter itself)
            return {**result, "run": "stopped", "node": "", "error": type(err).__name__, "detail": str(err)[:300]}
        return {**result, "run": "outputs", "outputs": json.loads(json.dumps(_describe(outputs)))}


# --- comparing ----------------------------------------------------------------------------------------
def _said(result: dict[str, Any]) -> str:
    if result.get("run") == "outputs":
        return f"it returned {_short(_form(result.get('outputs')))}"
    if result.get("run") == "stopped":
        return f"it stopped at node {result.get('node')!r} with {result.get('error')}: {str(result.get('detail'))[:200]}"
    return f"it could not be run ({result.get('why')})"


def _short(outputs: Any) -> str:
    text = json.dumps(outputs)
    return text if len(text) <= 200 else text[:200] + "..."


def _form(outputs: Any) -> Any:
    """The outputs without the value fingerprints."""
    if isinstance(outputs, dict):
        return {k: _form(v) for k, v in outputs.items() if k != "sums"}
    if isinstance(outputs, list):
        return [_form(v) for v in outputs]
    return outputs


def _known_device(value: Any) -> bool:
    """Whether ``value`` is a device type torch knows (``"cpu"``, ``"cuda"``), as :func:`record` writes it."""
    if not isinstance(value, str):
        return False
    try:
        return torch.device(value).type == value
    except (RuntimeError, ValueError):
        return False


def _value_difference(saved: Any, now: Any, path: str = "output", rtol: float = RTOL) -> str | None:
    """Where the fingerprints of two outputs of the same form differ beyond the tolerance."""
    if isinstance(saved, dict) and isinstance(now, dict):
        if "sums" in saved or "sums" in now:
            a, b = saved.get("sums"), now.get("sums")
            if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 3):
                return f"{path}: no value fingerprint to compare"
            scale = a[1] if isinstance(a[1], float) else 0.0
            for x, y in zip(a, b):
                if isinstance(x, str) or isinstance(y, str):
                    if x != y:
                        return f"{path}: {x} when saved, {y} now"
                elif not isinstance(x, float | int) or not isinstance(y, float | int) or abs(x - y) > rtol * scale + 1e-6:
                    return f"{path}: values differ (sums {a} when saved, {b} now)"
            return None
        for k in saved:
            found = _value_difference(saved[k], now.get(k), path, rtol)
            if found:
                return found
        return None
    if isinstance(saved, list) and isinstance(now, list):
        for i, (x, y) in enumerate(zip(saved, now)):
            found = _value_difference(x, y, f"{path}[{i}]", rtol)
            if found:
                return found
    return None


def check_budget(gm: fx.GraphModule, spec: InputSpec | None, where: str, saving: bool = False) -> None:
    """The whole-load budget (``LIMITS["probe_bytes"]``), counted before anything runs: the probe
    inputs the input guard declares, plus every tensor the graph makes with sizes written into it
    (:func:`.budget.literal_allocations`: ``torch.zeros(2**40)`` in a hand-edited save); and the
    literal arguments of the graph's Python calls (:func:`.pyvalues.literal_problems`: a power's
    exponent of 10**9, on any branch). ``save`` checks the same, so it never writes what every
    ``load`` would refuse."""
    literal = pyvalues.literal_problems(gm)
    if literal:
        node, what = literal[0]
        raise _past_budget(where, saving, f"node {node!r} calls {what}", "python_int_bits", "Nothing was run.")
    probe = probe_bytes(spec) if spec is not None else 0
    made = budget.literal_allocations(gm)
    total = probe + budget.declared_bytes(made)
    if total <= LIMITS["probe_bytes"]:
        return
    biggest = sorted(made, key=lambda m: -m[2])[:3]
    parts = ([f"the input guard declares example inputs of {probe:,} bytes"] if probe else []) + [
        f"node {node!r} ({what} with literal sizes) would {'expand to' if what in budget.VIEWS else 'allocate'} "
        f"{size:,} bytes" for node, what, size in biggest]
    more = f" (and {len(made) - 3} more node(s))" if len(made) > 3 else ""
    raise _past_budget(where, saving, f"{'; '.join(parts)}{more}: {total:,} bytes in all", "probe_bytes",
                       "Nothing was allocated.")


def check(gm: fx.GraphModule, spec: InputSpec | None, saved: Any, where: str, until: float | None = None) -> None:
    """Raise :class:`SerializationError` unless ``gm`` run on its probe does what the save recorded."""
    check_budget(gm, spec, where)
    if (not isinstance(saved, dict) or saved.get("run") not in ("outputs", "stopped", "none")
            or (saved.get("run") != "none" and not _known_device(saved.get("device")))):
        raise SerializationError(f"{where} has no valid self_check record (written by every fxprep.save): "
                                 f"the manifest was edited or damaged.")
    now = record(gm, spec, where, until=until)
    problem = None
    if now.get("run") != saved.get("run"):
        problem = "differs"
    elif now["run"] == "stopped":
        if (now.get("node"), now.get("error")) != (saved.get("node"), saved.get("error")):
            problem = "differs"  # not the wording of the error, which may change between torch versions
    elif now["run"] == "none":
        if now.get("why") != saved.get("why"):
            problem = "differs"
    elif json.dumps(_form(now.get("outputs")), sort_keys=True) != json.dumps(_form(saved.get("outputs")), sort_keys=True):
        problem = "differs"
    else:
        rtol = RTOL if saved.get("device") == now.get("device") else CROSS_DEVICE_RTOL
        found = _value_difference(saved.get("outputs"), now.get("outputs"), rtol=rtol)
        if found:
            raise SerializationError(
                f"{where} does not describe the module that was saved: run on its probe input (the example's "
                f"shapes, fixed values), {found}. The files were changed after saving (their checksums may have "
                f"been recomputed): load a save as fxprep.save wrote it.")
    if problem:
        raise SerializationError(
            f"{where} does not describe the module that was saved: run on its probe input (the example's shapes, "
            f"fixed values), {_said(now)}; when it was saved, {_said(saved)}. The files were changed after saving "
            f"(their checksums may have been recomputed): load a save as fxprep.save wrote it.")
