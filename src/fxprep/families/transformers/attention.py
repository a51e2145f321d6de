"""transformers' attention taken the eager way under capture: the graph calls SDPA as eager does.

Why: transformers decides, when it builds an attention mask, whether SDPA can do without one
(``attn_mask=None, is_causal=True``, which lets CUDA pick its flash kernel) or needs a materialised
4D mask. It takes the materialised branch whenever it sees a trace: ``masking_utils`` asks
``is_torchdynamo_exporting()`` (transformers >= 5.24; ``torch._dynamo.export`` counts as exporting)
or ``is_tracing(padding_mask)`` (earlier 5.x, true for any Dynamo trace even when there is no
padding mask), because an exported graph with ``is_causal=True`` baked in is wrong once it is fed a
cache (pytorch#108108). fxprep captures with ``use_cache=False`` (:mod:`.model`), so the
query and key lengths are the same size by construction, and a decision made from the input
*structure* (no padding mask given, the sequence lengths) holds for every call the prepared
module's input guard lets through. Taking the traced branch there made the graph call another
kernel than eager on CUDA: in bf16 the results differed in the last bits and the difference grew
with depth (a 32-layer Llama failed verification), and 8k-token attention ran 1.3x slower.

What is patched, for the capturing thread only and for the length of a capture
(:func:`eager_attention_paths`):

* ``masking_utils.is_torchdynamo_exporting`` -> ``False``: the mask builders decide as under
  ``torch.compile``;
* ``masking_utils.is_tracing(x)`` -> false when ``x`` is ``None`` (no tensor whose values would
  be read), transformers' own answer otherwise: a padding mask's *values* still count as unknown,
  so a given ``attention_mask`` still gives a materialised mask (the place fxprep cannot follow
  eager, :data:`VALUE_DEPENDENT`);
* ``masking_utils.find_packed_sequence_indices`` (only when the example gives no ``position_ids``,
  so the model computes them, ``arange`` from 0 without a cache): eager reads the positions and
  finds one sequence per row, under a trace the packed-sequence mask is always built. The graph
  takes eager's answer and keeps a check (``torch._assert_async``, a tensor op: the value is
  not read on the host) that the positions the model computed hold no sequence start after the
  first token;
* ``sdpa_attention.is_torchdynamo_compiling`` -> ``False``: a one-token query with grouped KV heads
  is packed (``pack_gqa``) as in eager rather than expanded with ``repeat_kv``;
* ``masking_utils._ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa`` for a layer
  with a local window (sliding-window or chunked attention) when the sequence length is dynamic:
  eager skips the mask only while the sequence is shorter than the window, a decision on the
  length, not on the input structure, so no graph can follow eager on both sides. Taken the eager
  way as it was, it became a bound Dynamo put on the length, and a call past the window computed
  full causal attention where eager masks the window, without a word. Now the example decides: an
  example shorter than the window keeps eager's calls (no mask), and the graph holds below the
  window only, a limit the prepared module checks (:data:`WINDOW_LIMIT`); an example at least as
  long as the window gets the windowed mask at every length, right on both sides (another kernel
  than eager below the window: :data:`WINDOWED`).

* transformers' registered ``sdpa`` attention function: an ``is_causal`` that reaches it as a
  ``SymBool`` is made a ``bool``. A model that writes ``is_causal = self.is_causal and mask is None
  and q_len > 1`` (Moonshine) hands SDPA the last operand itself, the symbolic ``q_len > 1``, once the
  length is declared dynamic; SDPA refuses it ("argument 'is_causal' must be bool, not SymBool", as
  transformers' own note in ``sdpa_attention.py`` says of export), and the length stayed at the
  example's. Made a ``bool`` it is decided as eager decides it (a guard on the length, where Dynamo
  cannot tell it from the declared range).

Each replacement gives eager code (and any other thread) exactly what transformers' own function gives it (outside a trace
both answer ``False``), so runs fxprep makes during the capture are unchanged too.
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
