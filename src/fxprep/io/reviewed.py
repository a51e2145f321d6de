"""The default allow-list: every callable a saved graph may name without an opt-in, one per line with
the reason it may run on arguments a file chose, and the families no opt-in ever allows.

The list is the smallest that serves: exactly the callables that prepared graphs of fxprep's suites
and zoos name, as measured by ``benchmarks/allowlist_usage.py`` (``tests/test_io_allowlist.py``
checks the two agree), each with its review reason (``python``, ``pointwise``, ``shape``,
``construct``, ``checked``, ``mode``...). Callers widen it with ``allow=``, never to
:data:`EXCLUDED_FUNCTIONS` / :data:`EXCLUDED_METHODS`.

See docs/security.md ("Under the hood") for how it is made, what each reason means, and how to add
an entry.
"""

from __future__ import annotations

import functools


def table(text: str) -> dict[str, str]:
    """``{name: reason}`` of a table: one entry per line, its name, then spaces, then its reason."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            out[name] = reason.strip()
    return out


# --- the list: one per line, the saved name then why it may run on a file's arguments --------------------
# Functions, by saved name (``<namespace>.<name>``, the namespace one of allowlist's fixed table).
FUNCTIONS = table("""
builtins.getattr  python: a tensor attribute by name, only those io/trust.check_getattr allows (never a method or a private name)
builtins.len  python: the length of a value the graph holds; builds nothing
fxprep.cond.cond  control: runs one of two saved branch graphs, each loaded and checked like the main graph
fxprep.decisions.check_decision  control: compares a value with the one decided at capture and raises on a difference; computes nothing
fxprep.io.checked.grouped_mm  checked: torch._grouped_mm behind fxprep's check of its offsets (monotone, within the input) before the kernel runs
math.sqrt  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.abs  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.add  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.and_  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.eq  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.floordiv  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.ge  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.getitem  python: an item of a tuple/list/dict a node made, or Tensor.__getitem__ (indices checked by torch; hostile cases in tests/test_io_hostile.py)
operator.gt  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.iadd  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.imul  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.invert  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.itruediv  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.le  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.lt  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.matmul  matmul: Tensor.__matmul__; sizes checked by torch, multiply-adds counted before it runs (op_flops)
operator.mod  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.mul  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.ne  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.neg  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.not_  python: the truth of a value, negated (a tensor's through bool(), checked by torch); builds nothing
operator.or_  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.pow  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.sub  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
operator.truediv  python: arithmetic on ints/floats (io/pyvalues.py bounds bits, items, time); on tensors the Tensor operator, checked by torch
torch.Size  python: a tuple of ints (a shape built from sizes), bounded by io/pyvalues.py
torch._C._nn.pad  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch._assert  control: raises when its condition is false; computes nothing
torch._assert_async  control: raises when its condition is false; computes nothing
torch.abs  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.add  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.addcmul  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.addmm  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.all  reduction: dims and k checked by torch; output no larger than the input
torch.amax  reduction: dims and k checked by torch; output no larger than the input
torch.amin  reduction: dims and k checked by torch; output no larger than the input
torch.amp.autocast_mode._enter_autocast  mode: balanced regions only (checked at load), left on every path (fxprep.runtime.modes)
torch.amp.autocast_mode._exit_autocast  mode: balanced regions only (checked at load), left on every path (fxprep.runtime.modes)
torch.arange  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.as_tensor  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.baddbmm  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.bincount  reduction: bins/minlength make memory, counted by io/peak.py before it runs; bins checked by torch
torch.bmm  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.broadcast_tensors  shape: views of the inputs at their broadcast shape; shapes checked by torch
torch.cat  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.ceil  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.chunk  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.clamp  pointwise: bounds broadcast against the input (checked by torch)
torch.clip  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.clone  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.concat  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.concatenate  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.cos  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.cumsum  reduction: dims and k checked by torch; output no larger than the input
torch.diff  reduction: dims and k checked by torch; output no larger than the input
torch.div  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.einsum  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.empty  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.empty_like  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.eq  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.erf  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.erfinv  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.exp  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.expm1  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.eye  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.flatten  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.floor  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.floor_divide  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.fmod  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.full  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.full_like  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.fx._symbolic_trace._assert_is_none  control: raises when its condition is false; computes nothing
torch.gather  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.histc  reduction: bins/minlength make memory, counted by io/peak.py before it runs; bins checked by torch
torch.index_select  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.isfinite  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.lerp  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.linalg.vector_norm  reduction: dims and k checked by torch; output no larger than the input
torch.linspace  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.log  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.log1p  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.log2  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.logical_and  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.logical_not  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.logsumexp  reduction: dims and k checked by torch; output no larger than the input
torch.lt  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.masked_fill  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.matmul  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.max  reduction: dims and k checked by torch; output no larger than the input
torch.maximum  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.mean  reduction: dims and k checked by torch; output no larger than the input
torch.meshgrid  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.min  reduction: dims and k checked by torch; output no larger than the input
torch.minimum  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.mm  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.mul  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.multiply  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.neg  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.adaptive_avg_pool1d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.adaptive_avg_pool2d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.adaptive_max_pool1d_with_indices  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.adaptive_max_pool2d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.alpha_dropout  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.avg_pool1d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.avg_pool2d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.batch_norm  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.conv1d  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.nn.functional.conv2d  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.nn.functional.cosine_similarity  reduction: dims and k checked by torch; output no larger than the input
torch.nn.functional.dropout  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.embedding  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.nn.functional.feature_alpha_dropout  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.fold  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.gelu  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.grid_sample  layer: samples at the grid's coordinates (outside ones padded, never read out of bounds); output counted by io/peak.py
torch.nn.functional.group_norm  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.instance_norm  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.interpolate  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.layer_norm  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.linear  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.nn.functional.log_softmax  reduction: dims and k checked by torch; output no larger than the input
torch.nn.functional.lp_pool2d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.max_pool1d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.max_pool2d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.max_pool2d_with_indices  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.max_pool3d  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.normalize  reduction: dims and k checked by torch; output no larger than the input
torch.nn.functional.one_hot  indexing: indices and num_classes checked by torch (an index past num_classes raises); output counted by io/peak.py
torch.nn.functional.pad  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nn.functional.prelu  pointwise: its weight broadcast over channels (checked by torch)
torch.nn.functional.rrelu  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.nn.functional.scaled_dot_product_attention  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
torch.nn.functional.softmax  reduction: dims and k checked by torch; output no larger than the input
torch.nn.functional.unfold  layer: kernel sizes, strides, pads, output sizes checked by torch; output counted by io/peak.py
torch.nonzero  indexing: output sized by the data (counted by io/peak.py on fake tensors first)
torch.norm  reduction: dims and k checked by torch; output no larger than the input
torch.ones  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.ones_like  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.permute  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.polar  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.pow  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.prod  reduction: dims and k checked by torch; output no larger than the input
torch.repeat_interleave  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.reshape  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.rms_norm  layer: normalized_shape and weight checked by torch against the input; output counted by io/peak.py
torch.roll  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.rsqrt  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.rsub  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.scalar_tensor  construct: a 0-d tensor of one value; sizes make memory, counted before it runs (io/budget.py, io/peak.py)
torch.scatter  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.sign  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.sin  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.softmax  reduction: dims and k checked by torch; output no larger than the input
torch.sort  reduction: dims and k checked by torch; output no larger than the input
torch.special.erf  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.special.expm1  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.special.i1  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.split  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.sqrt  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.square  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.stack  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.std  reduction: dims and k checked by torch; output no larger than the input
torch.sub  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.sum  reduction: dims and k checked by torch; output no larger than the input
torch.swapaxes  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.sym_float  python: a symbolic-size helper on plain ints/bools at load (bounded by io/pyvalues.py)
torch.sym_ite  python: a symbolic-size helper on plain ints/bools at load (bounded by io/pyvalues.py)
torch.sym_max  python: a symbolic-size helper on plain ints/bools at load (bounded by io/pyvalues.py)
torch.sym_min  python: a symbolic-size helper on plain ints/bools at load (bounded by io/pyvalues.py)
torch.sym_not  python: a symbolic-size helper on plain ints/bools at load (bounded by io/pyvalues.py)
torch.tanh  pointwise: values in, one value out of the broadcast shape (checked by torch); no size, index or stride taken
torch.tensor  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.tensor_split  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.topk  reduction: dims and k checked by torch; output no larger than the input
torch.transpose  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.tril  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.triu  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.unbind  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.view_as_complex  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.view_as_real  shape: dims, sizes and split points checked by torch against the input; new memory counted by io/peak.py
torch.where  indexing: indices/masks checked against the input by torch's CPU kernel (tests/test_io_hostile.py)
torch.zeros  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
torch.zeros_like  construct: sizes make memory, counted before it runs (io/budget.py for literals, io/peak.py for the rest)
""")

# Tensor methods a ``call_method`` node (or an op's ``Tensor.<name>``) may call, besides operator dunders.
METHODS = table("""
abs  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
add  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
add_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
all  reduction: dims and k checked by torch; output no larger than the input
amax  reduction: dims and k checked by torch; output no larger than the input
amin  reduction: dims and k checked by torch; output no larger than the input
any  reduction: dims and k checked by torch; output no larger than the input
argmax  reduction: dims and k checked by torch; output no larger than the input
baddbmm  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
bool  dtype: the same values in another dtype (or device: only those this process has)
chunk  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
clamp  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
clamp_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
clamp_max  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
clamp_min  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
clone  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
contiguous  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
copy_  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
cos  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
cumsum  reduction: dims and k checked by torch; output no larger than the input
detach  dtype: the same values in another dtype (or device: only those this process has)
dim  python: a number read from a tensor
div  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
div_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
double  dtype: the same values in another dtype (or device: only those this process has)
erfc  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
exp  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
expand  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
expand_as  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
fill_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
flatten  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
flip  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
float  dtype: the same values in another dtype (or device: only those this process has)
floor  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
gather  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
index_add  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
index_select  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
int  dtype: the same values in another dtype (or device: only those this process has)
item  python: a number or a shape read from a tensor
log  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
log2  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
long  dtype: the same values in another dtype (or device: only those this process has)
masked_fill  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
masked_fill_  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
masked_scatter  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
matmul  matmul: sizes checked by torch; multiply-adds counted before it runs (op_flops)
max  reduction: dims and k checked by torch; output no larger than the input
maximum  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
mean  reduction: dims and k checked by torch; output no larger than the input
min  reduction: dims and k checked by torch; output no larger than the input
mul  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
mul_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
ne  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
neg  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
new_empty  construct: sizes make memory, counted before it runs (io/peak.py)
new_full  construct: sizes make memory, counted before it runs (io/peak.py)
new_ones  construct: sizes make memory, counted before it runs (io/peak.py)
new_zeros  construct: sizes make memory, counted before it runs (io/peak.py)
norm  reduction: dims and k checked by torch; output no larger than the input
permute  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
pow  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
prod  reduction: dims and k checked by torch; output no larger than the input
reciprocal  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
repeat  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
repeat_interleave  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
reshape  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
reshape_as  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
round  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
rsqrt  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
scatter  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
scatter_  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
sigmoid_  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
sin  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
size  python: a number or a shape read from a tensor
softmax  reduction: dims and k checked by torch; output no larger than the input
sort  reduction: dims and k checked by torch; output no larger than the input
split  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
sqrt  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
square  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
squeeze  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
sub  pointwise: values in, one value out of the broadcast shape (broadcasting checked by torch)
sum  reduction: dims and k checked by torch; output no larger than the input
t  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
tile  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
to  dtype: the same values in another dtype (or device: only those this process has)
topk  reduction: dims and k checked by torch; output no larger than the input
transpose  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
tril  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
type  dtype: the same values in another dtype (or device: only those this process has)
type_as  dtype: the same values in another dtype (or device: only those this process has)
unbind  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
unflatten  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
unfold  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
unsqueeze  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
var  reduction: dims and k checked by torch; output no larger than the input
view  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
view_as  shape: dims and sizes checked by torch against the input; new memory counted by io/peak.py
where  indexing: indices/masks checked against the tensor by torch's CPU kernel (tests/test_io_hostile.py)
zero_  pointwise: in place, never resizes (a broadcast that would grow self raises in torch)
""")

# torch.ops.aten ops (``op.overload``, or ``op`` for every overload): what Dynamo's graphs keep.
ATEN = table("""
_assert_scalar.default  control: raises when its condition is false; computes nothing
numpy_T  shape: the reversed-dims view of its input (no size or index taken)
""")

# torch.nn / torch.ao.nn / torchvision.ops layer classes (fxprep.ops classes are allowed by rule).
CLASSES = table("""
torch.nn.modules.activation.CELU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.ELU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.GELU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.GLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Hardshrink  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Hardsigmoid  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Hardswish  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Hardtanh  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.LeakyReLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.LogSigmoid  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.LogSoftmax  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Mish  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.MultiheadAttention  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.PReLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.RReLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.ReLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.ReLU6  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.SELU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.SiLU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Sigmoid  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Softmax  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Softmin  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Softplus  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Softshrink  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Softsign  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Tanh  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Tanhshrink  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.activation.Threshold  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.batchnorm.BatchNorm1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.batchnorm.BatchNorm2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.batchnorm.BatchNorm3d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.conv.Conv1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.conv.Conv2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.conv.Conv3d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.conv.ConvTranspose1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.conv.ConvTranspose2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.dropout.AlphaDropout  layer: random mask of its input's shape; identity in eval
torch.nn.modules.dropout.Dropout  layer: random mask of its input's shape; identity in eval
torch.nn.modules.dropout.Dropout1d  layer: random mask of its input's shape; identity in eval
torch.nn.modules.dropout.Dropout2d  layer: random mask of its input's shape; identity in eval
torch.nn.modules.dropout.Dropout3d  layer: random mask of its input's shape; identity in eval
torch.nn.modules.dropout.FeatureAlphaDropout  layer: random mask of its input's shape; identity in eval
torch.nn.modules.flatten.Flatten  layer: a view of its input; dims checked by torch
torch.nn.modules.flatten.Unflatten  layer: a view of its input; dims checked by torch
torch.nn.modules.fold.Unfold  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.instancenorm.InstanceNorm2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.linear.Bilinear  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.linear.Identity  layer: a view of its input; dims checked by torch
torch.nn.modules.linear.Linear  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.linear.NonDynamicallyQuantizableLinear  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.module.Module  container: holds saved children; runs nothing of its own but them
torch.nn.modules.normalization.GroupNorm  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.normalization.LayerNorm  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.normalization.RMSNorm  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.padding.ConstantPad2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.padding.ZeroPad2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pixelshuffle.PixelShuffle  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AdaptiveAvgPool1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AdaptiveAvgPool2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AdaptiveAvgPool3d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AvgPool1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AvgPool2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.AvgPool3d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.MaxPool1d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.MaxPool2d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.pooling.MaxPool3d  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.rnn.GRU  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.rnn.LSTM  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.sparse.Embedding  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.transformer.TransformerEncoderLayer  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torch.nn.modules.upsampling.Upsample  layer: built on meta from saved constructor values; forward runs torch's checked kernels on its weights
torchvision.ops.stochastic_depth.StochasticDepth  layer: random mask of its input's shape; identity in eval
""")


@functools.cache
def listed() -> dict[str, dict[str, str]]:
    """Every entry, by kind: ``functions``, ``methods``, ``aten``, ``classes``."""
    return {"functions": FUNCTIONS, "methods": METHODS, "aten": ATEN, "classes": CLASSES}


# Python's own callables an ``allow=`` may add (the default list holds those graphs use): values in, a
# value out, each bounded by io/pyvalues.py. Any other name of ``builtins``, ``operator`` or ``math`` is
# never allowed, whatever a caller passes: ``builtins`` holds ``eval``, ``exec``, ``open``, ``setattr``
# and ``breakpoint``; ``operator.call`` calls whatever it is given.
OPT_IN_PYTHON = frozenset("""
builtins.abs builtins.all builtins.any builtins.divmod builtins.getattr builtins.isinstance builtins.len
builtins.max builtins.min builtins.pow builtins.round builtins.sum
math.acos math.acosh math.asin math.asinh math.atan math.atan2 math.atanh math.cbrt math.ceil math.copysign
math.cos math.cosh math.degrees math.dist math.erf math.erfc math.exp math.exp2 math.expm1 math.fabs math.floor
math.fmod math.frexp math.fsum math.gamma math.gcd math.hypot math.isclose math.isfinite math.isinf math.isnan
math.isqrt math.lcm math.ldexp math.lgamma math.log math.log10 math.log1p math.log2 math.modf math.nextafter
math.pow math.prod math.radians math.remainder math.sin math.sinh math.sqrt math.tan math.tanh math.trunc math.ulp
operator.abs operator.add operator.and_ operator.concat operator.contains operator.countOf operator.eq
operator.floordiv operator.ge operator.getitem operator.gt operator.iadd operator.iand operator.iconcat
operator.ifloordiv operator.ilshift operator.imatmul operator.imod operator.imul operator.index operator.indexOf
operator.inv operator.invert operator.ior operator.ipow operator.irshift operator.is_ operator.is_not operator.isub
operator.itruediv operator.ixor operator.le operator.length_hint operator.lshift operator.lt operator.matmul
operator.mod operator.mul operator.ne operator.neg operator.not_ operator.or_ operator.pos operator.pow
operator.rshift operator.setitem operator.delitem operator.sub operator.truediv operator.truth operator.xor
""".split())
PYTHON_NAMESPACES = ("builtins", "operator", "math")


# Never allowed (raw memory, process state, I/O and code): the test checks none is reachable.
EXCLUDED_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "raw_memory": (
        "torch._C._nn.mkldnn_linear", "torch._C._nn.mkldnn_reorder_conv2d_weight",
        "torch._C._nn.mkldnn_reorder_conv3d_weight", "torch._efficientzerotensor", "torch._from_blob",
        "torch._index_put_impl_", "torch._nested_view_from_buffer", "torch._unsafe_index",
        "torch._unsafe_index_put", "torch._unsafe_masked_index", "torch._unsafe_masked_index_put_accumulate",
        "torch.asarray", "torch.cudnn_affine_grid_generator", "torch.cudnn_batch_norm", "torch.cudnn_convolution",
        "torch.cudnn_convolution_add_relu", "torch.cudnn_convolution_relu", "torch.cudnn_convolution_transpose",
        "torch.cudnn_grid_sampler", "torch.fbgemm_linear_fp16_weight",
        "torch.fbgemm_linear_fp16_weight_fp32_activation", "torch.fbgemm_linear_int8_weight",
        "torch.fbgemm_linear_int8_weight_fp32_activation", "torch.fbgemm_linear_quantize_weight",
        "torch.fbgemm_pack_gemm_matrix_fp16", "torch.fbgemm_pack_quantized_matrix", "torch.from_dlpack",
        "torch.from_file", "torch.from_numpy", "torch.frombuffer", "torch.merge_type_from_type_comment",
        "torch.miopen_batch_norm", "torch.miopen_convolution", "torch.miopen_convolution_add_relu",
        "torch.miopen_convolution_relu", "torch.miopen_convolution_transpose", "torch.miopen_ctc_loss",
        "torch.miopen_depthwise_convolution", "torch.miopen_rnn", "torch.mkldnn_adaptive_avg_pool2d",
        "torch.mkldnn_convolution", "torch.mkldnn_linear_backward_weights", "torch.mkldnn_max_pool2d",
        "torch.mkldnn_max_pool3d", "torch.mkldnn_rnn_layer", "torch.quantized_gru_cell",
        "torch.quantized_lstm_cell", "torch.quantized_rnn_relu_cell", "torch.quantized_rnn_tanh_cell",
        "torch.resize_as_sparse_", "torch.segment_reduce", "torch.slice_inverse", "torch.sparse_bsc_tensor",
        "torch.sparse_bsr_tensor", "torch.sparse_compressed_tensor", "torch.sparse_coo_tensor",
        "torch.sparse_csc_tensor", "torch.sparse_csr_tensor", "torch.unsafe_chunk", "torch.unsafe_split",
        "torch.unsafe_split_with_sizes",
    ),
    "process_state": (
        "torch._C._set_grad_enabled", "torch.autocast_decrement_nesting", "torch.autocast_increment_nesting",
        "torch.clear_autocast_cache", "torch.init_num_threads", "torch.manual_seed", "torch.random.manual_seed",
        "torch.seed", "torch.set_anomaly_enabled", "torch.set_autocast_cache_enabled", "torch.set_autocast_dtype",
        "torch.set_autocast_enabled", "torch.set_default_device", "torch.set_default_dtype",
        "torch.set_default_tensor_type", "torch.set_deterministic_debug_mode", "torch.set_float32_matmul_precision",
        "torch.set_flush_denormal", "torch.set_num_interop_threads", "torch.set_num_threads", "torch.set_rng_state",
        "torch.set_warn_always", "torch.use_deterministic_algorithms",
    ),
    "io_code": (
        "torch.compile", "torch.cond", "torch.fork", "torch.import_ir_module", "torch.import_ir_module_from_buffer",
        "torch.load", "torch.parse_ir", "torch.parse_schema", "torch.parse_type_comment", "torch.save",
        "torch.vmap", "torch.wait",
    ),
}
EXCLUDED_METHODS: dict[str, tuple[str, ...]] = {
    "raw_memory": (
        "as_subclass", "ccol_indices", "coalesce", "col_indices", "const_data_ptr", "crow_indices", "data_ptr",
        "dense_dim", "indices", "is_coalesced", "new", "resize_as_sparse_", "row_indices", "set_", "slice_inverse",
        "smm", "sparse_dim", "sparse_mask", "sparse_resize_", "sparse_resize_and_clear_", "sspaddmm", "storage",
        "storage_type", "to_dense", "to_mkldnn", "to_padded_tensor", "to_sparse", "to_sparse_bsc", "to_sparse_bsr",
        "to_sparse_coo", "to_sparse_csc", "to_sparse_csr", "unsafe_chunk", "unsafe_split",
        "unsafe_split_with_sizes", "untyped_storage",
    ),
    "callbacks_autograd_io": (
        "apply_", "backward", "map2_", "map_", "module_load", "numpy", "record_stream", "register_hook",
        "register_post_accumulate_grad_hook", "reinforce", "retain_grad", "share_memory_",
    ),
}
