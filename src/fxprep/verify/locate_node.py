"""The first node of a prepared graph whose inputs agree with eager and whose output does not.

Every torch call of the original and of the prepared graph (through an ``fx.Interpreter``) is
recorded with a ``TorchFunctionMode``; a prepared call is paired with the next eager call of the
same function whose tensor inputs agree, and the first pair whose outputs differ names its node.
Nodes whose inputs already differ are passed over, so the answer is the cause, not its first
symptom.

See docs/concepts/verification.md ("Under the hood").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..core.inputs import ExampleInputs
from ..core.runs import SEED, preserved_state, run_model

LOOKAHEAD = 16  # eager calls of the same function searched for a partner (extra or missing calls in between)
IGNORED = {torch.Tensor.__getitem__.__name__, "size", "dim", "__len__", "numel", "is_floating_point", "__get__"}


@dataclass
class Call:
    """One torch call: its function, tensor inputs (positional, in order), the other arguments as
    text, its output tensors and the node that made it (prepared run only)."""

    fn: Any
    inputs: list[torch.Tensor]
    others: str
    outputs: list[torch.Tensor]
    node: str | None = None
    is_module: bool = False


@dataclass
class Located:
    """The node found, the function it called, and what differs there."""

    node: str
    function: str
    detail: str
    is_module: bool = False

    def __str__(self) -> str:
        return f"'{self.node}' ({self.function}: {self.detail})"


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t.detach() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _others(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        return "T" if isinstance(v, torch.Tensor) else ("None" if v is None else repr(v)[:40])

    return ", ".join([show(a) for a in args] + [f"{k}={show(v)}" for k, v in sorted(kwargs.items())])


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.node: str | None = None
        self.is_module = False
        self.depth = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.depth or getattr(func, "__name__", "") in IGNORED:
            return func(*args, **kwargs)
        self.depth += 1  # only the outermost call: what the model's code called
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        outputs = _tensors(out)
        if outputs:
            self.calls.append(Call(func, _tensors(args), _others(args, kwargs), outputs, self.node, self.is_module))
        return out


class _NodeRunner(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, recorder: _Recorder):
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: fx.Node) -> Any:
        self.recorder.node = str(n.target) if n.op == "call_module" else n.name
        self.recorder.is_module = n.op == "call_module"
        return super().run_node(n)


def _close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float, atol: float) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        if x.device.type == "meta":
            continue
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {tuple(x.shape)}/{x.dtype} in eager, {tuple(y.shape)}/{y.dtype} prepared"
    diffs = [float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if x.numel()]
    return f"inputs agree, output differs by {max(diffs, default=0.0):.3g}"


def locate(original: nn.Module, prepared: fx.GraphModule, example: ExampleInputs,
           prepared_example: ExampleInputs, rtol: float, atol: float) -> Located | None:
    """The first node whose inputs agree with eager's and whose output does not (module docstring);
    None when no such call was found (the difference comes from a call no partner was found for)."""
    eager = _Recorder()
    try:
        with preserved_state(original, prepared), torch.no_grad(), eager:
            run_model(original, example)
    except Exception:  # noqa: BLE001 - localisation is best effort
        return None
    mine = _Recorder()
    fresh = prepared_example.fresh_copy()
    try:
        with preserved_state(original, prepared), torch.no_grad(), mine:
            torch.manual_seed(SEED)
            _NodeRunner(prepared, mine).run(*fresh.args, *fresh.kwargs.values())
    except Exception:  # noqa: BLE001 - locating a difference is best effort after verification failed
        return None
    by_fn: dict[Any, list[int]] = {}
    for i, call in enumerate(eager.calls):
        by_fn.setdefault(call.fn, []).append(i)
    cursor: dict[Any, int] = {}
    for call in mine.calls:
        candidates = by_fn.get(call.fn, [])
        start = cursor.get(call.fn, 0)
        for j in range(start, min(start + LOOKAHEAD, len(candidates))):
            partner = eager.calls[candidates[j]]
            if not _close(partner.inputs, call.inputs, rtol, atol):
                continue
            cursor[call.fn] = j + 1
            if not _close(partner.outputs, call.outputs, rtol, atol):
                detail = _worst(partner.outputs, call.outputs)
                if partner.others != call.others:
                    detail += f"; called with ({call.others}) where eager called ({partner.others})"
                return Located(call.node or "?", getattr(call.fn, "__name__", str(call.fn)), detail, call.is_module)
            break
    return None
