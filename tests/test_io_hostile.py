"""Each kept callable reviewed for hostile arguments (issue 63): a kernel on the default list that
takes a size, an index, an offset or a stride runs, in a child process, on values a file could
choose - indices out of range and negative, sizes past the input, negative or zero strides, pads and
kernels, an ``output_size`` that lies - and must raise a Python exception, never crash the process
(SIGSEGV, a glibc heap abort) and never return memory it was not given. A quantization kernel on
the old list wrote past its output through a size it was given: the loading process died during the
self-check. Such kernels are not on the list now (no prepared graph uses them): a save naming them is
refused at load.

:data:`CASES` holds the hostile calls by listed name; :func:`test_every_listed_kernel_taking_sizes_has_hostile_cases`
makes a new list entry of those kinds come with its cases (the review is a test, not a promise)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from fxprep import io
from fxprep.errors import SerializationError
from fxprep.io import reviewed

# name (a listed function, or "Tensor.<method>") -> hostile calls; ``x`` is a 4x6 float tensor, ``img``
# a 1x2x8x8 image, ``ids`` a 2x3 int64 tensor, ``big`` 2**62: each call must raise or return normally
# (a clamped shift, an empty pad: what torch's own checks make of the values); none may crash
CASES: dict[str, list[str]] = {
    "torch.nn.functional.fold": ["F.fold(x.reshape(1, 4, 6), output_size=(2, 2), kernel_size=9)",
                                 "F.fold(x.reshape(1, 4, 6), output_size=(big, big), kernel_size=1)",
                                 "F.fold(x.reshape(1, 4, 6), output_size=(4, 4), kernel_size=2, stride=-1)",
                                 "F.fold(x.reshape(1, 4, 6), output_size=(3, 4), kernel_size=2, padding=-3)"],
    "torch.nn.functional.one_hot": ["F.one_hot(torch.tensor([5]), num_classes=3)",
                                    "F.one_hot(torch.tensor([-1]), num_classes=3)", "F.one_hot(ids, num_classes=-5)"],
    "torch.rms_norm": ["torch.rms_norm(x, (7,))", "torch.rms_norm(x, (4, 6, 2))",
                       "torch.rms_norm(x, (6,), weight=torch.ones(3))"],
    "torch.unbind": ["torch.unbind(x, 5)", "torch.unbind(x, -9)"],
    "Tensor.baddbmm": ["x.reshape(1, 4, 6).baddbmm(x.reshape(1, 4, 6), x.reshape(1, 4, 6))",
                       "x.reshape(1, 4, 6).baddbmm(torch.randn(2, 4, 3), torch.randn(2, 3, 6))"],
    "Tensor.tile": ["x.tile((-1, 1))", "x.tile((big, big))"],
    "Tensor.unfold": ["x.unfold(1, 9, 1)", "x.unfold(1, 2, 0)", "x.unfold(1, 2, -1)", "x.unfold(5, 2, 1)",
                      "x.unfold(1, big, 1)"],
    "torch.gather": ["torch.gather(x, 1, torch.tensor([[7]]))", "torch.gather(x, 1, torch.tensor([[-9]]))",
                     "torch.gather(x, 5, torch.tensor([[0]]))", "torch.gather(x, 1, torch.full((9, 9), big))"],
    "torch.nn.functional.embedding": ["F.embedding(torch.tensor([6]), x)", "F.embedding(torch.tensor([-7]), x)",
                                      "F.embedding(torch.tensor([big]), x)", "F.embedding(ids, x, padding_idx=99)"],
    "torch.where": ["torch.where(torch.ones(99, dtype=torch.bool), x, x)", "torch.where(x > 0)"],
    "torch.histc": ["torch.histc(x, bins=-5)", "torch.histc(x, bins=0)", "torch.histc(x, bins=3, min=5, max=1)"],
    "torch.repeat_interleave": ["torch.repeat_interleave(torch.tensor([2, 3]), output_size=1)",
                                "torch.repeat_interleave(torch.tensor([-2, 3]))",
                                "torch.repeat_interleave(x, torch.tensor([9]), dim=0, output_size=2)",
                                "torch.repeat_interleave(x, torch.tensor([1, 1, 1, 1]), dim=0, output_size=1)",
                                "torch.repeat_interleave(x, 2, dim=7)"],
    "Tensor.repeat_interleave": ["x.repeat_interleave(torch.tensor([5, 0, 0, 0]), dim=0, output_size=2)",
                                 "x.repeat_interleave(-3, dim=0)"],
    "torch.roll": ["torch.roll(x, big, 1)", "torch.roll(x, -big, 0)", "torch.roll(x, 1, 9)",
                   "torch.roll(x, (1, 2), (0,))"],
    "torch.split": ["torch.split(x, 0)", "torch.split(x, -2)", "torch.split(x, [1, 1], dim=0)",
                    "torch.split(x, [5, -1], dim=0)", "torch.split(x, 2, dim=4)"],
    "Tensor.split": ["x.split([9, -5], dim=0)", "x.split(-1)"],
    "torch.tensor_split": ["torch.tensor_split(x, [big, -big], dim=1)", "torch.tensor_split(x, 0)",
                           "torch.tensor_split(x, -3)", "torch.tensor_split(x, torch.tensor([9, 2]), dim=1)"],
    "Tensor.chunk": ["x.chunk(0)", "x.chunk(-4)", "x.chunk(2, dim=8)"],
    "torch.topk": ["torch.topk(x, 9)", "torch.topk(x, -1)", "torch.topk(x, 2, dim=5)"],
    "Tensor.topk": ["x.topk(99)"],
    "torch.sort": ["torch.sort(x, dim=9)"],
    "torch.cat": ["torch.cat([x, img], dim=0)", "torch.cat([x, x], dim=9)"],
    "torch.stack": ["torch.stack([x, x[:2]])", "torch.stack([x, x], dim=-9)"],
    "torch.flatten": ["torch.flatten(x, 3, 1)", "torch.flatten(x, 0, 9)"],
    "Tensor.flatten": ["x.flatten(5)"],
    "torch.permute": ["torch.permute(x, (0, 0))", "torch.permute(x, (0, 5))"],
    "Tensor.permute": ["x.permute(1, 1)", "x.permute(2, 0)"],
    "torch.transpose": ["torch.transpose(x, 0, 7)"],
    "Tensor.transpose": ["x.transpose(-5, 0)"],
    "Tensor.t": ["img.t()"],
    "Tensor.view": ["x.view(5, 5)", "x.view(-1, -1)", "x.view(big, 0)", "x[:, ::2].view(-1)"],
    "Tensor.reshape": ["x.reshape(5, 5)", "x.reshape(-1, -1)", "x.reshape(big, big)"],
    "Tensor.reshape_as": ["x.reshape_as(img)"],
    "Tensor.unflatten": ["x.unflatten(1, (4, 4))", "x.unflatten(1, (-1, -1))", "x.unflatten(9, (2, 3))"],
    "Tensor.expand": ["x.expand(3, 3)", "x.expand(-2, 6)", "x[:1].expand(big, 6)"],
    "Tensor.squeeze": ["x.squeeze(9)"],
    "Tensor.unsqueeze": ["x.unsqueeze(9)", "x.unsqueeze(-9)"],
    "Tensor.repeat": ["x.repeat(-1, 1)", "x.repeat(1)", "x.repeat(big, big)"],
    "Tensor.tril": ["x.tril(big)", "x.tril(-big)", "torch.ones(3).tril()"],
    "torch.tril": ["torch.tril(x, -big)", "torch.tril(torch.ones(3))"],
    "Tensor.masked_fill": ["x.masked_fill(torch.ones(9, dtype=torch.bool), 1.0)",
                           "x.masked_fill(torch.ones(4, 6), 1.0)"],
    "Tensor.masked_scatter": ["x.masked_scatter(torch.ones(4, 6, dtype=torch.bool), torch.ones(2))",
                              "x.masked_scatter(torch.ones(9, 9, dtype=torch.bool), torch.ones(99))"],
    "Tensor.where": ["x.where(torch.ones(7, dtype=torch.bool), x)"],
    "Tensor.__setitem__": ["x.__setitem__((slice(None), torch.tensor([99])), 1.0)",
                           "x.__setitem__(torch.tensor([-9]), 1.0)", "x.__setitem__(big, 1.0)"],
    "Tensor.__getitem__": ["x[torch.tensor([99])]", "x[:, -big]", "x[big]", "x[torch.ones(9, dtype=torch.bool)]"],
    "torch.arange": ["torch.arange(0, big, 1e-300)", "torch.arange(5, 0, 1)", "torch.arange(0, 5, 0)",
                     "torch.arange(float('nan'))"],
    "torch.full": ["torch.full((-1, 2), 1.0)", "torch.full((big, big), 1.0)"],
    "torch.zeros": ["torch.zeros(-1)", "torch.zeros(big, big)"],
    "torch.ones": ["torch.ones(-5)", "torch.ones(big, 4)"],
    "torch.empty_like": ["torch.empty_like(x, memory_format=torch.channels_last)"],
    "torch.full_like": ["torch.full_like(x, 1.0, memory_format=torch.channels_last)"],
    "torch.zeros_like": ["torch.zeros_like(x, memory_format=torch.channels_last_3d)"],
    "torch.ones_like": ["torch.ones_like(img, memory_format=torch.channels_last_3d)"],
    "Tensor.new_ones": ["x.new_ones(-1)", "x.new_ones(big, big)"],
    "Tensor.new_zeros": ["x.new_zeros((-3, 2))", "x.new_zeros(big, big)"],
    "Tensor.new_empty": ["x.new_empty(-3)", "x.new_empty((big, big))"],
    "Tensor.zero_": ["x[:, ::2].zero_()", "x.expand(3, 4, 6).zero_()"],
    "Tensor.copy_": ["x.copy_(img)", "x.expand(2, 4, 6).copy_(torch.ones(2, 4, 6))", "x[:1].copy_(x)"],
    "torch.tensor": ["torch.tensor([[1, 2], [3]])", "torch.tensor(big * 4)"],
    "torch.as_tensor": ["torch.as_tensor([[1, 2], [3]])", "torch.as_tensor(x, device='meta')"],
    "torch.meshgrid": ["torch.meshgrid(x, x, indexing='ij')", "torch.meshgrid(torch.ones(3), indexing='xy')"],
    "torch.nn.functional.interpolate": ["F.interpolate(img, size=(-1, 4))", "F.interpolate(img, scale_factor=-2.0)",
                                        "F.interpolate(img, size=(0, 0))", "F.interpolate(x, size=4)",
                                        "F.interpolate(img, scale_factor=1e-30)"],
    "torch.nn.functional.max_pool2d": ["F.max_pool2d(img, 3, stride=0)", "F.max_pool2d(img, 3, padding=5)",
                                       "F.max_pool2d(img, 0)", "F.max_pool2d(img, 3, dilation=0)",
                                       "F.max_pool2d(img, 3, dilation=99)", "F.max_pool2d(img, -3)"],
    "torch.nn.functional.adaptive_avg_pool2d": ["F.adaptive_avg_pool2d(img, (-1, 2))", "F.adaptive_avg_pool2d(img, 0)",
                                                "F.adaptive_avg_pool2d(x, 2)"],
    "torch._C._nn.pad": ["torch._C._nn.pad(img, (-9, -9))", "torch._C._nn.pad(img, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1))",
                         "torch._C._nn.pad(img, (big, big))", "torch._C._nn.pad(img, (5, 5), mode='reflect')",
                         "torch._C._nn.pad(img, (-4, -4, -4, -4))"],
    "torch.nn.functional.pad": ["F.pad(img, (-9, -9))", "F.pad(img, (9, 9), mode='reflect')",
                                "F.pad(img, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1))"],
    "torch.nn.functional.conv2d": ["F.conv2d(img, torch.ones(2, 2, 3, 3), stride=0)",
                                   "F.conv2d(img, torch.ones(2, 2, 3, 3), padding=-1)",
                                   "F.conv2d(img, torch.ones(2, 2, 3, 3), dilation=0)",
                                   "F.conv2d(img, torch.ones(2, 1, 3, 3), groups=0)",
                                   "F.conv2d(img, torch.ones(2, 2, 99, 99))", "F.conv2d(img, torch.ones(3, 5, 3, 3))"],
    "torch.nn.functional.conv1d": ["F.conv1d(x[None], torch.ones(2, 4, 3), stride=0)",
                                   "F.conv1d(x[None], torch.ones(2, 4, 9))", "F.conv1d(x[None], torch.ones(2, 4, 3), padding=-2)"],
    "torch.nn.functional.layer_norm": ["F.layer_norm(x, (5,))", "F.layer_norm(x, (6,), torch.ones(2))"],
    "torch.nn.functional.linear": ["F.linear(x, torch.ones(3, 5))", "F.linear(x, torch.ones(3, 6), torch.ones(9))"],
    "torch.nn.functional.normalize": ["F.normalize(x, dim=9)", "F.normalize(x, p=-1.0)"],
    "torch.nn.functional.softmax": ["F.softmax(x, dim=5)"],
    "torch.softmax": ["torch.softmax(x, 9)"],
    "Tensor.softmax": ["x.softmax(-9)"],
    "torch.nn.functional.scaled_dot_product_attention": [
        "F.scaled_dot_product_attention(img, img, torch.ones(1, 2, 3, 8))",
        "F.scaled_dot_product_attention(img, img, img, attn_mask=torch.ones(9, 9, dtype=torch.bool))",
        "F.scaled_dot_product_attention(img, img[:, :, :, :3], img)",
        "F.scaled_dot_product_attention(img, img, img, enable_gqa=True, scale=-1.0)"],
    "torch.cumsum": ["torch.cumsum(x, 9)"], "Tensor.cumsum": ["x.cumsum(-9)"],
    "torch.diff": ["torch.diff(x, n=-1)", "torch.diff(x, dim=9)", "torch.diff(x, n=big)"],
    "Tensor.amax": ["x.amax(9)"], "torch.min": ["torch.min(x, 9)"], "torch.sum": ["torch.sum(x, 9)"],
    "Tensor.sum": ["x.sum((0, 0))"], "Tensor.mean": ["x.mean(7)"], "Tensor.prod": ["x.prod(7)"],
    "Tensor.argmax": ["x.argmax(9)"], "Tensor.any": ["x.any(9)"], "torch.all": ["torch.all(x, 9)"],
    "torch.einsum": ["torch.einsum('ij,jk->ik', x, x)", "torch.einsum('i...,->', x)", "torch.einsum('ii->i', x)"],
    "torch.matmul": ["torch.matmul(x, x)"], "Tensor.matmul": ["x.matmul(img)"],
    "torch.bmm": ["torch.bmm(img[0], img[0, :, :3])"], "torch.baddbmm": ["torch.baddbmm(img[0], img[0], img[0, :3])"],
    "torch.view_as_complex": ["torch.view_as_complex(x)", "torch.view_as_complex(x[:, :2].t())"],
    "torch.view_as_real": ["torch.view_as_real(x)"],
    "torch.polar": ["torch.polar(x, x[:2])"],
    "torch.abs": [], "torch.clamp": ["torch.clamp(x, min=torch.ones(9))"],
    "Tensor.clone": ["x.clone(memory_format=torch.channels_last)"],
    "Tensor.contiguous": ["x.contiguous(memory_format=torch.channels_last)"],
    "Tensor.to": ["x.to('cuda:9')", "x.to(torch.quint8)", "x.to('meta')"],
    "Tensor.type": ["x.type('torch.NoSuchTensor')"],
    "Tensor.item": ["x.item()"], "Tensor.int": [], "Tensor.float": [], "Tensor.type_as": [],
    "Tensor.size": ["x.size(9)"],
    "operator.matmul": ["operator.matmul(x, img)", "operator.matmul(x, torch.ones(5, 2))"],
    "torch.addmm": ["torch.addmm(x, x, x)", "torch.addmm(torch.ones(9), x, x.t())"],
    "torch.mm": ["torch.mm(x, x)", "torch.mm(x, img)"],
    "torch.amax": ["torch.amax(x, 9)"], "torch.amin": ["torch.amin(x, (0, 0))"], "Tensor.amin": ["x.amin(-9)"],
    "torch.max": ["torch.max(x, 9)", "torch.max(x, torch.ones(9))"], "Tensor.max": ["x.max(7)"],
    "Tensor.min": ["x.min(-7)"], "torch.mean": ["torch.mean(x, 9)"], "torch.prod": ["torch.prod(x, -9)"],
    "torch.logsumexp": ["torch.logsumexp(x, 9)"], "Tensor.all": ["x.all(9)"], "Tensor.var": ["x.var(9)"],
    "torch.norm": ["torch.norm(x, dim=9)", "torch.norm(x, p=-big)"], "Tensor.norm": ["x.norm(dim=(0, 9))"],
    "torch.linalg.vector_norm": ["torch.linalg.vector_norm(x, dim=9)", "torch.linalg.vector_norm(x, ord=big)"],
    "torch.nn.functional.log_softmax": ["F.log_softmax(x, dim=9)"],
    "torch.nn.functional.cosine_similarity": ["F.cosine_similarity(x, img, dim=1)", "F.cosine_similarity(x, x, dim=9)"],
    "torch.bincount": ["torch.bincount(torch.tensor([-1]))", "torch.bincount(ids.flatten(), minlength=-3)",
                       "torch.bincount(ids.flatten(), torch.ones(2))"],
    "torch.nonzero": ["torch.nonzero(torch.ones(0, 3))", "torch.nonzero(x, as_tuple=True)"],
    "torch.chunk": ["torch.chunk(x, 0)", "torch.chunk(x, 2, dim=9)"],
    "torch.concat": ["torch.concat([x, img])", "torch.concat([x, x], dim=-9)"],
    "torch.concatenate": ["torch.concatenate([x, x[:, :2, None]], 1)"],
    "torch.clone": ["torch.clone(x, memory_format=torch.channels_last)"],
    "torch.reshape": ["torch.reshape(x, (5, 5))", "torch.reshape(x, (-1, -1))", "torch.reshape(x, (big, big))"],
    "torch.swapaxes": ["torch.swapaxes(x, 0, 9)"],
    "torch.triu": ["torch.triu(x, big)", "torch.triu(torch.ones(3))"],
    "torch.masked_fill": ["torch.masked_fill(x, torch.ones(9, dtype=torch.bool), 1.0)"],
    "Tensor.masked_fill_": ["x.masked_fill_(torch.ones(2, 4, 6, dtype=torch.bool), 1.0)",
                            "x.masked_fill_(torch.ones(9, dtype=torch.bool), 0.0)"],
    "Tensor.flip": ["x.flip(9)", "x.flip((0, 0))"],
    "Tensor.gather": ["x.gather(1, torch.tensor([[6]]))", "x.gather(0, torch.tensor([[-5]]))"],
    "Tensor.scatter_": ["x.scatter_(1, torch.tensor([[6]]), 1.0)", "x.scatter_(1, torch.tensor([[-7]]), 1.0)",
                        "x.scatter_(0, torch.full((9, 9), big), torch.ones(9, 9))"],
    "Tensor.unbind": ["x.unbind(9)"],
    "Tensor.new_full": ["x.new_full((-1,), 1.0)", "x.new_full((big, big), 1.0)"],
    "torch.empty": ["torch.empty(-1)", "torch.empty(big, big)"],
    "torch.eye": ["torch.eye(-2)", "torch.eye(big, big)"],
    "torch.linspace": ["torch.linspace(0, 1, -1)", "torch.linspace(0, 1, big)"],
    "torch.nn.functional.adaptive_avg_pool1d": ["F.adaptive_avg_pool1d(x[None], -1)", "F.adaptive_avg_pool1d(x, 0)"],
    "torch.nn.functional.adaptive_max_pool1d_with_indices": ["F.adaptive_max_pool1d_with_indices(x[None], -2)"],
    "torch.nn.functional.adaptive_max_pool2d": ["F.adaptive_max_pool2d(img, (-1, 2))", "F.adaptive_max_pool2d(img, 0)"],
    "torch.nn.functional.avg_pool1d": ["F.avg_pool1d(x[None], 3, stride=0)", "F.avg_pool1d(x[None], 9)",
                                       "F.avg_pool1d(x[None], 3, padding=5)"],
    "torch.nn.functional.avg_pool2d": ["F.avg_pool2d(img, 3, stride=0)", "F.avg_pool2d(img, 99)",
                                       "F.avg_pool2d(img, 3, padding=5)", "F.avg_pool2d(img, 2, divisor_override=0)"],
    "torch.nn.functional.max_pool1d": ["F.max_pool1d(x[None], 3, stride=0)", "F.max_pool1d(x[None], 0)"],
    "torch.nn.functional.max_pool2d_with_indices": ["F.max_pool2d_with_indices(img, 3, padding=9)",
                                                    "F.max_pool2d_with_indices(img, 3, dilation=-1)"],
    "torch.nn.functional.max_pool3d": ["F.max_pool3d(img[None], 3, stride=0)", "F.max_pool3d(img[None], 99)"],
    "torch.nn.functional.lp_pool2d": ["F.lp_pool2d(img, 2.0, 99)", "F.lp_pool2d(img, -1.0, 3, stride=0)"],
    "torch.nn.functional.unfold": ["F.unfold(img, 3, stride=0)", "F.unfold(img, 99)", "F.unfold(img, 3, padding=-2)",
                                   "F.unfold(img, 3, dilation=0)"],
    "torch.nn.functional.batch_norm": ["F.batch_norm(img, torch.ones(9), torch.ones(9))",
                                       "F.batch_norm(img, torch.ones(2), torch.ones(2), torch.ones(7))"],
    "torch.nn.functional.group_norm": ["F.group_norm(img, 3)", "F.group_norm(img, 0)", "F.group_norm(img, 2, torch.ones(9))"],
    "torch.nn.functional.instance_norm": ["F.instance_norm(img, torch.ones(9), torch.ones(9))",
                                          "F.instance_norm(img, weight=torch.ones(7))"],
    # added with the zoo measurement of the whole causal-LM zoo (issue 63)
    "torch.broadcast_tensors": ["torch.broadcast_tensors(x, torch.ones(3, 5))", "torch.broadcast_tensors(x[:1].expand(big, 6), x)"],
    "torch.index_select": ["torch.index_select(x, 0, torch.tensor([9]))", "torch.index_select(x, 1, torch.tensor([-9]))",
                           "torch.index_select(x, 5, torch.tensor([0]))", "torch.index_select(x, 0, torch.tensor([big]))"],
    "torch.nn.functional.grid_sample": ["F.grid_sample(img, torch.full((1, 4, 4, 2), 1e30), align_corners=False)",
                                        "F.grid_sample(img, torch.full((1, 4, 4, 2), float('nan')), align_corners=False)",
                                        "F.grid_sample(img, torch.full((1, 4, 4, 2), -1e30), mode='nearest', padding_mode='border', "
                                        "align_corners=True)",
                                        "F.grid_sample(img, torch.full((1, 4, 4, 2), float('inf')), padding_mode='reflection', "
                                        "align_corners=False)",
                                        "F.grid_sample(img, torch.zeros(1, 4, 4, 3), align_corners=False)",
                                        "F.grid_sample(img, torch.zeros(2, 4, 4, 2), align_corners=False)"],
    "torch.scalar_tensor": ["torch.scalar_tensor(big)", "torch.scalar_tensor(float('nan'), dtype=torch.int64)",
                            "torch.scalar_tensor(1.0, dtype=torch.int8)"],
    "torch.scatter": ["torch.scatter(x, 1, torch.tensor([[9]]), 1.0)", "torch.scatter(x, 0, torch.tensor([[-9]]), 1.0)",
                      "torch.scatter(x, 5, torch.tensor([[0]]), 1.0)", "torch.scatter(x, 1, torch.zeros(9, 9, dtype=torch.long), 1.0)"],
    "torch.std": ["torch.std(x, dim=9)", "torch.std(x, dim=(0, 0))", "torch.std(x, correction=big)"],
    "Tensor.expand_as": ["x.expand_as(torch.ones(3, 3))", "x[:1].expand_as(torch.ones(2, 7))"],
    "Tensor.index_add": ["x.index_add(0, torch.tensor([9]), torch.ones(1, 6))", "x.index_add(1, torch.tensor([-9]), torch.ones(4, 1))",
                         "x.index_add(0, torch.tensor([0]), torch.ones(3, 3))"],
    "Tensor.index_select": ["x.index_select(0, torch.tensor([4]))", "x.index_select(1, torch.tensor([-7]))"],
    "Tensor.scatter": ["x.scatter(1, torch.tensor([[6]]), 1.0)", "x.scatter(0, torch.tensor([[-5]]), 1.0)"],
    "Tensor.sort": ["x.sort(dim=9)", "x.sort(dim=-9)"],
    "Tensor.view_as": ["x.view_as(torch.ones(5, 5))", "x.t().view_as(torch.ones(24))"],
}

_CHILD = textwrap.dedent('''
    import json, operator, sys, torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    big = 2**62
    for name, i, code in json.loads(sys.argv[1]):
        x, img, ids = torch.randn(4, 6), torch.randn(1, 2, 8, 8), torch.tensor([[0, 1, 2], [3, 4, 5]])
        print("RUN", name, i, flush=True)
        try:
            out = eval(code)
            outcome = "returned"
        except BaseException as err:  # noqa: BLE001 - the child reports whatever the hostile call raised
            outcome = type(err).__name__
        print("DONE", name, i, outcome, flush=True)
''')


def _listed(kinds: tuple[str, ...]) -> list[str]:
    """Listed functions and methods whose reason is one of ``kinds`` (``shape:``, ``indexing:``...)."""
    listed = reviewed.listed()
    return ([n for n, why in listed["functions"].items() if why.startswith(kinds)]
            + [f"Tensor.{n}" for n, why in listed["methods"].items() if why.startswith(kinds)])


SIZED = ("shape", "indexing", "construct", "layer", "matmul", "reduction")


def test_every_listed_kernel_taking_sizes_has_hostile_cases():
    """A new entry of these kinds (its kernel takes sizes, indices, offsets, strides, dims) comes with
    its hostile calls here: the review of each kept callable is this table, run below."""
    missing = [name for name in _listed(SIZED) if name not in CASES]
    assert not missing, f"listed kernels without hostile cases (add them to CASES): {missing}"


def test_listed_kernels_raise_on_hostile_arguments_and_never_crash():
    """Each hostile call in a child process: the child must run to its end (a crash, SIGSEGV or a
    heap abort, names the call that was running) and each call must raise or return normally."""
    calls = [(name, i, code) for name in sorted(set(_listed(SIZED)) & set(CASES)) for i, code in enumerate(CASES[name])]
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(calls)], capture_output=True, text=True,
                          timeout=600)
    lines = done.stdout.splitlines()
    finished = {tuple(line.split()[1:3]) for line in lines if line.startswith("DONE ")}
    started = [line.split(maxsplit=1)[1] for line in lines if line.startswith("RUN ")]
    assert done.returncode == 0, (f"the child died (exit {done.returncode}) running {started[-1] if started else '?'}: "
                                  f"{done.stderr[-800:]}")
    assert len(finished) == len(calls)
    outcomes = [line.split()[3] for line in lines if line.startswith("DONE ")]
    print(f"{len(calls)} hostile calls of {len({c[0] for c in calls})} listed kernels: "
          f"{outcomes.count('returned')} returned, {len(calls) - outcomes.count('returned')} raised")


@pytest.mark.parametrize("fn, args", [
    # the old list's quantization kernels: what the held-out probe called (a size it trusts)
    ("torch.choose_qparams_optimized", [{"$": "node", "v": "x"}, 2**30, 2**30, 0.16, 8]),
    ("torch.quantized_max_pool2d", [{"$": "node", "v": "x"}, [3, 3], [100, 100], [1, 1], [1, 1], True]),
    ("torch.fake_quantize_per_channel_affine", [{"$": "node", "v": "x"}, 1.0, 0, 0, 0, 255]),
    ("torch.quantize_per_tensor_dynamic", [{"$": "node", "v": "x"}, {"$": "dtype", "v": "quint8"}, False]),
    ("torch.embedding_bag", [{"$": "node", "v": "x"}, {"$": "node", "v": "x"}]),
    ("torch.ops.aten.embedding_bag", [{"$": "node", "v": "x"}, {"$": "node", "v": "x"}]),
])
def test_kernels_off_the_list_are_refused_by_name_before_anything_runs(seed_save, fn, args):
    from tests.helpers_io import _call

    directory, _, _ = seed_save
    _call(directory, fn, args)
    with pytest.raises(SerializationError, match="not on fxprep's default list"):
        io.load(directory)
