"""Deliberately broken graphs (issue 27, item 2): each edit makes a prepared decoder compute something
really different from eager, however slightly, and verification must fail on every one.

Each break is a context manager ``break_(gm, layer)`` that edits layer ``layer`` of a prepared
transformers decoder (Llama-style node names) in place and puts the graph back on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx


def _node(gm: fx.GraphModule, target: str) -> fx.Node:
    found = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == target]
    assert len(found) == 1, f"no single call of {target} in the graph"
    return found[0]


def _rewire(users: list[fx.Node], old: fx.Node, new: fx.Node) -> None:
    for user in users:
        user.replace_input_with(old, new)


@contextlib.contextmanager
def _edited(gm: fx.GraphModule, undo: Callable[[], None]) -> Iterator[None]:
    """Runs the edited graph (recompiled) until exit; then ``undo()`` puts the graph back and it is
    recompiled again, so the module computes the right graph afterwards."""
    gm.recompile()
    try:
        yield
    finally:
        undo()
        gm.recompile()


@contextlib.contextmanager
def dropped_residual(gm: fx.GraphModule, layer: int) -> Iterator[None]:
    """The MLP's residual add returns the MLP output alone."""
    add = _node(gm, f"model.layers.{layer}.add_1")
    branch = add.args[1]
    assert isinstance(branch, fx.Node)
    users = list(add.users)
    _rewire(users, add, branch)
    with _edited(gm, lambda: _rewire(users, branch, add)):
        yield


@contextlib.contextmanager
def swapped_weight(gm: fx.GraphModule, layer: int) -> Iterator[None]:
    """The MLP's down projection calls the next layer's module (its weights)."""
    node = _node(gm, f"model.layers.{layer}.mlp.down_proj")
    node.target = f"model.layers.{layer + 1}.mlp.down_proj"
    with _edited(gm, lambda: setattr(node, "target", f"model.layers.{layer}.mlp.down_proj")):
        yield


@contextlib.contextmanager
def wrong_mask(gm: fx.GraphModule, layer: int) -> Iterator[None]:
    """The attention forgets causality: is_causal=False and no mask (every token sees the future)."""
    op = gm.get_submodule(f"model.layers.{layer}.self_attn.sdpa_attention_forward.scaled_dot_product_attention")
    before = dict(op.kwargs)
    op.kwargs = {**before, "is_causal": False, "attn_mask": None}
    try:
        yield
    finally:
        op.kwargs = before


@contextlib.contextmanager
def extra_rounding(gm: fx.GraphModule, layer: int) -> Iterator[None]:
    """One bf16 rounding too many: the RMSNorm's float32 inverse root rounded to the model's dtype and back."""
    node = _node(gm, f"model.layers.{layer}.input_layernorm.rsqrt")
    dtype = next(p.dtype for p in gm.parameters() if p.is_floating_point())
    with gm.graph.inserting_after(node):
        down = gm.graph.call_method("to", (node, dtype))
    with gm.graph.inserting_after(down):
        up = gm.graph.call_method("to", (down, torch.float32))
    users = [u for u in node.users if u is not down]
    _rewire(users, node, up)

    def undo() -> None:
        _rewire(users, up, node)
        gm.graph.erase_node(up)
        gm.graph.erase_node(down)

    with _edited(gm, undo):
        yield


BREAKS: dict[str, Callable[[fx.GraphModule, int], contextlib.AbstractContextManager[None]]] = {
    "dropped residual": dropped_residual,
    "swapped weight": swapped_weight,
    "wrong mask": wrong_mask,
    "one extra rounding": extra_rounding,
}
