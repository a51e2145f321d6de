"""Ops the capture device chose a kernel for, written so that the graph runs on every device.

transformers' mixture-of-experts layers count tokens per expert with ``torch.histc`` as integers on
CUDA and ``meta`` but as floats on CPU, a branch the capture takes once; a graph captured on
``meta`` or a GPU then failed on the CPU. :func:`run` makes such a histogram count in float32 and
casts back: the same counts on every device, except under CUDA's deterministic mode.

See docs/guides/big-models.md ("Under the hood").
"""

from __future__ import annotations

import torch
import torch.fx as fx


def _integer_input(node: fx.Node) -> torch.dtype | None:
    """The integer dtype of ``node``'s first argument as Dynamo recorded it, else None."""
    arg = node.args[0] if node.args else None
    value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
    if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and not value.dtype.is_complex \
            and value.dtype != torch.bool:
        return value.dtype
    return None


def run(gm: fx.GraphModule) -> int:
    """Rewrite every ``histc`` of an integer tensor to count in float32 and return the integer
    dtype (module docstring). Edits ``gm.graph`` in place; the caller recompiles. Returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        is_histc = (node.op == "call_function" and node.target is torch.histc) or \
            (node.op == "call_method" and node.target == "histc")
        dtype = _integer_input(node) if is_histc else None
        if dtype is None:
            continue
        source = node.args[0]
        assert isinstance(source, fx.Node)
        with gm.graph.inserting_before(node):
            as_float = gm.graph.call_method("to", (source, torch.float32))
        as_float.meta = {k: v for k, v in source.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")}
        node.update_arg(0, as_float)
        with gm.graph.inserting_after(node):
            back = gm.graph.call_method("to", (node, dtype))
        back.meta = {k: v for k, v in node.meta.items() if k != "example_value"}
        node.replace_all_uses_with(back)
        back.update_arg(0, node)  # the one use that stays
        if "example_value" in node.meta:
            value = node.meta["example_value"]
            back.meta["example_value"] = value
            node.meta["example_value"] = value.to(torch.float32) if isinstance(value, torch.Tensor) else value
        source_value = source.meta.get("example_value")
        if isinstance(source_value, torch.Tensor):
            as_float.meta["example_value"] = source_value.to(torch.float32)
        count += 1
    return count
