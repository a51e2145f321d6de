"""Hand-off to Sony's Model Compression Toolkit: :func:`prepare`, then MCT's own PTQ.

MCT traces the model with ``torch.fx``; its trace of a transformers model fails, that of a
:func:`fxprep.compat.retrace.retraceable` graph works. :func:`prepare` makes that graph and works
around MCT's limits (float calibration inputs, ``Tensor.to`` and dtype methods, boolean or causal
attention masks, ``MultiheadAttention`` self-attention, tensor indices, sorts);
:func:`post_training_quantization` runs MCT's PTQ and replaces the quantizers MCT puts on integer
tensors with identities. Other MCT entry points use :func:`prepare` and
:func:`integer_input_quantizers`.

See docs/handoff/mct.md ("Under the hood") for each fix.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..core.inputs import normalize_example_inputs
from ..passes import fold_constants, shape_prop
from .contract import Adapter
from .retrace import HOLDER, INTEGER_INPUTS, integer_valued, retraceable

__all__ = ["ADAPTER", "prepare", "post_training_quantization", "integer_input_quantizers"]

ADAPTER = Adapter(toolkit="Sony MCT", module="model_compression_toolkit", requires="model-compression-toolkit>=2.6",
                  entry_points=("prepare", "post_training_quantization", "integer_input_quantizers"),
                  page="handoff/mct.md")


def prepare(gm: fx.GraphModule, example_inputs: Any) -> fx.GraphModule:
    """The graph to hand to MCT's ``pytorch_post_training_quantization``, MCT's limits worked around.

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        example_inputs: The inputs the graph is made for (one size), as for ``prepare_model``.

    Returns:
        A new ``GraphModule`` sharing ``gm``'s modules and tensors.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or ``example_inputs`` are missing.
    """
    ready = retraceable(gm, example_inputs, specialize=True)
    names = _integer_inputs_cast_back(ready)
    _dtype_methods_as_copies(ready)
    _float_attention_masks(ready)
    _causal_attention_as_masks(ready)
    _self_attention_as_functions(ready)
    _constant_indexing_folded(ready)
    _sorts_as_argsort(ready)
    _inverse_permutations_as_argsort(ready)
    ready.graph.lint()
    ready.recompile()
    setattr(ready, INTEGER_INPUTS, tuple(names))
    return ready


def post_training_quantization(gm: fx.GraphModule, example_inputs: Any, representative_data_gen: Any,
                               **mct_options: Any) -> tuple[torch.nn.Module, Any]:
    """``mct.ptq.pytorch_post_training_quantization`` on :func:`prepare`, no activation quantizer on integer values.

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        example_inputs: The inputs the graph is made for (one size), as for ``prepare_model``.
        representative_data_gen: MCT's calibration data generator.
        **mct_options: MCT's options (``target_platform_capabilities``, ``core_config``, ...).

    Returns:
        MCT's ``(quantized model, user info)``.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, or ``example_inputs`` are missing.
    """
    import model_compression_toolkit as mct

    ready = prepare(gm, example_inputs)
    quantized, info = mct.ptq.pytorch_post_training_quantization(ready, representative_data_gen, **mct_options)
    for name in integer_input_quantizers(ready, quantized):
        setattr(quantized, name, torch.nn.Identity())
    for name in _integer_fed_quantizers(gm, quantized, example_inputs):
        setattr(quantized, name, torch.nn.Identity())
    return quantized, info


class _Record(torch.nn.Module):
    def __init__(self, name: str, seen: list[str]):
        super().__init__()
        self.name, self.seen = name, seen

    def forward(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
            self.seen.append(self.name)
        return x


def _integer_fed_quantizers(gm: fx.GraphModule, quantized: torch.nn.Module, example_inputs: Any) -> list[str]:
    """The names of MCT's activation quantizers that get an integer tensor on the example (Mixtral's
    routing permutations, from ops MCT's graph keeps no dtype for): found by running MCT's model once
    with every quantizer replaced by a recorder, as MCT's fake-quantizer raises on int64."""
    example = normalize_example_inputs(example_inputs)
    if example is None:
        return []
    flat = shape_prop.flat_inputs(gm, tuple(example.args), dict(example.kwargs))
    holders = {name: m for name, m in quantized.named_children() if name.endswith("_activation_holder_quantizer")}
    seen: list[str] = []
    try:
        for name in holders:
            setattr(quantized, name, _Record(name, seen))
        with torch.no_grad():
            quantized(*flat)
    finally:
        for name, holder in holders.items():
            setattr(quantized, name, holder)
    return [name for name in dict.fromkeys(seen) if not isinstance(holders[name], torch.nn.Identity)]


