"""What Dynamo's constraint violation says of the dimensions fxprep declared.

When a capture with declared dimensions fails, export's error names each dimension the model's code
specialises to a constant (with the user stack of the line that did it), the guards it put on each
bounded one, and (when it can write them) suggested ``Dim`` ranges. :func:`findings` reads that
text into what :func:`~.autodims.revised` needs for the next capture: the dimensions to drop, with
why, and the ranges to declare. Where the suggestions are missing or export's solver gives up
(guards with ``//`` and ``%``: a chunked scan's chunk count), the guards themselves are evaluated
around the example's size (:mod:`.guard_range`); a range that leaves one size is a specialisation,
and a violation that names a symbol but says nothing readable of it makes it one too.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any

import torch

from .autodims import Proposal, SizeRange
from .dims import SIZE_SOURCE

_NO_RANGE = SizeRange(None, None, "")

_MARKED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a constant \((-?\d+)\)")
_NOT_ALL = re.compile(r"Not all values of (\w+) = (\S+).*? satisfy the generated guard (.*)")  # symbol, source, guard
# export's other wording: the guards on a symbol solved to one value ("Suggested fixes: decoder_seq = 4")
_SOLVED = re.compile(r"solving the guards generated for (\w+) = .*? resulted in a specialized value of (-?\d+)")
_RANGE_FIX = re.compile(r"^\s*(\w+) = Dim\('\w+'((?:, (?:min|max)=-?\d+)*)\)\s*$", re.M)
_DERIVED_FIX = re.compile(r"^\s*(\w+) = \d+\*\w+\s*$", re.M)  # "seq = 10*_seq": a size export wants a multiple
_EXCLUDED = re.compile(r"^\S+\.size\(\)\[\d+\] != (-?\d+)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep



def _readable(guard: str) -> str:
    """Dynamo's guard text with its sources as the user writes them: ``input_ids.shape[1]``."""
    text = SIZE_SOURCE.sub(lambda m: f"{m.group(1)}.shape[{m.group(2)}]", guard)
    # export's own lower bound for a size it traced symbolically, not something the model asks for
    return re.sub(r"^2 <= (\S+) and ", "", text)


def _unlinked(guard: str) -> str:
    """A guard as Dynamo writes it, cut where its next message runs on without a line break."""
    return re.split(r"(?<=\d)(?=[A-Z][a-z])", guard, maxsplit=1)[0].rstrip(".")


def _where(section: str) -> str:
    """Where the model's code did it, from Dynamo's user stack in ``section``: its last frame
    outside torch, and torch's own last frame after it where the stack ends inside torch (a
    pooling layer's functional call, say: the model's line is the one a user can change)."""
    frames = list(_FRAME.finditer(section))
    if not frames:
        return ""

    def said(frame: re.Match[str]) -> str:
        code = section[frame.end():].strip().splitlines()
        return f"{frame.group(1)}:{frame.group(2)} in {frame.group(3)}" + (f" ({code[0].strip()[:100]})" if code else "")

    last = frames[-1]
    own = [f for f in frames if not _in_torch(f.group(1))]
    if own and own[-1] is not last:
        return f" at {said(own[-1])}, inside torch at {said(last)}"
    return f" at {said(last)}"


def _in_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_TORCH_DIR)


