"""A model on ``meta`` prepared with inputs that carry values (a VLM's image grid, its token ids).

A vision-language model reads its inputs' values, which a model on ``meta`` cannot. For the
preparation only, every ``meta`` tensor of the model and the example is replaced by a stand-in: a
CPU tensor that reads as zeros and takes no memory (:func:`zero_pages`). The forward decides from
the real input values as on the CPU; afterwards the original ``meta`` tensors are put back
everywhere, so :func:`fxprep.load_weights` works as usual.

See docs/guides/big-models.md ("Vision-language models on meta", "Under the hood") for why and what
it costs.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0  # Python < 3.13 does not name it
NOTE = ("Prepared on 'meta' with an example that carries values: every meta tensor stood in as a zero "
        "CPU tensor during preparation (no memory), so the forward read its inputs' values (image grids, "
        "token ids) as on the CPU; the graph holds the meta tensors again (fxprep.load_weights fills them).")


def needed(model: nn.Module, example: Any) -> bool:
    """Whether ``model`` holds a tensor on ``meta`` and ``example`` a real one."""
    real = any(isinstance(t, torch.Tensor) and not t.is_meta for t in pytree.tree_leaves(example))
    return real and any(t.is_meta for _, t in _tensors(model))


@contextlib.contextmanager
def standing_in(model: nn.Module, example: Any) -> Iterator[tuple[Any, Callable[[nn.Module], None]]]:
    """``(example with stand-ins for its meta tensors, finish)`` while ``model``'s meta tensors are
    stood in; ``finish(gm)`` puts the originals back into a prepared graph. The model's own tensors
    are put back when the block ends, however it ends."""
    if not needed(model, example):
        yield example, lambda gm: None
        return
    made: dict[int, torch.Tensor] = {}  # id(original) -> stand-in
    back: dict[int, torch.Tensor] = {}  # id(stand-in) -> original
    swapped: list[tuple[nn.Module, str, str, torch.Tensor]] = []

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            value = zero_pages(tuple(t.shape), t.dtype)
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
            back[id(made[id(t)])] = t
        return made[id(t)]

    try:
        for module in _modules(model):
            for where, name, t in _places(module):
                if t.is_meta:
                    _set(module, where, name, stand_in(t))
                    swapped.append((module, where, name, t))
        example = pytree.tree_map(lambda v: stand_in(v) if isinstance(v, torch.Tensor) and v.is_meta
                                  else v, example)

        def finish(gm: nn.Module) -> None:
            from .weights import _replace

            _replace([gm], back)

        yield example, finish
    finally:
        for module, where, name, t in reversed(swapped):
            _set(module, where, name, t)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros on memory the kernel has not given yet: a private anonymous
    mapping (not reserved), whose pages read as the one shared zero page, so a tensor the forward
    only reads (a weight) costs no memory however large, and one it writes costs the pages written."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_NORESERVE", _NORESERVE)
    try:
        pages = mmap.mmap(-1, size, flags=flags)
    except (OSError, ValueError, TypeError):  # no such mapping here (another OS): real zeros
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def _modules(root: nn.Module) -> list[nn.Module]:
    return list({id(m): m for m in root.modules()}.values())


def _places(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    out = [("param", k, t) for k, t in module._parameters.items() if t is not None]
    out += [("buffer", k, t) for k, t in module._buffers.items() if t is not None]
    out += [("attr", k, t) for k, t in vars(module).items() if isinstance(t, torch.Tensor) and not k.startswith("__")]
    return out


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for m in _modules(model) for _, k, t in _places(m)]


def _set(module: nn.Module, where: str, name: str, value: torch.Tensor) -> None:
    if where == "param":
        module._parameters[name] = value  # type: ignore[assignment]
    elif where == "buffer":
        module._buffers[name] = value
    else:
        module.__dict__[name] = value