def integer_input_quantizers(ready: fx.GraphModule, quantized: torch.nn.Module) -> list[str]:
    """The names, in MCT's quantized model, of the activation quantizers on integer values of :func:`prepare`'s graph.

    Integer inputs, their casts back, and every node whose recorded output is an integer or boolean
    tensor (positions, routing indices): not activations, and MCT's fake-quantizer refuses them.

    Args:
        ready: What :func:`prepare` returned.
        quantized: MCT's quantized model of ``ready``.

    Returns:
        The quantizers' attribute names, to replace by ``nn.Identity``.
    """
    integer = [n.name for n in ready.graph.nodes if integer_valued(n)]
    names = []
    for node_name in dict.fromkeys([*getattr(ready, INTEGER_INPUTS, ()), *integer]):
        holder = f"{node_name}_activation_holder_quantizer"
        if isinstance(getattr(quantized, holder, None), torch.nn.Module):
            names.append(holder)
    return names


def _integer_inputs_cast_back(gm: fx.GraphModule) -> list[str]:
    """Each integer input cast back to its dtype first; the names of the inputs and of the casts."""
    names = []
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor) or value.is_floating_point():
            continue
        with gm.graph.inserting_after(node):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": value.dtype})
        cast.meta["val"] = value
        node.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)
        names += [node.name, cast.name]
    return names


_DTYPE_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
                  "long": torch.int64, "int": torch.int32, "short": torch.int16, "bool": torch.bool}


