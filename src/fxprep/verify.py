"""Prove the prepared module computes what the original does, and say by how much they differ.

Both modules run on fresh copies of the example inputs with the same RNG seed (so dropout in train
mode draws the same masks), and with every buffer restored afterwards (a train-mode BatchNorm must
not have its running statistics updated by verification: that would mutate the user's model).
Outputs are flattened through tuples, lists, dicts, dataclasses and ``ModelOutput`` and compared
leaf by leaf; NaNs must sit at the same positions, and the max difference is taken over the rest.

When they differ, the first diverging node is named: the first call whose inputs agree with eager's
and whose output does not, op modules and functions included (:mod:`fxprep.locate_node`), and the
first diverging *leaf module* (each leaf's output recorded in the original by forward hooks and in
the prepared graph by an Interpreter, in call order).

In half precision both modules run with SDPA's math kernel and the tolerance follows the dtype,
the output's scale and the graph's depth (:func:`default_tolerances`, :func:`pinned_kernels`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn

from .attention_calls import Call, differences, recording
from .errors import EquivalenceError, FxprepError, ModelError
from .inputs import ExampleInputs
from .locate_node import locate
from .report import Verification
from .runs import SEED, observed_state, preserved_state, run_model, state_differences


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


def _key_order_differences(ref: Any, got: Any, path: str = "out") -> list[tuple[str, list[Any], list[Any]]]:
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
                found += _key_order_differences(ref[k], got[k], f"{path}[{k!r}]")
    elif isinstance(ref, (tuple, list)) and isinstance(got, (tuple, list)):
        for i, (a, b) in enumerate(zip(ref, got)):
            found += _key_order_differences(a, b, f"{path}[{i}]")
    return found


class Reference(NamedTuple):
    """The original's run on an example, what the prepared module is verified against."""

    output: Any
    state: dict[str, Any]  # what the run left behind (:func:`fxprep.runs.observed_state`)
    attention: list[Call]  # its attention calls (:mod:`fxprep.attention_calls`)


def run_original(model: nn.Module, example: ExampleInputs, what: str = "the example inputs") -> Reference:
    """The reference run of the user's model: its output, the state it leaves behind (restored
    afterwards) and its attention calls. Its failure is the user's to fix, said so plainly. A
    half-precision model runs with SDPA's math kernel (:func:`pinned_kernels`), as :func:`verify`
    runs the prepared module, so one reference run serves capture and verification."""
    attention: list[Call] = []
    try:
        with pinned_kernels(low_precision_model(model)), preserved_state(model), recording(attention):
            out = run_model(model, example)
            return Reference(out, observed_state(model), attention)
    except Exception as err:
        raise ModelError(
            f"The model itself failed on {what} ({example.describe()}): "
            f"{type(err).__name__}: {err}\nCheck the shapes, dtypes and argument names of example_inputs "
            f"against the model's forward()."
        ) from err


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


