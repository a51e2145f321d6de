"""Data-parallel calibration: :func:`fxprep.run_sequential` on every rank of a ``torch.distributed``
group.

Each rank runs batch ``k`` when ``k % world`` is its rank, and every rank ends where one process
would: observers' calls are recorded and replayed in single-process order (bit for bit for min/max
and histogram observers), the source rank's weight updates are broadcast, and a failure on any rank
undoes the stage everywhere (:class:`RankFailed` on the others). What ``on_stage`` gathers itself it
reduces itself.

See docs/guides/big-models.md ("Data-parallel ranks", "Under the hood").
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInput, RankFailed


class Ranks:
    """What :func:`fxprep.run_sequential` needs to run data-parallel (``ranks=Ranks(...)``) under ``torch.distributed``.

    Args:
        observers: ``torch.ao`` observers (min-max, moving-average, per-channel, histogram) whose calls every rank replays in the single-process order.
        source: The rank whose weight updates (by ``on_stage``) every rank takes.
        group: The ``torch.distributed`` process group, already initialised (default: the default group).
    """

    def __init__(self, observers: Sequence[nn.Module] = (), *, source: int = 0, group: Any = None):
        self.observers = list(observers)
        self.source = source
        self.group = group
        self.rank = 0
        self.world = 1
        self._batch = -1
        self._calls: dict[tuple[int, int], int] = {}  # (observer, batch) -> calls so far
        self._records: dict[int, list[tuple[int, int, Any]]] = {}  # observer -> [(batch, call, record)]
        self._kept: dict[tuple[int, int, int], torch.Tensor] = {}  # a histogram's inputs, until the stage ends

    # --- set-up ----------------------------------------------------------------------------------------
    def start(self, folders: set[str]) -> None:
        """Checked before any stage runs: the process group, ``source``, the observers, and that no two
        ranks write back into one offload folder (``folders``: this rank's)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidInput("run_sequential(ranks=...) needs torch.distributed initialised first "
                               "(torch.distributed.init_process_group, e.g. under torchrun).")
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if isinstance(self.source, bool) or not isinstance(self.source, int) or not 0 <= self.source < self.world:
            raise InvalidInput(f"Ranks(source={self.source!r}): a rank of the group, 0 to {self.world - 1}.")
        for observer in self.observers:
            _kind(observer)
        _check_histogram_replay([o for o in self.observers if _kind(o) == "histogram"])
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, sorted(folders), group=self.group)
        seen: dict[str, int] = {}
        for rank, theirs in enumerate(everyone):
            for folder in theirs:
                if folder in seen:
                    raise InvalidInput(f"ranks {seen[folder]} and {rank} would write weights back into the same offload "
                                       f"folder {folder}: give each rank its own (load_weights(offload_dir=...), "
                                       f"run_sequential(offload_dir=...)), or leave them out (each rank's own temporary one).")
                seen[folder] = rank

    def share(self, n: int) -> list[int]:
        """The batches this rank runs, of ``n``: ``rank``, ``rank + world``, ..."""
        return list(range(self.rank, n, self.world))

    # --- a stage's batches -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The observers record their calls instead of observing (hooks removed at the end)."""
        handles = []
        try:
            for index, observer in enumerate(self.observers):
                handles.append(observer.register_forward_pre_hook(self._recorder(index), with_kwargs=False))
                handles.append(observer.register_forward_hook(_give_back_input, with_kwargs=False))
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def batch(self, k: int) -> Iterator[None]:
        """Calls recorded while batch ``k`` (of all ranks' batches) runs."""
        self._batch = k
        try:
            yield
        finally:
            self._batch = -1

    def _recorder(self, index: int) -> Any:
        observer = self.observers[index]
        kind = _kind(observer)

        def record(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if self._batch < 0 or not args or not isinstance(args[0], torch.Tensor):
                return None
            x = args[0]
            call = self._calls.get((index, self._batch), 0)
            self._calls[(index, self._batch)] = call + 1
            summary = _summary(observer, kind, x, self._kept, (index, self._batch, call))
            if summary is not None:
                self._records.setdefault(index, []).append((self._batch, call, summary))
            module.__dict__["_fxprep_input"] = x
            return (x.new_empty(0),) + tuple(args[1:])

        return record

    # --- after the batches --------------------------------------------------------------------------------
    def failed(self, error: BaseException | None) -> list[int]:
        """The ranks that failed (every rank calls this at the same point and gets the same answer)."""
        import torch.distributed as dist

        flags = torch.zeros(self.world, dtype=torch.int32, device=self._device())
        flags[self.rank] = 0 if error is None else 1
        dist.all_reduce(flags, group=self.group)
        return [r for r in range(self.world) if flags[r].item()]

    def raise_for(self, failed: list[int], error: BaseException | None, stage: str, where: str) -> None:
        if not failed:
            return
        if error is not None:
            raise error
        raise RankFailed(f"rank {failed[0]} failed {where} of stage {stage!r}; every rank undid the stage.")

    def replay(self) -> None:
        """Every rank's recorded observer calls, into the observers, in the single-process order."""
        import torch.distributed as dist

        mine = {i: [(k, j, _portable(s)) for k, j, s in records] for i, records in self._records.items()}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, (self.rank, mine), group=self.group)
        calls: dict[int, list[tuple[int, int, int, Any]]] = {}
        for rank, theirs in everyone:
            for index, records in theirs.items():
                calls.setdefault(index, []).extend((k, j, rank, s) for k, j, s in records)
        try:
            for index in sorted(calls):
                observer = self.observers[index]
                ordered = sorted(calls[index], key=lambda c: (c[0], c[1]))
                if _kind(observer) == "histogram":
                    self._replay_histogram(index, observer, ordered)
                else:
                    with torch.no_grad():
                        for _, _, _, (low, high) in ordered:
                            observer(_min_max_input(observer, low, high))
        finally:
            self._records.clear()
            self._calls.clear()
            self._kept.clear()

    def _replay_histogram(self, index: int, observer: nn.Module, ordered: list[tuple[int, int, int, Any]]) -> None:
        """Ranges from every call's ``(min, max)``, then each owner's counts over its calls' ranges
        (summed over ranks: one owner per row), then the observer's own update, in order."""
        import torch.distributed as dist

        ranges = _histogram_ranges(observer, [(low, high) for *_, (low, high) in ordered])
        rows = torch.zeros(len(ordered), observer.bins, dtype=observer.histogram.dtype, device=self._device())
        for row, ((k, j, rank, _), (low, high)) in enumerate(zip(ordered, ranges, strict=True)):
            if rank == self.rank:
                x = self._kept[(index, k, j)]
                rows[row] = torch.histc(x, observer.bins, min=low, max=high).to(rows.device)  # type: ignore[arg-type]
        dist.all_reduce(rows, group=self.group)
        counts = rows.to(observer.histogram.device)
        with torch.no_grad():
            for row, (low, high) in enumerate(ranges):
                _histogram_update(observer, low, high, counts[row])

    # --- weight updates -------------------------------------------------------------------------------------
    def share_changes(self, onloader: Any, weights: Any, changes: list[tuple[Any, torch.Tensor]] | None) -> None:
        """Rank ``source``'s changes (``changes``, found there) made on every rank; each other rank's
        own differing changes dropped."""
        import torch.distributed as dist

        positions = {id(item): n for n, item in enumerate(weights.loaded)}
        message: list[Any] = [[positions[id(item)] for item, _ in changes] if changes is not None else None]
        dist.broadcast_object_list(message, src=self.source, group=self.group)
        changed: list[int] = message[0]
        values = dict(zip(changed, [v for _, v in changes])) if changes is not None else {}
        for n in changed:
            item = weights.loaded[n]
            like = item.slot.like
            if self.rank == self.source:
                data = values[n].detach().to(self._device()).contiguous().reshape(-1).view(torch.uint8)
            else:
                data = torch.empty(like.numel() * like.element_size(), dtype=torch.uint8, device=self._device())
            dist.broadcast(data, src=self.source, group=self.group)
            if self.rank != self.source:
                onloader.set_value(item, data.view(like.dtype).reshape(like.shape))
        if self.rank != self.source:
            wanted = set(changed)
            for n, item in enumerate(weights.loaded):
                if n not in wanted and onloader.differs(item):
                    onloader.set_value(item, item.before)

    def _device(self) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# --- observers -----------------------------------------------------------------------------------------------
