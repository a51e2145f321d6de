"""The ops that only check the inputs: kept as calls, never made modules to quantize.

A graph can hold checks that compute nothing its outputs use: an assert on a tensor
(``torch._assert_async``, ``torch._check``), and every op whose results feed only such an assert.
fxprep's own capture keeps one (transformers' packed-sequence test, :mod:`fxprep.families.transformers.attention`:
``position_ids[:, :1] - 1``, ``diff``, ``!= 1``, ``any``, ``~``, ``_assert_async``), and models write
others. Made into modules they were listed beside the model's computation as six modules to
quantize (``model.sub -> model.diff -> model.ne -> model.any -> model.invert -> model.assert_async``)
that no quantization configuration should touch; as calls they still run and still raise, and the
report lists them apart (``input checks kept as calls``).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def _asserts() -> set[object]:
    found: set[object] = {torch._assert, torch._assert_async}
    for name in ("_check", "_check_with", "_check_tensor_all", "_check_tensor_all_with", "_check_is_size",
                 "_assert_scalar"):
        fn = getattr(torch, name, None)
        if fn is not None:
            found.add(fn)
    for op, overloads in (("_assert_async", ("default", "msg")), ("_assert_scalar", ("default",)),
                          ("_assert_tensor_metadata", ("default",))):
        packet = getattr(torch.ops.aten, op, None)
        for overload in overloads:
            if packet is not None and hasattr(packet, overload):
                found.add(getattr(packet, overload))
    return found


ASSERTS = _asserts()


def is_assert(node: fx.Node) -> bool:
    """A call that checks a condition and returns nothing the graph computes with."""
    if node.op != "call_function":
        return False
    try:
        return node.target in ASSERTS
    except TypeError:  # an unhashable target
        return False


def check_only(graph: fx.Graph) -> set[fx.Node]:
    """The asserts of ``graph`` and every call whose results are used by those alone."""
    only: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if is_assert(node):
            only.add(node)
        elif node.op in ("call_function", "call_method") and node.users and all(u in only for u in node.users):
            only.add(node)
    return only
