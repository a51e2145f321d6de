"""Prove the prepared module computes what the original does, and say by how much they differ.

Both modules run on fresh copies of the example inputs with the same RNG seed and the model's state
restored; outputs are flattened and compared leaf by leaf (:mod:`fxprep.verify.compare`). When they
differ, the first diverging node (:mod:`fxprep.verify.locate_node`) and leaf module are named. In
half precision both run with SDPA's math kernel and the tolerance follows dtype, scale and depth
(:func:`default_tolerances`, :func:`pinned_kernels`).

See docs/concepts/verification.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn

from ..core.inputs import ExampleInputs
from ..core.runs import SEED, StateChanges, observed_state, preserved_state, run_model, state_differences
from ..errors import EquivalenceError, FxprepError, ModelError
from ..reporting.report import Verification
from .attention_calls import Call, differences, recording
from .compare import Comparison, compare, flatten_output, tensor_diff
from .locate_node import locate


class Reference(NamedTuple):
    """The original's run on an example, what the prepared module is verified against."""

    output: Any
    state: dict[str, Any]  # what the run left behind (:func:`fxprep.core.runs.observed_state`)
    attention: list[Call]  # its attention calls (:mod:`fxprep.verify.attention_calls`)
    changed: StateChanges = StateChanges()  # what the run changed on the model (restored): state, not settings


def run_original(model: nn.Module, example: ExampleInputs, what: str = "the example inputs") -> Reference:
    """The reference run of the user's model: its output, the state it leaves behind (restored
    afterwards) and its attention calls. Its failure is the user's to fix, said so plainly. A
    half-precision model runs with SDPA's math kernel (:func:`pinned_kernels`), as :func:`verify`
    runs the prepared module, so one reference run serves capture and verification."""
    attention: list[Call] = []
    try:
        changed = StateChanges()
        with pinned_kernels(low_precision_model(model)), preserved_state(model, changes=changed), recording(attention):
            out = run_model(model, example)
            state = observed_state(model)
        return Reference(out, state, attention, changed)
    except Exception as err:
        raise ModelError(
            f"The model itself failed on {what} ({example.describe()}): "
            f"{type(err).__name__}: {err}\nCheck the shapes, dtypes and argument names of example_inputs "
            f"against the model's forward()."
        ) from err


LOW_PRECISION = (torch.float16, torch.bfloat16)
#: the default (rtol, atol) for float32 and wider outputs, as the report prints them; the half-precision
#: atol is the dtype's epsilon x the output's scale x sqrt(depth) / HALF_DIVISOR, with rtol 0.
#: docs/concepts/verification.md states both, and tests/test_docs_site.py checks that it states these.
FLOAT_TOLERANCES = (1e-4, 1e-5)
HALF_DIVISOR = 32


def low_precision(reference: Any) -> torch.dtype | None:
    """The half-precision dtype of the reference's outputs (the coarsest one), or None."""
    dtypes = {t.dtype for _, t in flatten_output(reference) if isinstance(t, torch.Tensor)}
    found = [d for d in LOW_PRECISION if d in dtypes]
    return max(found, key=lambda d: torch.finfo(d).eps) if found else None


def default_tolerances(reference: Any, depth: int = 1) -> tuple[float, float]:
    """(rtol, atol) for comparing outputs like ``reference`` from a graph ``depth`` layers deep.

    float32 and wider: :data:`FLOAT_TOLERANCES` (1e-4 / 1e-5). Half precision: both runs are made with the same attention
    kernel (:func:`pinned_kernels`), so a right graph computes what eager computes op for op and
    differs by nothing or by a few roundings; the tolerance is the dtype's epsilon, times the
    output's scale, growing with the square root of the depth (roundings that differ add up like
    noise), and ``rtol`` 0 so that a wrong value in a large output is not excused by its size.
    For a 32-layer bf16 Llama that is 1/4 of one bf16 step of the largest logit: a single extra
    bf16 rounding in one layer (tests/broken_graphs.py) still exceeds it several times over."""
    low = low_precision(reference)
    if low is None:
        return FLOAT_TOLERANCES
    scale = max((float(t.detach().abs().max()) for _, t in flatten_output(reference)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
                 and t.device.type != "meta" and bool(torch.isfinite(t).all())), default=1.0)
    return 0.0, torch.finfo(low).eps * max(scale, 1e-3) * math.sqrt(max(depth, 1)) / HALF_DIVISOR


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
    ``attention`` (:mod:`fxprep.verify.attention_calls`; it does not fail verification).

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
    found = compare(reference.output, got, rtol, atol, accepted, absent)
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
        again = compare(twice(original, example), twice(prepared, prepared_example), rtol, atol, None, absent)
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
        diff, bad = tensor_diff(a, b, rtol, atol)
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
    except Exception:  # noqa: BLE001 - locating a difference is best effort after verification failed
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
        if compare(seen[k], out, rtol, atol).problem is not None:
            return originals[id(orig_mod)]
    return None