def _kind(observer: nn.Module) -> str:
    from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

    if isinstance(observer, HistogramObserver):
        return "histogram"
    if isinstance(observer, PerChannelMinMaxObserver):
        return "per-channel"
    if isinstance(observer, MinMaxObserver):
        return "min-max"
    raise InvalidInput(f"Ranks(observers=...) replays torch.ao's MinMaxObserver, MovingAverageMinMaxObserver, their "
                       f"per-channel forms and HistogramObserver; {type(observer).__name__} is none of them: reduce "
                       f"what it gathers in on_stage (torch.distributed.all_reduce), or leave it out.")


def _give_back_input(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """The observer's real input as its output (a graph may compute with what an observer returns)."""
    return module.__dict__.pop("_fxprep_input", output)


def _summary(observer: Any, kind: str, x: torch.Tensor, kept: dict[Any, torch.Tensor], key: Any) -> Any:
    """What replaying one call needs, as the observer itself computes it; None when the observer
    would ignore the call (an empty input)."""
    if x.numel() == 0:
        return None
    x = x.detach()
    if kind == "min-max":
        return torch.aminmax(x.to(observer.min_val.dtype))
    if kind == "per-channel":
        axes = list(range(x.dim()))
        axes[observer.ch_axis] = 0
        axes[0] = observer.ch_axis
        y = torch.flatten(x.permute(axes).to(observer.min_val.dtype), start_dim=1)
        return torch.aminmax(y, dim=1)
    low, high = torch.aminmax(x)
    if low == -torch.inf or high == torch.inf:  # as HistogramObserver: infinities are left out
        warnings.warn("torch.inf detected in input tensor, ignoring input", stacklevel=3)
        x = x[x.abs() != torch.inf]
        if x.numel() == 0:
            return None
        low, high = torch.aminmax(x)
    kept[key] = x.clone()
    return low, high


def _portable(summary: Any) -> Any:
    return tuple(t.detach().to("cpu") for t in summary)


def _min_max_input(observer: Any, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """A tensor whose minimum and maximum (per channel along ``ch_axis`` for a per-channel observer)
    are ``low`` and ``high``: the observer updates from it as from the input they were taken from."""
    device = observer.min_val.device
    if low.dim() == 0:
        return torch.stack([low, high]).to(device)
    axis = observer.ch_axis
    ndim = max(2, axis + 1) if axis >= 0 else max(2, -axis)
    where = axis % ndim
    other = 1 if where == 0 else 0
    shape = [1] * ndim
    shape[where], shape[other] = low.numel(), 2
    pairs = torch.stack([low, high], dim=1 if other > where else 0)
    return pairs.reshape(shape).to(device)


def _histogram_ranges(observer: Any, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[Any, Any]]:
    """The range each call's histogram is counted over in the single-process run, from the
    observer's state and every call's ``(min, max)`` (HistogramObserver.forward's own steps)."""
    low_state = observer.min_val.detach().clone()
    high_state = observer.max_val.detach().clone()
    out = []
    for low, high in calls:
        low, high = low.to(low_state.device), high.to(high_state.device)
        if low_state == float("inf") or high_state == float("-inf"):
            out.append((low, high))
            low_state.resize_(low.shape).copy_(low)
            high_state.resize_(high.shape).copy_(high)
            continue
        new_low, new_high = torch.min(low_state, low).detach(), torch.max(high_state, high).detach()
        out.append((new_low, new_high))
        low_state.copy_(new_low)
        high_state.copy_(new_high)
    return out


def _histogram_update(observer: Any, low: Any, high: Any, counts: torch.Tensor) -> None:
    """HistogramObserver.forward's state update, given the call's range and its counts over it."""
    if observer.min_val == float("inf") or observer.max_val == float("-inf"):
        observer.min_val.resize_(low.shape)
        observer.min_val.copy_(low)
        observer.max_val.resize_(high.shape)
        observer.max_val.copy_(high)
        observer.histogram.detach_().resize_(counts.shape)
        observer.histogram.copy_(counts)
        return
    current_low, current_high = observer.min_val, observer.max_val
    if low == current_low and high == current_high:
        combined = observer.histogram + counts
    else:
        combined = observer._combine_histograms(observer.histogram, current_low, current_high, counts, low, high)
        observer.min_val.detach_().resize_(low.shape)
        observer.max_val.detach_().resize_(high.shape)
    observer.histogram.detach_().resize_(combined.shape)
    observer.histogram.copy_(combined)
    observer.min_val.copy_(low)
    observer.max_val.copy_(high)


def _check_histogram_replay(observers: list[Any]) -> None:
    """The replay above is HistogramObserver.forward taken apart; checked against this torch's own on
    a copy of each distinct configuration (ranges that grow, shrink back inside, and repeat)."""
    seen = set()
    generator = torch.Generator().manual_seed(0)
    for observer in observers:
        key = (type(observer), observer.bins, observer.histogram.dtype, observer.min_val.dtype)
        if key in seen:
            continue
        seen.add(key)
        real, replayed = copy.deepcopy(observer), copy.deepcopy(observer)
        inputs = [torch.randn(64, generator=generator) * s for s in (1.0, 3.0, 0.5, 3.0)]
        inputs.append(inputs[1].clone())
        kept: dict[Any, torch.Tensor] = {}
        with torch.no_grad():
            summaries = [_summary(replayed, "histogram", x, kept, n) for n, x in enumerate(inputs)]
            for x in inputs:
                real(x)
            ranges = _histogram_ranges(replayed, summaries)
            for n, (low, high) in enumerate(ranges):
                _histogram_update(replayed, low, high, torch.histc(kept[n], replayed.bins, min=low, max=high))
        same = all(torch.equal(getattr(real, a), getattr(replayed, a)) for a in ("histogram", "min_val", "max_val"))
        if not same:
            raise InvalidInput(f"this torch's {type(observer).__name__} updates its histogram otherwise than fxprep "
                               f"replays it across ranks: reduce it in on_stage, or leave it out of Ranks(observers=...).")
