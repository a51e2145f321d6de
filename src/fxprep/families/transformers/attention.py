"""transformers' attention taken the eager way under capture: the graph calls SDPA as eager does.

Under a trace transformers materialises attention masks that eager skips, so the graph would call
another SDPA kernel than eager (results drifting with depth in bf16, slower on CUDA).
:func:`eager_attention_paths` patches transformers' mask decisions, for the capturing thread only
and the length of a capture, so they are taken from the inputs' structure as eager takes them; what
cannot follow eager is named (:data:`VALUE_DEPENDENT`, :data:`WINDOW_LIMIT`, :data:`WINDOWED`).
Outside a trace each replacement answers as transformers' own function does.

See docs/checkpoints.md ("The graph calls attention as eager does", "Under the hood") for each
patch.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Where transformers' eager choice depends on tensor values, so no static graph can follow it.
VALUE_DEPENDENT = (
    "transformers skips the attention mask in eager when a given attention_mask has no padding "
    "(SDPA then runs with attn_mask=None, is_causal=True); that reads the mask's values, so a graph "
    "captured with an attention_mask always builds and passes the 4D mask (same result, exact in "
    "float32; another kernel on CUDA). Leave attention_mask out of the example inputs when your "
    "batches have no padding to keep eager's kernel."
)

WINDOWED = (
    "transformers skips the attention mask in eager for a sliding-window or chunked attention layer only while the "
    "sequence is shorter than its window ({windows} tokens here): a decision on the length. The example is at least "
    "that long, so the graph builds the windowed mask at every length: right on both sides of the window (same "
    "result, exact in float32; below the window another kernel than eager on CUDA)."
)

WINDOW_LIMIT = (
    "transformers skips the attention mask in eager for a sliding-window or chunked attention layer only while the "
    "sequence is shorter than its window ({windows} tokens here): a decision on the length. The example is shorter, "
    "so the graph calls attention as eager does there and holds for sequences shorter than the window only (a longer "
    "call raises InputMismatch). Prepare with an example of at least {longest} tokens for a graph that builds the "
    "windowed mask at every length."
)

PACKED_CHECK = (
    "the position ids the model computed start a new sequence inside a row (packed sequences): the graph "
    "was captured for one sequence per row, as eager found on the example"
)


def _namespace(owner: Any) -> dict[str, Any]:
    """Where a patch of ``owner`` goes: a module's globals, or a registry that is a plain dict
    (transformers' attention functions)."""
    return owner if isinstance(owner, dict) else owner.__dict__


def _on_thread(owner: int) -> Callable[[], bool]:
    """Whether the caller runs on ``owner``'s thread, asked so that Dynamo can trace it: Dynamo cannot
    trace ``threading.get_ident`` (:func:`fxprep.core.threads.confined` is for eager code), so the answer
    is computed when Dynamo meets the call and kept as a constant of that trace."""

    def here() -> bool:
        return threading.get_ident() == owner

    return torch._dynamo.assume_constant_result(here)


def _windowed(original: Callable[..., bool], here: Callable[[], bool], length: int,
              windows: list[tuple[int, bool]]) -> Callable[..., bool]:
    """``original`` (a ``_ignore_*_mask_sdpa``) under this thread's capture with the sequence length
    dynamic (``length``: the example's; a symbolic size looks like an ``int`` to code Dynamo traces,
    so the caller says): for a layer with a local window, eager's own decision where the example is
    shorter than the window (Dynamo then bounds the length), else ``False`` (the mask, at every
    length). Each window is noted in ``windows`` with whether it is masked (by a function Dynamo
    calls while tracing, :func:`_on_thread`'s way)."""
    names = tuple(inspect.signature(original).parameters)

    def note(window: int, masked: bool) -> bool:
        if (window, masked) not in windows:
            windows.append((window, masked))
        return True

    noted = torch._dynamo.assume_constant_result(note)

    def ignore_mask(*args: Any, **kwargs: Any) -> bool:
        bound = dict(zip(names, args))
        bound.update(kwargs)
        window = bound.get("local_attention_size")
        if window is not None and here() and torch.compiler.is_compiling():
            masked = length >= int(window)
            noted(int(window), masked)
            if masked:
                return False
        return original(*args, **kwargs)

    return ignore_mask


def _patches(owner: int, positions_given: bool, length: int | None, windows: list[tuple[int, bool]]
             ) -> list[tuple[Any, str, Callable[..., Any]]]:
    """``(module, name, replacement)`` for the transformers modules that are already imported; each
    replacement gives another thread transformers' own answer."""
    here = _on_thread(owner)
    found: list[tuple[Any, str, Callable[..., Any]]] = []
    masking = sys.modules.get("transformers.masking_utils")
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None) if masking is not None else None
        if original is not None and length is not None:
            found.append((masking, name, _windowed(original, here, length, windows)))
    packed = getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None
    if packed is not None and not positions_given:

        def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
            if not (here() and torch.compiler.is_compiling()):
                return packed(position_ids)
            first = position_ids[:, :1] - 1
            starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
            torch._assert_async(~starts.any(), PACKED_CHECK)
            return None

        found.append((masking, "find_packed_sequence_indices", find_packed_sequence_indices))
    if masking is not None:
        exporting = getattr(masking, "is_torchdynamo_exporting", None)
        if exporting is not None:

            def is_torchdynamo_exporting() -> bool:
                return False if here() else exporting()

            found.append((masking, "is_torchdynamo_exporting", is_torchdynamo_exporting))
        tracing = getattr(masking, "is_tracing", None)
        if tracing is not None:

            def is_tracing(tensor: Any = None) -> bool:
                return False if tensor is None and here() else tracing(tensor)

            found.append((masking, "is_tracing", is_tracing))
    sdpa = sys.modules.get("transformers.integrations.sdpa_attention")
    compiling = getattr(sdpa, "is_torchdynamo_compiling", None) if sdpa is not None else None
    if compiling is not None:

        def is_torchdynamo_compiling() -> bool:
            return False if here() else compiling()

        found.append((sdpa, "is_torchdynamo_compiling", is_torchdynamo_compiling))
    attention = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    mapping = getattr(attention, "_global_mapping", None)
    registered = mapping.get("sdpa") if isinstance(mapping, dict) else None
    if registered is not None:
        found.append((mapping, "sdpa", _causal_as_bool(registered)))
    return found


