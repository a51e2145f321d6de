"""Two outputs compared: flattened leaf by leaf, structure first, each tensor by its values.

Outputs are flattened through tuples, lists, dicts, dataclasses and ``ModelOutput``
(:func:`flatten_output`) and compared leaf by leaf (:func:`compare`): paths, None-ness, types,
shapes and dtypes first, then each tensor's values in float64, a chunk at a time
(:func:`tensor_diff`: NaNs must sit at the same positions, infinities be equal, the max difference
is taken over the rest). Verification (:mod:`fxprep.verify`) and export's checks
(:mod:`fxprep.io.export`) use it; what cannot be compared (meta tensors, all-NaN outputs, empty ones)
is said in the :class:`Comparison`, never taken as a pass.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch


def flatten_output(value: Any, path: str = "out") -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` through tuples, lists, dicts, dataclasses and ``ModelOutput``."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):  # ModelOutput is an OrderedDict subclass
        out = []
        for k, v in value.items():
            out += flatten_output(v, f"{path}[{k!r}]")
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = []
        for f in dataclasses.fields(value):
            out += flatten_output(getattr(value, f.name), f"{path}.{f.name}")
        return out
    if isinstance(value, (tuple, list)):
        out = []
        for i, v in enumerate(value):
            out += flatten_output(v, f"{path}[{i}]")
        return out
    return [(path, value)]


def key_order_differences(ref: Any, got: Any, path: str = "out") -> list[tuple[str, list[Any], list[Any]]]:
    """``(path, original keys, prepared keys)`` of each dict in the outputs that has the same keys in
    another order.

    Why: a ``ModelOutput`` rebuilt from its pytree (as every prepared module's output is) has its
    keys in the class's field order, while the original may have set a field after the others
    (transformers 5.24's Llava sets ``image_outputs.pooler_output`` last). Values by key are what a
    user reads; the order matters only to positional access (``out[1]``), so it is stated, not failed."""
    found: list[tuple[str, list[Any], list[Any]]] = []
    if isinstance(ref, dict) and isinstance(got, dict):
        if list(ref) != list(got) and set(ref) == set(got):
            found.append((path, list(ref), list(got)))
        for k in ref:
            if k in got:
                found += key_order_differences(ref[k], got[k], f"{path}[{k!r}]")
    elif isinstance(ref, (tuple, list)) and isinstance(got, (tuple, list)):
        for i, (a, b) in enumerate(zip(ref, got)):
            found += key_order_differences(a, b, f"{path}[{i}]")
    return found


@dataclasses.dataclass
class Comparison:
    """What comparing two outputs found: tensors compared, the max |diff| over finite positions,
    the first problem (None: none), and what the comparison could not look at."""

    count: int = 0
    worst: float = 0.0
    problem: str | None = None
    meta: list[str] = dataclasses.field(default_factory=list)  # meta tensors: structure/shape/dtype only
    all_nan: list[str] = dataclasses.field(default_factory=list)  # no finite value in both (NaN/inf): nothing compared
    empty: list[str] = dataclasses.field(default_factory=list)  # no elements at all (a batch of 0)
    accepted: list[str] = dataclasses.field(default_factory=list)  # stated differences accepted


def compare(ref: Any, got: Any, rtol: float, atol: float,
             broadcast: list[str] | None = None, absent: dict[str, str] | None = None) -> Comparison:
    """Compare two outputs leaf by leaf, structure first (paths, None-ness, types).

    ``broadcast`` (a list) allows an output whose shape differs from the original's only by
    size-1 dimensions (a ``torch.where`` rewrite joined two branches of different ranks, and the
    report says so): it is compared after broadcasting, and the difference is appended to the list.
    ``absent`` ({output key: why}) names outputs the original returns and the prepared module is
    known not to (transformers' ``past_key_values`` when captured with ``use_cache=False``): they
    are accepted and stated, any other structural difference is a problem.
    """
    out = Comparison()
    ref, ref_leaves = without_absent(ref, got, absent, out)
    got_leaves = flatten_output(got)
    reordered = key_order_differences(ref, got) if [p for p, _ in ref_leaves] != [p for p, _ in got_leaves] else []
    if reordered and sorted(p for p, _ in ref_leaves) == sorted(p for p, _ in got_leaves):
        by_path = dict(got_leaves)
        got_leaves = [(p, by_path[p]) for p, _ in ref_leaves]
        out.accepted.extend(f"{p}: the same keys in another order (original {a}, prepared {b}); compared key by key"
                            for p, a, b in reordered)
    if [p for p, _ in ref_leaves] != [p for p, _ in got_leaves]:
        out.worst, out.problem = math.inf, (
            f"output structure differs: original {[p for p, _ in ref_leaves]} vs prepared {[p for p, _ in got_leaves]}"
        )
        return out
    if type(ref) is not type(got):
        out.worst, out.problem = math.inf, f"output type differs: original {type(ref).__name__} vs prepared {type(got).__name__}"
        return out
    for (path, a), (_, b) in zip(ref_leaves, got_leaves):
        _compare_leaf(out, path, a, b, rtol, atol, broadcast)
    return out


def without_absent(ref: Any, got: Any, absent: dict[str, str] | None,
                    out: Comparison) -> tuple[Any, list[tuple[str, Any]]]:
    """``ref`` and its leaves without the outputs ``absent`` names that the prepared output lacks,
    each stated in ``out.accepted`` (see :func:`_compare`)."""
    if absent and isinstance(ref, tuple) and isinstance(got, tuple) and len(ref) > len(got):
        # return_dict=False: the cache is a tuple item, named by position (Llava's is out[1], before
        # the image features), so the items after it move up by one in the prepared output
        caches = [i for i, v in enumerate(ref) if "Cache" in type(v).__name__]
        if len(ref) - len(caches) == len(got):
            why = next(iter(absent.values()))
            out.accepted.extend(f"out[{i}] returned by the original only ({why}); the items after it come one "
                                f"place earlier in the prepared output" for i in caches if i < len(got))
            out.accepted.extend(f"out[{i}] returned by the original only ({why})" for i in caches if i >= len(got))
            ref = tuple(v for i, v in enumerate(ref) if i not in caches)
    ref_leaves = flatten_output(ref)
    if not absent:
        return ref, ref_leaves
    got_paths = {p for p, _ in flatten_output(got)}
    kept = []
    # return_dict=False: the cache is a trailing tuple item, named by position, not by key
    dropped = {f"out[{i}]": next(iter(absent)) for i in range(len(got), len(ref))
               if isinstance(ref, tuple) and isinstance(got, tuple) and "Cache" in type(ref[i]).__name__}
    for path, value in ref_leaves:
        key = next((k for k in absent if path.startswith(f"out[{k!r}]")), None)
        key = key or next((k for p, k in dropped.items() if path == p or path.startswith(p + "[")), None)
        if key is not None and path not in got_paths:
            out.accepted.append(f"{path} returned by the original only ({absent[key]})")
            continue
        kept.append((path, value))
    return ref, kept


def _compare_leaf(out: Comparison, path: str, a: Any, b: Any, rtol: float, atol: float,
                  broadcast: list[str] | None) -> None:
    """One leaf of :func:`_compare` into ``out``: a non-tensor by equality (NaN equal to NaN), a
    tensor by shape, dtype and values (what cannot be compared, said so)."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        out.problem = out.problem or f"{path}: {type(a).__name__} vs {type(b).__name__}"
        return
    if not isinstance(a, torch.Tensor):
        if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            out.problem = out.problem or f"{path}: {a!r} != {b!r}"
        return
    out.count += 1
    if broadcast is not None and a.shape != b.shape and a.dtype == b.dtype and a.numel() == b.numel():
        try:
            joined = torch.broadcast_shapes(a.shape, b.shape) == b.shape
        except RuntimeError:
            joined = False
        if joined:
            broadcast.append(f"{path}: original shape {tuple(a.shape)}, prepared {tuple(b.shape)}")
            a = a.reshape(b.shape)
    if a.shape != b.shape or a.dtype != b.dtype:
        out.problem = out.problem or f"{path}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
        out.worst = math.inf
        return
    if a.device.type == "meta" or b.device.type == "meta":
        out.meta.append(path)  # no values on the meta device: shape and dtype are all there is
        return
    if a.numel() == 0:
        out.empty.append(path)
        return
    if _all_nan(a) and _all_nan(b):
        out.all_nan.append(path)
        return
    diff, bad = tensor_diff(a, b, rtol, atol)
    out.worst = max(out.worst, diff)
    if bad:
        out.problem = out.problem or f"{path}: {bad}"


def _all_nan(t: torch.Tensor) -> bool:
    """No finite value at all (NaN, +inf, -inf): equal infinities compare as "max |diff| = 0", which
    says nothing about the computation (issue 28: every output +inf passed)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).any())


# Elements compared at a time. Compared in float64, a whole output costs about eight temporaries of
# eight bytes per element: for a VLM's logits (128 tokens x 151,680 vocabulary) about 1.2 GB on the
# device beside the weights, which is what set preparation's peak (issue 27: at most ~1.5x the
# weights). A chunk bounds that at a few tens of MB whatever the output's size.
_CHUNK = 1 << 20


def tensor_diff(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, str | None]:
    """The largest |a - b| and, where it is not within ``atol + rtol * |b|``, why; compared in
    float64, :data:`_CHUNK` elements at a time (NaNs must sit at the same positions, infinities be equal)."""
    a, b = a.detach(), b.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = a.reshape(-1), b.reshape(-1)
    if not a.is_floating_point():
        if torch.equal(a, b):
            return 0.0, None
        worst = max(float((a[i:i + _CHUNK].double() - b[i:i + _CHUNK].double()).abs().max())
                    for i in range(0, a.numel(), _CHUNK))
        return worst, "values differ"
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return math.inf, f"NaN at different positions ({int(nan_a.sum())} vs {int(nan_b.sum())} NaNs)"
    del nan_a, nan_b
    diff, ok = 0.0, True
    for start in range(0, a.numel(), _CHUNK):
        a64, b64 = a[start:start + _CHUNK].double(), b[start:start + _CHUNK].double()
        nan = torch.isnan(a64)
        finite = ~nan & torch.isfinite(a64) & torch.isfinite(b64)
        if not torch.equal(a64[~finite & ~nan], b64[~finite & ~nan]):
            return math.inf, "infinities differ"
        if finite.any():
            d = (a64[finite] - b64[finite]).abs()
            diff = max(diff, float(d.max()))
            ok = ok and bool((d <= atol + rtol * b64[finite].abs()).all())
    return diff, None if ok else f"max |diff| {diff:.3g} exceeds rtol={rtol:g}, atol={atol:g}"