def findings(err: BaseException, proposal: Proposal) -> tuple[dict[tuple[str, int], str], dict[str, SizeRange]]:
    """What Dynamo's constraint violation (``err``) says of the declared dimensions: those the
    model's code specialises to a constant, ``{(input name, dim): why}`` (the size and the line of
    code, from Dynamo's user stack; every input sharing the symbol included), and the symbols it
    bounds, ``{symbol: SizeRange}`` (Dynamo's suggested ``Dim`` range, e.g. a sequence no
    longer than a learned position table). Both empty when ``err`` is not such a violation."""
    text = str(err)
    symbols = {sym: [(n, d) for n, ds in proposal.dynamic.items() for d, s in ds.items() if s == sym]
               for sym in {s for ds in proposal.dynamic.values() for s in ds.values()}}
    found: dict[tuple[str, int], str] = {}
    marks = list(_MARKED.finditer(text))
    for i, m in enumerate(marks):
        sym, value = m.group(1), m.group(2)
        if sym not in symbols:
            continue
        section = text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)].split("Suggested fixes")[0]
        why = f"the model's code specialises '{sym}' to {value}{_where(section)}"
        for key in symbols[sym]:
            found[key] = why
    printed: dict[str, list[tuple[str, str]]] = {}  # symbol -> (source, guard) each, as export printed them
    for m in _NOT_ALL.finditer(text):
        printed.setdefault(m.group(1), []).append((m.group(2), m.group(3).strip()))
    all_guards = [(sym, guard) for sym, pairs in printed.items() for _, guard in pairs]
    ranges: dict[str, SizeRange] = {}
    for m in _SOLVED.finditer(text):
        sym, value = m.group(1), m.group(2)
        if sym in symbols and not any(key in found for key in symbols[sym]):
            # export's solver gives up on guards written with // and % (a chunked scan's chunk count:
            # Qwen3.5's linear attention) and offers the example's size; where every guard holds on
            # an interval around it, the dimension is free there (a limit the prepared module checks),
            # declared maybe-dynamic, since export would refuse a range it cannot prove (for_export)
            held = _guards_hold(sym, printed.get(sym, []), proposal, symbols)
            if held is not None:
                ranges[sym] = _unproven(held)
                continue
            first = printed[sym][0][1] if sym in printed else ""  # its first guard
            why = f"the model's code specialises '{sym}' to {value}" + (
                f" (its guards solve to it: {_readable(_unlinked(first))[:160]})" if first else "")
            for key in symbols[sym]:
                found[key] = why
    fixes = text.split("Suggested fixes", 1)[1] if "Suggested fixes" in text else ""
    for m in _RANGE_FIX.finditer(fixes):
        sym = m.group(1)
        if sym not in symbols:
            continue
        bounds = dict(re.findall(r"(min|max)=(-?\d+)", m.group(2)))
        suggested = SizeRange(int(bounds["min"]) if "min" in bounds else None,
                              int(bounds["max"]) if "max" in bounds else None,
                              f"the model's code requires {_readable(printed[sym][-1][1] if sym in printed else 'a range')[:200]}")
        if _refused(proposal, sym, suggested):
            # export refused the range it suggested (its solver cannot prove the other guards over any
            # range: XLNet's relative positions, math.ceil of a float): where every guard holds, maybe-dynamic
            held = _guards_hold(sym, printed.get(sym, []), proposal, symbols)
            if held is not None:
                ranges[sym] = _unproven(held)
                continue
        ranges[sym] = suggested
    for sym, guard in all_guards:
        _exclude_end(sym, _unlinked(guard), ranges, proposal, symbols)
    specialised = {proposal.dynamic[n][d] for n, d in found if d in proposal.dynamic.get(n, {})}
    derived = set(_DERIVED_FIX.findall(fixes))
    for sym in {sym for sym, _ in all_guards} - specialised - set(ranges):
        held = _guards_hold(sym, printed.get(sym, []), proposal, symbols)
        if held is None:
            continue
        if sym in derived or _refused(proposal, sym, held):
            # export can prove them for no range: it offers a multiple of a new symbol instead (a waveform's
            # length through a convolution's stride: seq = 10*_seq), or it was given this range (its own
            # suggestion, or read from these guards) and refused it
            held = _unproven(held)
        ranges[sym] = held
    for sym, size in list(ranges.items()):
        if _one_size(size):  # no Dim holds one size (min < max): the example's size is the only one
            del ranges[sym]
            for key in symbols.get(sym, []):
                found[key] = f"the model's code specialises '{sym}' to {size.high} ({size.why[:200]})"
    if not found and not ranges:
        _unreadable(text, proposal, symbols, printed, found)
    return found, ranges


_VIOLATED = re.compile(r"Constraints violated \(([^)]*)\)!")


def _unreadable(text: str, proposal: Proposal, symbols: dict[str, Any], printed: dict[str, list[tuple[str, str]]],
                found: dict[tuple[str, int], str]) -> None:
    """A violation that names declared symbols and gives neither a size nor a range fxprep can read
    (torch failed to write its suggestions, :func:`~..dynamo.export.violations_kept`; guards the range
    reader cannot evaluate: DeepSeek-V4's ``seq // (seq // 4) == 4`` beside ``8 <= seq <= 11``):
    each named symbol is taken as specialised to the example's size, so that the capture is retried
    with the other dimensions, not given up for all of them."""
    header = _VIOLATED.search(text)
    named = {n.strip() for n in header.group(1).split(",")} if header else set()
    for sym in sorted(named & set(symbols)):
        size = _example_size(sym, proposal, symbols)
        first = printed[sym][0][1] if printed.get(sym) else "none printed"
        for key in symbols[sym]:
            found[key] = (f"the model's code specialises '{sym}'" + (f" to {size}" if size is not None else "")
                          + f" (its guards hold for no range fxprep can read: {_readable(_unlinked(first))[:160]})")