def _dtype_methods_as_copies(gm: fx.GraphModule) -> None:
    """``x.float()`` → ``aten._to_copy(x, dtype=float32)``: MCT reads a method by its name on torch,
    and ``torch.float`` is a dtype (MoE routing counts experts with ``ids.float()``)."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _DTYPE_METHODS and len(node.args) == 1 and not node.kwargs:
            dtype = _DTYPE_METHODS[str(node.target)]
            node.op, node.target, node.kwargs = "call_function", torch.ops.aten._to_copy.default, {"dtype": dtype}


def _reads_as_attention_mask(gm: fx.GraphModule, node: fx.Node) -> bool:
    for user in node.users:
        if user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), ops.ScaledDotProductAttention):
            continue
        if user.op == "call_function" and user.target is F.scaled_dot_product_attention:
            continue
        return False
    return bool(node.users)


def _float_attention_masks(gm: fx.GraphModule) -> None:
    if not hasattr(gm, HOLDER):
        return
    constants = gm.get_submodule(HOLDER)
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not str(node.target).startswith(f"{HOLDER}."):
            continue
        field = str(node.target).split(".", 1)[1]
        mask = getattr(constants, field)
        if mask.dtype != torch.bool or not _reads_as_attention_mask(gm, node):
            continue
        dtype = _query_dtype(node)
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        constants.register_buffer(f"{field}_additive", additive, persistent=False)
        node.target = f"{HOLDER}.{field}_additive"
        delattr(constants, field)  # each folded constant has one get_attr node: this one
        node.meta["val"] = additive


def _query_dtype(mask_node: fx.Node) -> torch.dtype:
    """The dtype of the query the mask is applied to (the attention's first input)."""
    user = next(iter(mask_node.users))
    query = user.args[0] if user.args else None
    value = query.meta.get("val") if isinstance(query, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) and value.is_floating_point() else torch.float32


def _causal_mask(gm: fx.GraphModule, node: fx.Node, q_val: torch.Tensor, k_val: torch.Tensor) -> fx.Node:
    """A read of a new buffer holding SDPA's causal mask as an additive float mask: the lower
    triangle aligned top-left (query i attends keys <= i), the dtype's lowest value elsewhere."""
    length, source = int(q_val.shape[-2]), int(k_val.shape[-2])
    allowed = torch.ones(length, source, dtype=torch.bool).tril()
    dtype = q_val.dtype if q_val.is_floating_point() else torch.float32
    additive = torch.zeros(length, source, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    if not hasattr(gm, HOLDER):
        gm.add_module(HOLDER, torch.nn.Module())
    field = f"{node.name}_causal_mask"
    gm.get_submodule(HOLDER).register_buffer(field, additive.to(q_val.device), persistent=False)
    mask = gm.graph.get_attr(f"{HOLDER}.{field}")
    mask.meta["val"] = additive
    return mask


def _causal_attention_as_masks(gm: fx.GraphModule) -> None:
    """Each ``scaled_dot_product_attention`` written the way MCT's attention substitution reads it:
    ``is_causal=True`` (static sizes) as ``attn_mask=<additive causal mask>``, since MCT refuses
    the flag; ``enable_gqa=True`` with fewer key/value heads as keys and values with their heads
    repeated (``repeat_interleave`` on the head dimension, what SDPA does), since MCT ignores it."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), ops.ScaledDotProductAttention):
            module = gm.get_submodule(str(node.target))
            args = ops.fill_template(module.args, tuple(node.args))
            kwargs = dict(ops.fill_template(module.kwargs, tuple(node.args)))
        elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            args, kwargs = tuple(node.args), dict(node.kwargs)
        else:
            continue
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = {**dict(zip(names, args)), **kwargs}
        query, key = bound.get("query"), bound.get("key")
        q_val = query.meta.get("val") if isinstance(query, fx.Node) else None
        k_val = key.meta.get("val") if isinstance(key, fx.Node) else None
        if not isinstance(q_val, torch.Tensor) or not isinstance(k_val, torch.Tensor):
            continue
        causal = bool(bound.get("is_causal")) and bound.get("attn_mask") is None
        repeat = q_val.shape[-3] // k_val.shape[-3] if q_val.dim() >= 3 and k_val.dim() >= 3 else 1
        grouped = bool(bound.get("enable_gqa")) and repeat > 1
        if not (causal or grouped):
            continue
        with gm.graph.inserting_before(node):
            if causal:
                bound.update(attn_mask=_causal_mask(gm, node, q_val, k_val), is_causal=False)
            if grouped:  # MCT's attention substitution ignores enable_gqa: the heads repeated as SDPA does
                for name in ("key", "value"):
                    bound[name] = gm.graph.call_function(torch.repeat_interleave, (bound[name], repeat), {"dim": -3})
                bound["enable_gqa"] = False
            call = gm.graph.call_function(F.scaled_dot_product_attention, (), bound)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)



def _self_attention_as_functions(gm: fx.GraphModule) -> None:
    """Each ``nn.MultiheadAttention`` self-attention call (query, key and value one node, batch
    first, no masks, no extra key/value bias, weights not read) written as the module's computation:
    ``F.linear`` with ``in_proj_weight``, heads split, ``scaled_dot_product_attention``, heads merged,
    ``F.linear`` with ``out_proj``'s weight. MCT cannot read the call itself (module docstring);
    it reads these ops (two linear layers it quantizes, an attention it decomposes). The parameters
    are read in place (``get_attr``), not copied."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), nn.MultiheadAttention):
            continue
        mha = gm.get_submodule(str(node.target))
        try:
            bound = inspect.signature(mha.forward).bind(*node.args, **node.kwargs).arguments
        except TypeError:
            continue
        query = bound.get("query")
        value = query.meta.get("val") if isinstance(query, fx.Node) else None
        getitems = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        if (bound.get("key") is not query or bound.get("value") is not query or not isinstance(value, torch.Tensor)
                or value.dim() != 3 or not mha.batch_first or not mha._qkv_same_embed_dim or mha.bias_k is not None
                or mha.add_zero_attn or mha.training or len(getitems) != len(node.users)
                or any(bound.get(k) is not None for k in ("key_padding_mask", "attn_mask")) or bound.get("is_causal")
                or any(u.args[1] != 0 and u.users for u in getitems)):
            continue
        batch, length, embed = value.shape
        heads = mha.num_heads
        graph, path = gm.graph, str(node.target)
        with graph.inserting_before(node):
            weight, bias = _read(gm, f"{path}.in_proj_weight"), _read(gm, f"{path}.in_proj_bias")
            qkv = graph.call_function(F.linear, (query, weight, bias))
            qkv = graph.call_function(torch.reshape, (qkv, (batch, length, 3, heads, embed // heads)))
            qkv = graph.call_function(torch.permute, (qkv, (2, 0, 3, 1, 4)))
            q, k, v = (graph.call_function(operator.getitem, (qkv, i)) for i in range(3))
            out = graph.call_function(F.scaled_dot_product_attention, (q, k, v))
            out = graph.call_function(torch.transpose, (out, 1, 2))
            out = graph.call_function(torch.reshape, (out, (batch, length, embed)))
            weight, bias = _read(gm, f"{path}.out_proj.weight"), _read(gm, f"{path}.out_proj.bias")
            out = graph.call_function(F.linear, (out, weight, bias))
        for user in getitems:
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(node)


def _read(gm: fx.GraphModule, target: str) -> fx.Node | None:
    """A ``get_attr`` read of ``target``, or None where the module holds None there (no bias)."""
    owner, _, field = target.rpartition(".")
    return gm.graph.get_attr(target) if getattr(gm.get_submodule(owner), field) is not None else None


def _constant_indexing_folded(gm: fx.GraphModule) -> None:
    """Each ``tensor[..., index]`` whose tensor and tensor index are both weight or buffer reads
    (``get_attr``), read instead as a constant holding its value (:func:`fxprep.passes.fold_constants.run`):
    MCT's model builder would pass the index's fx Node itself to ``getitem`` (module docstring)."""
    values: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
            continue
        index = node.args[1]
        inner = index if isinstance(index, (tuple, list)) else (index,)
        inputs = node.all_input_nodes
        if not any(isinstance(i, fx.Node) for i in inner) or not all(i.op == "get_attr" for i in inputs):
            continue
        env = {i: gm.get_submodule(str(i.target).rpartition(".")[0]) for i in inputs}
        env = {i: getattr(owner, str(i.target).rpartition(".")[2]) for i, owner in env.items()}
        with torch.no_grad():
            values[node] = operator.getitem(*fx.node.map_arg(node.args, env.__getitem__)).clone()
    fold_constants.run(gm, values, holder=HOLDER)


def _sort_call(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, ...] | None:
    """``(input, dim, descending, stable)`` of a ``torch.sort`` call (function, method or op module)."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), ops.BoundOp):
        module = gm.get_submodule(str(node.target))
        if module.fn is not torch.sort:
            return None
        args = ops.fill_template(module.args, tuple(node.args))
        kwargs = dict(ops.fill_template(module.kwargs, tuple(node.args)))
    elif (node.op == "call_function" and node.target is torch.sort) or (node.op == "call_method" and node.target == "sort"):
        args, kwargs = tuple(node.args), dict(node.kwargs)
    else:
        return None
    bound = {**dict(zip(("input", "dim", "descending"), args)), **kwargs}
    return bound["input"], bound.get("dim", -1), bool(bound.get("descending", False)), bool(bound.get("stable", False))


def _sorts_as_argsort(gm: fx.GraphModule) -> None:
    """``values, indices = torch.sort(x)`` written as ``indices = torch.argsort(x)``, ``values =
    torch.gather(x, dim, indices)`` (the same kernel, the same order): MCT's statistics collection
    fails on an op with two outputs (``'tuple' object has no attribute 'astype'``). Mixtral's experts
    sort their token-to-expert assignment."""
    for node in list(gm.graph.nodes):
        call = _sort_call(gm, node)
        if call is None or not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        x, dim, descending, stable = call
        with gm.graph.inserting_before(node):
            indices = gm.graph.call_function(torch.argsort, (x,), {"dim": dim, "descending": descending, "stable": stable})
            values = gm.graph.call_function(torch.gather, (x, dim, indices))
        for user in list(node.users):
            user.replace_all_uses_with(values if user.args[1] == 0 else indices)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)


def _inverse_permutations_as_argsort(gm: fx.GraphModule) -> None:
    """``inv = torch.empty_like(perm); inv[perm] = arange(n)`` written as ``inv = torch.argsort(perm)``
    (the inverse of a permutation): MCT rebuilds its model without in-place writes (a node nothing
    reads), so ``inv`` would stay uninitialised memory. Mixtral's experts un-sort their outputs so."""
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target != "__setitem__" or len(node.args) != 3:
            continue
        inverse, perm, values = node.args
        if not (isinstance(inverse, fx.Node) and inverse.op == "call_function" and inverse.target is torch.empty_like
                and inverse.args[:1] == (perm,) and isinstance(values, fx.Node) and values.op == "get_attr"):
            continue
        owner, _, field = str(values.target).rpartition(".")
        constant = getattr(gm.get_submodule(owner), field)
        if not (isinstance(constant, torch.Tensor) and constant.dim() == 1
                and torch.equal(constant.cpu(), torch.arange(constant.numel(), dtype=constant.dtype))):
            continue
        with gm.graph.inserting_after(node):
            argsort = gm.graph.call_function(torch.argsort, (perm,))
        inverse.replace_all_uses_with(argsort, delete_user_cb=lambda user, setitem=node: user is not setitem)
        gm.graph.erase_node(node)
        gm.graph.erase_node(inverse)
        if not values.users:
            gm.graph.erase_node(values)