def _compare(ref: Any, got: Any, rtol: float, atol: float,
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
    ref, ref_leaves = _without_absent(ref, got, absent, out)
    got_leaves = flatten_output(got)
    reordered = _key_order_differences(ref, got) if [p for p, _ in ref_leaves] != [p for p, _ in got_leaves] else []
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


def _without_absent(ref: Any, got: Any, absent: dict[str, str] | None,
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
    diff, bad = _tensor_diff(a, b, rtol, atol)
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


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, str | None]:
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


LOW_PRECISION = (torch.float16, torch.bfloat16)


def low_precision(reference: Any) -> torch.dtype | None:
    """The half-precision dtype of the reference's outputs (the coarsest one), or None."""
    dtypes = {t.dtype for _, t in flatten_output(reference) if isinstance(t, torch.Tensor)}
    found = [d for d in LOW_PRECISION if d in dtypes]
    return max(found, key=lambda d: torch.finfo(d).eps) if found else None


def default_tolerances(reference: Any, depth: int = 1) -> tuple[float, float]:
    """(rtol, atol) for comparing outputs like ``reference`` from a graph ``depth`` layers deep.

    float32 and wider: 1e-4 / 1e-5. Half precision: both runs are made with the same attention
    kernel (:func:`pinned_kernels`), so a right graph computes what eager computes op for op and
    differs by nothing or by a few roundings; the tolerance is the dtype's epsilon, times the
    output's scale, growing with the square root of the depth (roundings that differ add up like
    noise), and ``rtol`` 0 so that a wrong value in a large output is not excused by its size.
    For a 32-layer bf16 Llama that is 1/4 of one bf16 step of the largest logit: a single extra
    bf16 rounding in one layer (tests/broken_graphs.py) still exceeds it several times over."""
    low = low_precision(reference)
    if low is None:
        return 1e-4, 1e-5
    scale = max((float(t.detach().abs().max()) for _, t in flatten_output(reference)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
                 and t.device.type != "meta" and bool(torch.isfinite(t).all())), default=1.0)
    return 0.0, torch.finfo(low).eps * max(scale, 1e-3) * math.sqrt(max(depth, 1)) / 32


def graph_depth(gm: fx.GraphModule) -> int:
    """How many weighted layers a run of ``gm`` goes through: its calls of modules with parameters."""
    depth = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            with contextlib.suppress(AttributeError):
                if next(gm.get_submodule(node.target).parameters(recurse=False), None) is not None:
                    depth += 1
    return depth


@contextlib.contextmanager
def pinned_kernels(low: bool) -> Iterator[None]:
    """In half precision, SDPA runs its math kernel in both modules under comparison.

    Why: which fused kernel SDPA picks depends on its arguments (a mask or ``is_causal``) and the
    device; two right computations that pick different kernels differ in bf16 by an amount that
    grows with depth (0.28 on a 32-layer 7B Llama's logits on an H100), more than a real error like
    one extra rounding. With the kernel fixed, the comparison is of the graph, not of the kernel
    choice: the reference cannot be decided by it. The math kernel is exact for every argument."""
    if not low:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def verify(
    original: nn.Module,
    prepared: fx.GraphModule,
    example: ExampleInputs,
    *,
    reference: Reference | None = None,
    prepared_example: ExampleInputs | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    grad: bool = False,
    raise_on_mismatch: bool = True,
    where_rewrite: bool = False,
    absent: dict[str, str] | None = None,
    what: str = "the example inputs",
) -> Verification:
    """Compare ``prepared`` against ``original`` on ``example``; raise :class:`EquivalenceError` on a
    mismatch (naming the first diverging leaf), else return the measured :class:`Verification`.

    ``prepared_example`` is how the prepared module is called when it differs from the original's
    call (``concrete_args`` removed some arguments, for instance). ``reference`` is what
    :func:`run_original` returned, when the original already ran (it pins the attention kernel in
    half precision as this comparison does: a reference made otherwise would not do). The prepared
    run's attention calls are compared with the reference's, a difference said in the result's
    ``attention`` (:mod:`fxprep.attention_calls`; it does not fail verification).

    State is compared too: the buffers and plain scalar attributes (counters, running averages) one
    run of the original leaves behind against those one run of the prepared module leaves behind;
    the names that differ are in ``state_not_reproduced`` (reported, never passed over silently).

    ``where_rewrite``: the prepared graph joins data-dependent branches with ``torch.where``
    (``control_flow="rewrite"``, which reports it site by site). Two differences that follow are
    then accepted and stated in the result's detail, never hidden: an output that differs from the
    original's only by size-1 dimensions (the branches had different ranks; compared after
    broadcasting), and a parameter gradient that is None in the original but all zeros in the
    prepared module (it was read only by the branch not taken, which ``torch.where`` computes too).
    """
    prepared_example = prepared_example or example
    if reference is None:
        reference = run_original(original, example, what)
    low = low_precision_model(original) or low_precision(reference.output) is not None
    attention: list[Call] = []  # the prepared run's
    got, prepared_state = _run_prepared(original, prepared, prepared_example, what, low, attention)
    if rtol is None or atol is None:
        d_rtol, d_atol = default_tolerances(reference.output, graph_depth(prepared))
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
    accepted: list[str] | None = [] if where_rewrite else None
    found = _compare(reference.output, got, rtol, atol, accepted, absent)
    count, worst, problem = found.count, found.worst, found.problem
    result = Verification("passed", max_abs_diff=worst, rtol=rtol, atol=atol, outputs_compared=count)
    result.attention = differences(reference.attention, attention) or ""
    result.state_not_reproduced = state_differences(reference.state, prepared_state, rtol, atol)
    if problem is None and result.state_not_reproduced:
        problem = _second_call(original, prepared, example, prepared_example, rtol, atol, absent,
                               result.state_not_reproduced)
    if problem is None and grad and not found.meta:
        g_worst, g_problem = _verify_grads(original, prepared, example, prepared_example, rtol, atol, accepted)
        result.grad, result.grad_max_abs_diff = True, g_worst
        problem = g_problem
    details = []
    if accepted:
        details.append("accepted differences of the torch.where rewrite: " + "; ".join(accepted))
    if found.accepted:
        details.append("accepted: " + "; ".join(found.accepted))
    _inconclusive(result, found, details)
    result.detail = "; ".join(details)
    if problem is not None:
        result.status, result.detail = "failed", problem
        if raise_on_mismatch:
            with pinned_kernels(low):
                node = locate(original, prepared, example, prepared_example, rtol, atol)
                where = first_divergence(original, prepared, example, prepared_example, rtol, atol)
            located = f" First diverging module: '{where}'." if where else ""
            if node is not None:
                located = f" First diverging node: {node}." + located
                where = node.node if node.is_module else where
            raise EquivalenceError(
                f"Prepared module differs from the original: {problem} (max |diff| = {worst:.3g}).{located}",
                max_abs_diff=worst, module=where, output_path=problem.split(":")[0],
                node=None if node is None else node.node,
            )
    return result


def _run_prepared(original: nn.Module, prepared: fx.GraphModule, prepared_example: ExampleInputs, what: str,
                  low: bool, attention: list[Call]) -> tuple[Any, dict[str, Any]]:
    """One call of ``prepared`` (the attention kernel pinned in half precision; its attention calls
    appended to ``attention``) and the state it leaves on the shared modules, which are then put
    back as they were: a failure is an fxprep bug."""
    with preserved_state(original, prepared), pinned_kernels(low), recording(attention):
        try:
            got = run_model(prepared, prepared_example)
        except FxprepError:
            raise
        except Exception as err:
            raise EquivalenceError(
                f"The prepared module failed on {what} where the original ran: "
                f"{type(err).__name__}: {err}. This is an fxprep bug; please report it with the model."
            ) from err
        return got, observed_state(original)


def low_precision_model(model: nn.Module) -> bool:
    """Whether ``model`` holds half-precision floating parameters (its outputs are then compared
    with the kernel fixed, :func:`pinned_kernels`)."""
    return any(p.dtype in LOW_PRECISION for p in model.parameters())


def _second_call(original: nn.Module, prepared: fx.GraphModule, example: ExampleInputs,
                 prepared_example: ExampleInputs, rtol: float, atol: float, absent: dict[str, str] | None,
                 names: list[str]) -> str | None:
    """The state one call leaves differs (``names``): does the *next* call's output depend on it?
    Each module is called twice from the same starting state; a second output that differs means
    the prepared module computes something else from the second call on (a counter the output
    reads, baked into the graph as its first value), which is a failure, not a note."""
    def twice(model: nn.Module, call: ExampleInputs) -> Any:
        with preserved_state(original, prepared):
            run_model(model, call)
            return run_model(model, call)

    try:
        again = _compare(twice(original, example), twice(prepared, prepared_example), rtol, atol, None, absent)
    except Exception:  # noqa: BLE001 - a second call that fails is judged by the first call's result
        return None
    if again.problem is None:
        return None
    return (f"second call: {again.problem} - the original's output depends on state its forward updates "
            f"({', '.join(names[:6])}) and the prepared module does not reproduce that update")


def _inconclusive(result: Verification, found: Comparison, details: list[str]) -> None:
    """A comparison that found no difference but looked at no value proves little: its status is
    "inconclusive" and the detail says why, rather than a "passed" with max |diff| = 0."""
    compared = found.count - len(found.meta) - len(found.all_nan) - len(found.empty)
    if found.count == 0:
        result.status = "inconclusive"
        details.insert(0, "no output tensor to compare (the model returns None or no tensors): the graph's "
                          "computation was not observed; give inputs for which it returns tensors")
    elif found.meta and compared == 0:
        result.status = "inconclusive"
        details.insert(0, f"meta tensors: output structure, shapes and dtypes match ({len(found.meta)} output(s)); "
                          f"values cannot be computed on the meta device, so they were not compared. Load real "
                          f"weights and verify on a real device for a full check")
    elif found.all_nan and compared == 0:
        result.status = "inconclusive"
        details.insert(0, f"every output is non-finite (NaN or inf) in both modules ({', '.join(found.all_nan[:4])}): "
                          f"NaN/inf positions agree but no finite value was compared; check the weights and inputs "
                          f"(uninitialised memory? an overflow?)")
    elif found.empty and compared == 0 and not found.all_nan and not found.meta:
        result.status = "inconclusive"
        details.insert(0, f"every output is empty ({', '.join(found.empty[:4])}: no elements): no value was compared; "
                          f"give inputs with at least one element per dimension")
    elif compared == 0:
        result.status = "inconclusive"
        details.insert(0, "no output value could be compared (meta, non-finite or empty outputs)")
    else:
        for paths, why in ((found.all_nan, "all NaN or inf"), (found.empty, "empty"), (found.meta, "meta")):
            if paths:
                details.append(f"not compared: {', '.join(paths[:4])} ({why})")


def _verify_grads(original: nn.Module, prepared: fx.GraphModule, example: ExampleInputs,
                  prepared_example: ExampleInputs, rtol: float, atol: float,
                  accepted: list[str] | None = None) -> tuple[float, str | None]:
    """Backpropagate the same random cotangents through both; compare input and parameter grads
    (``accepted``, a list: a None gradient against an all-zero one is accepted and noted there)."""
    params = [p for p in original.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]

    def grads_of(model: nn.Module, ex: ExampleInputs) -> list[torch.Tensor | None]:
        fresh = ex.fresh_copy()
        leaves = [t for _, t in flatten_output((fresh.args, fresh.kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        for t in leaves:
            t.requires_grad_(True)
        for p in params:
            p.grad = None
        torch.manual_seed(SEED)
        out = model(*fresh.args, **fresh.kwargs)
        outs = [t for _, t in flatten_output(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return []
        gen = torch.Generator().manual_seed(SEED)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, cotangents)
        return [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in params]

    try:
        with preserved_state(original, prepared):
            ref = grads_of(original, example)
            got = grads_of(prepared, prepared_example)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    worst, problem = 0.0, None
    for i, (a, b) in enumerate(zip(ref, got)):
        if (a is None) != (b is None):
            present = b if a is None else a
            if accepted is not None and a is None and present is not None and not bool(present.any()):
                accepted.append(f"gradient {i}: None in the original, zeros in the prepared module")
                continue
            problem = problem or f"gradient {i}: present in one module only"
            continue
        if a is None:
            continue
        diff, bad = _tensor_diff(a, b, rtol, atol)
        worst = max(worst, diff)
        if bad:
            problem = problem or f"gradient {i}: {bad}"
    return worst, problem


class _LeafRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.outputs: list[tuple[str, Any]] = []

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_module(target, args, kwargs)
        self.outputs.append((str(target), out))
        return out


def first_divergence(original: nn.Module, prepared: fx.GraphModule, example: ExampleInputs,
                     prepared_example: ExampleInputs, rtol: float, atol: float) -> str | None:
    """Qualified name (in the original) of the first leaf module whose output differs."""
    originals = {id(m): n for n, m in original.named_modules(remove_duplicate=False)}
    recorded: dict[int, list[Any]] = {}
    handles = []
    targets = [n for n in prepared.graph.nodes if n.op == "call_module"]
    watched = {}
    for node in targets:
        mod = prepared.get_submodule(node.target)
        origin = node.meta.get("fxprep_unrolled_from", node.target)
        try:
            orig_mod = original.get_submodule(str(origin))
        except AttributeError:
            continue
        if id(orig_mod) in originals and type(orig_mod) is type(mod):
            watched[str(node.target)] = orig_mod
    for mod in {id(m): m for m in watched.values()}.values():
        handles.append(mod.register_forward_hook(
            lambda m, i, o: recorded.setdefault(id(m), []).append(o)))
    try:
        with preserved_state(original, prepared):
            run_model(original, example)
    except Exception:  # noqa: BLE001 - localisation is best effort
        return None
    finally:
        for h in handles:
            h.remove()
    # The prepared graph shares these modules: drop what the hooks saw and re-record via the interpreter.
    calls: dict[int, int] = {}
    recorder = _LeafRecorder(prepared)
    fresh = prepared_example.fresh_copy()
    try:
        with preserved_state(original, prepared), torch.no_grad():
            torch.manual_seed(SEED)
            recorder.run(*fresh.args, *fresh.kwargs.values())
    except Exception:  # noqa: BLE001
        return None
    for target, out in recorder.outputs:
        orig_mod = watched.get(target)
        if orig_mod is None:
            continue
        k = calls.get(id(orig_mod), 0)
        calls[id(orig_mod)] = k + 1
        seen = recorded.get(id(orig_mod), [])
        if k >= len(seen):
            return originals[id(orig_mod)]
        if _compare(seen[k], out, rtol, atol).problem is not None:
            return originals[id(orig_mod)]
    return None