def _example_size(sym: str, proposal: Proposal, symbols: dict[str, Any]) -> int | None:
    """The size ``sym`` has in the example the capture ran on; None where no input shows it."""
    kwargs = proposal.capture_example.kwargs
    return next((int(kwargs[n].shape[d]) for n, d in symbols.get(sym, [])
                 if isinstance(kwargs.get(n), torch.Tensor) and d < kwargs[n].dim()), None)


def _one_size(size: SizeRange) -> bool:
    """Whether ``size`` leaves one size of 2 or more (a declared size is never 0 or 1)."""
    return size.high is not None and size.high <= max(size.low or 2, 2)


# the report's words for a range SizeRange.unproven marks
_UNPROVEN = "declared to Dynamo as maybe-dynamic (Dim.AUTO): export cannot prove these guards over a range"


def _unproven(held: SizeRange) -> SizeRange:
    """``held`` (where the guards hold) declared maybe-dynamic: export cannot prove them over it."""
    return replace(held.joined(_UNPROVEN), unproven=True)


def _refused(proposal: Proposal, sym: str, size: SizeRange) -> bool:
    """Whether ``proposal`` already declared ``sym`` over ``size``'s bounds (export's own suggestion
    or a range read from the guards, or no bound at all, as first declared) and export refused it
    again: declared so a second time it is refused a second time (DeepSeek's sparse attention takes
    ``min(2048, seq)`` tokens: ``Min(2048, seq) <= seq`` holds at every size, export cannot prove it,
    and the capture declaring the unbounded range it holds for cost a whole trace to fail the same way)."""
    before = proposal.ranges.get(sym, _NO_RANGE)
    return (before.low, before.high) == (size.low, size.high)


def _guards_hold(sym: str, printed: list[tuple[str, str]], proposal: Proposal, symbols: dict[str, Any]
                 ) -> SizeRange | None:
    """The range around the example's size where every guard export printed for ``sym`` (``(its
    source, the guard)`` each) holds, evaluated from the guards' text (:mod:`.guard_range`: export
    suggests no ``Dim`` for a guard written with ``sym_max`` or ``%``); None where they cannot be
    read or give no interval."""
    from .guard_range import interval

    sources = {source for source, _ in printed}
    guards = [_unlinked(guard) for _, guard in printed]
    size = _example_size(sym, proposal, symbols)
    if len(sources) != 1 or size is None:
        return None
    source = sources.pop()
    held = interval(guards, source, size)
    if held is None:
        return None
    known = proposal.ranges.get(sym, _NO_RANGE)
    low = max(held[0], known.low or 0)
    high = held[1] if known.high is None else (known.high if held[1] is None else min(known.high, held[1]))
    shown = _readable(_ending(guards, source, (low, high)) or guards[0])[:160]
    return SizeRange(low if low > 2 else None, high,
                     f"the guards Dynamo put on it hold for {low}..{high if high is not None else ''} ({shown})",
                     from_guards=True)


def _ending(guards: list[str], source: str, held: tuple[int, int | None]) -> str | None:
    """The guard that ends the interval ``held`` where the guards hold: the first that fails just
    past its upper end, else just below its lower one. The report shows it, not the first guard
    export printed (for a chunked scan, a guard that holds at every size)."""
    from .guard_range import failing

    low, high = held
    for outside in (high + 1 if high is not None else None, low - 1 if low > 2 else None):
        found = failing(guards, source, outside) if outside is not None else None
        if found is not None:
            return found
    return None


def _exclude_end(sym: str, guard: str, ranges: dict[str, SizeRange],
                 proposal: Proposal, symbols: dict[str, Any]) -> None:
    """A guard ``size != N`` where ``N`` ends the symbol's range (GPT-1 slices its 64-position table
    to the length: ``seq <= 64``, and ``seq != 64`` where the slice would be the whole table) moves
    that end in by one; export suggests no fix for it, so without this the declared length was given
    up for the example's. A value inside the range cannot be left out of a ``Dim``: left as it is."""
    m = _EXCLUDED.match(guard.strip())
    if m is None or sym not in symbols:
        return
    value = int(m.group(1))
    known = ranges.get(sym) or proposal.ranges.get(sym) or _NO_RANGE
    said = f"the model's code requires {_readable(guard)[:120]}"
    if known.high == value:
        ranges[sym] = replace(known, high=value - 1).joined(said)
    elif known.low == value:
        ranges[sym] = replace(known, low=value + 1).joined(said)


def specialises(err: BaseException) -> bool:
    """Whether ``err`` is Dynamo saying a declared dimension is specialised or bounded by the model's
    code (a constraint violation, which :func:`findings` reads)."""
    text = str(err)
    return "Constraints violated" in text or bool(_MARKED.search(text)) or bool(_NOT_ALL.search(text))
