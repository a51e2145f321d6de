"""Torch kernels that trust their index arguments, called by loaded graphs behind a bounds check.

``torch._grouped_mm`` (what ``F.grouped_mm`` calls: transformers' mixture-of-experts layers in
bfloat16 multiply each expert's rows by its weights with it) takes ``offs``, the end of each
group's rows, and on CUDA hands them to a kernel that does not check them against the tensors'
sizes. A save is data from someone else, and :mod:`.reviewed` admits no callable that could read
memory it was not given on arguments a graph can build, so the function itself cannot be
allow-listed. A graph that calls it is saved naming :func:`grouped_mm` instead (:func:`saved_name`),
which checks the offsets (one small host read) and then calls the same kernel: the loaded module
computes exactly what the prepared one did, and a crafted file's offsets raise instead. The
prepared module in memory keeps the plain call (its offsets come from the model's own routing).
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "fxprep.io.checked.grouped_mm"


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` after checking ``offs``: a 1-D int32 tensor of non-decreasing ends
    within the grouped dimension (the rows of a 2-D ``mat_a`` against a 3-D ``mat_b``, one per
    group; the shared dimension of two 2-D matrices; the columns of a 2-D ``mat_b`` against a 3-D
    ``mat_a``). Raises ``ValueError`` otherwise; torch checks the rest (dtypes, sizes, strides)."""
    if not isinstance(mat_a, torch.Tensor) or not isinstance(mat_b, torch.Tensor):
        raise ValueError("grouped_mm takes two tensors")
    if offs is not None:
        if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.dtype != torch.int32:
            raise ValueError("grouped_mm: offs must be a 1-D int32 tensor")
        extent, groups = _grouped_extent(mat_a, mat_b)
        ends = offs.tolist()
        if groups is not None and len(ends) != groups:
            raise ValueError(f"grouped_mm: {len(ends)} offsets for {groups} groups")
        if any(e < 0 or e > extent for e in ends) or any(a > b for a, b in zip(ends, ends[1:])):
            raise ValueError(f"grouped_mm: offsets must rise within 0..{extent}")
    fn: Any = torch._grouped_mm
    return fn(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)


def _grouped_extent(mat_a: torch.Tensor, mat_b: torch.Tensor) -> tuple[int, int | None]:
    """The size of the dimension ``offs`` divides, and the number of groups where it is fixed."""
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        return int(mat_a.shape[0]), int(mat_b.shape[0])
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return min(int(mat_a.shape[1]), int(mat_b.shape[0])), None
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        return int(mat_b.shape[1]), int(mat_a.shape[0])
    raise ValueError("grouped_mm: offs is only for 2-D x 3-D, 2-D x 2-D or 3-D x 2-D operands")


def saved_name(fn: Any) -> str | None:
    """:data:`NAME` for ``torch._grouped_mm`` (by identity), else None."""
    grouped = getattr(torch, "_grouped_mm", None)
    return NAME if grouped is not None and fn is grouped else None
