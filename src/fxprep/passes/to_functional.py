"""fxprep's op modules back to function calls, for toolkits that match functional patterns.

Most toolkits attach quantizers to modules, which is why fxprep turns ``x + y`` into an
:class:`fxprep.ops.Add` module. torch's own FX graph-mode quantization (``prepare_fx``) works the
other way round: it knows ``operator.add``, ``torch.cat``, ``F.relu`` and the ``torch.nn`` layers by
pattern, and leaves a module class it does not know alone, so on a prepared graph it would skip
every add. This pass gives such a toolkit what it expects: each :class:`~fxprep.ops.BoundOp` call
becomes the very call it stands for (``operator.add(x, y)``, ``x.softmax(-1, dtype=...)``), with the
same arguments; everything else stays as prepared: the user's layers, and the ``torch.nn`` layers
fxprep made from functionals on module parameters (``F.linear(x, self.w)`` → ``nn.Linear``), which
such toolkits handle better as modules. Reused modules stay unrolled.

Run it on a copy (``copy.deepcopy(gm)``): the BoundOp modules are removed from the module it is
given. :func:`fxprep.compat.torch_ao.prepare_fx` does both.
"""

from __future__ import annotations

import torch.fx as fx

from .. import ops


def run(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """Replace every call of an ``fxprep.ops`` module by the function or method call it makes."""
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
