"""fxprep's op modules back to function calls, for toolkits that match functional patterns.

torch's FX graph-mode quantization recognises ``operator.add``, ``torch.cat`` and ``F.relu`` by
pattern and skips unknown module classes. :func:`run` turns each :class:`~fxprep.ops.BoundOp` call
back into the call it stands for, with the same arguments; the user's layers and the ``torch.nn``
layers made from functionals stay modules. It removes modules from the graph it is given, so run it
on a copy (docs/handoff/torch-ao.md shows the flow).

See docs/handoff/torch-ao.md.
"""

from __future__ import annotations

import torch.fx as fx

from .. import ops


def run(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """Replace every call of an ``fxprep.ops`` module by the function or method call it makes, in place.

    Args:
        gm: A prepared module, or a copy of one (its op modules are removed).
        recompile: Regenerate ``gm``'s code after (``False`` when more passes follow).

    Returns:
        ``gm``.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, ops.BoundOp):
            continue
        inputs = tuple(node.args)
        args = ops.fill_template(module.args, inputs)
        kwargs = ops.fill_template(module.kwargs, inputs)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        with gm.graph.inserting_before(node):
            if isinstance(module.fn, ops._MethodCall):
                call = gm.graph.call_method(module.fn.name, args, kwargs)
            else:
                call = gm.graph.call_function(module.fn, args, kwargs)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        parent, _, leaf = str(node.target).rpartition(".")
        delattr(gm.get_submodule(parent), leaf)
    gm.graph.lint()
    if recompile:
        gm.recompile()
    return gm
