"""A leaf module's tuple output read whole: every element taken out, as the model's own code does.

torchvision's ViT writes ``x, _ = self.self_attention(x, x, x, need_weights=False)``. A tracer
that meets the unpacking (torch.fx on the original) records both ``getitem`` nodes; a prepared graph
keeps only the element that is used, since the second is dead. Brevitas decides how to quantize a
module's output from its users: with one ``getitem`` user it quantizes the output itself, the tuple
(8-bit ViT SQNR drops far below the original's). Taking every element out again, unused ones
included, gives the toolkit the structure the original has. fx keeps a ``getitem`` without users
in the code it generates, so a re-trace sees it.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .shape_prop import known_value


def run(gm: fx.GraphModule) -> int:
    """For each ``call_module`` node whose value is a tuple read only by ``getitem``s, add the
    ``getitem``s of the elements not read. Returns how many were added. Needs ``meta['val']``."""
    added = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # a getitem added below reads a node already handled
    for node in list(order):
        value = known_value(node)
        if node.op != "call_module" or not isinstance(value, tuple) or not node.users:
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in node.users):
            continue
        read = {u.args[1] for u in node.users}
        last = max(node.users, key=order.__getitem__)
        for index in range(len(value)):
            if index in read:
                continue
            with gm.graph.inserting_after(last):
                element = gm.graph.call_function(operator.getitem, (node, index))
            element.meta["val"] = value[index]
            added += 1
    return added