def _causal_as_bool(attend: Callable[..., Any]) -> Callable[..., Any]:
    """``attend`` (transformers' SDPA attention function) with ``is_causal`` made a ``bool``
    (module docstring): a no-op for the ``bool`` eager code passes, so any thread gets transformers'
    own call."""

    def sdpa_attention_forward(*args: Any, **kwargs: Any) -> Any:
        # not asked with isinstance (under Dynamo a symbolic bool answers that it is a bool), nor made
        # one with bool() (which Dynamo keeps symbolic): a branch is what Dynamo decides
        if kwargs.get("is_causal") is not None:
            kwargs["is_causal"] = True if kwargs["is_causal"] else False
        return attend(*args, **kwargs)

    return sdpa_attention_forward


@contextlib.contextmanager
def eager_attention_paths(positions_given: bool = True, length: int | None = None,
                          windows: list[tuple[int, bool]] | None = None) -> Iterator[None]:
    """For the length of a capture on this thread: transformers' mask and attention code takes the
    branch eager takes wherever that depends only on the input structure (module docstring).
    ``positions_given``: the example passes ``position_ids`` (then their values are the user's data
    and packed-sequence detection stays as traced). ``length``: the example's sequence length where
    it is declared dynamic (None: static); ``windows`` is then filled with each local window met
    and whether the graph masks it at every length."""
    done: list[tuple[Any, str, Any]] = []
    try:
        for module, name, new in _patches(threading.get_ident(), positions_given, length,
                                          [] if windows is None else windows):
            namespace = _namespace(module)
            done.append((namespace, name, namespace[name]))
            namespace[name] = new
        yield
    finally:
        for namespace, name, old in reversed(done):
            namespace[name] = old
