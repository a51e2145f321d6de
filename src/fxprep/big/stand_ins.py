"""A model on ``meta`` prepared with inputs that carry values (a VLM's image grid, its token ids).

A model on ``meta`` holds no values, so nothing in its forward may read one: a decoder-only LLM
reads none and is prepared on ``meta`` as it is. A vision-language model reads its *inputs*:
Qwen2-VL splits its vision attention by ``grid_thw.tolist()``, builds its rotary positions from the
grid and the token ids, Llava places image features where ``input_ids`` holds the image token. With
those inputs on ``meta`` the forward cannot run; with them on the CPU and the weights on ``meta``
it mixes devices at the first op that meets a weight.

So when the model holds tensors on ``meta`` and the example holds at least one real tensor, the
values are given to what reads them and nothing else: for the preparation only, every ``meta``
tensor of the model (parameters, buffers, tensor attributes) and of the example is replaced by a
*stand-in*, a CPU tensor of its shape and dtype that reads as zeros and takes no memory (pages of
a private anonymous mapping, which the kernel gives as its one zero page until they are written:
:func:`zero_pages`), so the model runs as a CPU model whose weights are all zero. Whatever the
forward decides from its inputs' values (split sizes, positions, where the image features go) is
decided from the real values, exactly as when preparing the model on the CPU, and the capture is
the CPU capture. Afterwards the stand-ins are replaced by the original ``meta`` tensors everywhere
(the model and every module of the prepared graph, by identity), so :func:`fxprep.load_weights`
loads the weights as for any graph prepared on ``meta``.

Why stand-ins rather than real inputs beside ``meta`` weights: that mixes devices in three worlds
(eager runs, Dynamo's fake tensors, Dynamo's real-value propagation), each with its own rules, and
values computed by factories on ``meta`` (``torch.arange(n, device=weight.device)``, the positions
a padding mask is indexed with) lose their values anyway. What it costs: the example's forward is
computed on the CPU (its FLOPs, with zero weights) in each eager run of the preparation, and a
tensor Dynamo copies (a module it calls as a leaf) takes memory while it is copied; nothing is kept. Decisions a forward takes from its *activations* (a mixture-of-experts router's choices) are
taken on zeros, as on ``meta`` they could not be taken at all.
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
