"""The Dynamo call itself, and what protects the user's model and the process around it.

Each ``torch._dynamo.export`` call runs with the user's modules kept as they were
(:class:`AttributeGuard`), Dynamo's process-wide state put back (:class:`DynamoGlobalState`), the
flag route's private config feature-detected (:func:`flag_available`), and a few of torch's
shape-logic quirks worked around (:func:`unguarded_kernel_choice`, :func:`violations_kept`,
:func:`_real_value_propagation`).

See docs/concepts/capture.md ("Under the hood") for what each protection does and why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...core import heap
from ...core.inputs import ExampleInputs
from ...core.threads import GLOBAL_LOCK, confined, quiet_logs
from ..shapes.dims import hints
from .marks import marks_restored
from .no_copies import parameters_aliased
from .recording import ORIGINAL_CLASS
from .traced_outputs import outputs_from_trace

ROUTES = ("auto", "flag", "regroup")
FLAG = "install_free_tensors_for_export"
_MISSING = object()


def flag_available() -> bool:
    """Whether this torch has the private Dynamo flag the ``"flag"`` route needs."""
    import torch._dynamo

    return hasattr(torch._dynamo.config, FLAG)


def default_route() -> str:
    return "flag" if flag_available() else "regroup"


def tensor_caches(model: nn.Module) -> list[tuple[nn.Module, str, dict[Any, Any]]]:
    """Plain dict attributes holding tensors (e.g. timm LeViT's ``attention_bias_cache``): values
    computed from parameters on a first eval call and reused afterwards. Captured as they are, the
    parameter would silently become a constant."""
    found = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key.startswith("_") or not isinstance(value, dict) or not value:
                continue
            if all(isinstance(v, torch.Tensor) for v in value.values()):
                found.append((module, key, value))
    return found


class AttributeGuard:
    """Keeps the user's modules exactly as they were across a capture.

    Dynamo replays what ``forward`` writes to module attributes (``self.saved = y``,
    ``self.cache[k] = y``) onto the real objects, with *fake* tensors. Inside the guard every plain
    dict/list attribute is a copy (``caches`` ones start empty, see :func:`tensor_caches`), and on
    exit every module's ``__dict__`` gets its original entries back (new ones removed).
    :meth:`reset` re-establishes the capture-time state, e.g. before running the model eagerly
    after Dynamo has left fake tensors behind.
    """

    def __init__(self, model: nn.Module, caches: list[tuple[nn.Module, str, dict[Any, Any]]]):
        self.modules = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
        self.caches = {(id(m), key) for m, key, _ in caches}
        self.snapshots: list[tuple[nn.Module, dict[str, Any]]] = []
        self.written: set[str] = set()

    def __enter__(self) -> AttributeGuard:
        self.snapshots = [(m, dict(m.__dict__)) for m in self.modules]
        self._swap()
        return self

    def _swap(self) -> None:
        for module, snapshot in self.snapshots:
            for key, value in snapshot.items():
                if key.startswith("_"):
                    continue
                if type(value) is dict:
                    module.__dict__[key] = {} if (id(module), key) in self.caches else dict(value)
                elif type(value) is list:
                    module.__dict__[key] = list(value)

    def _restore(self) -> None:
        for module, snapshot in self.snapshots:
            current = module.__dict__
            for key in list(current):
                if key not in snapshot:
                    if not key.startswith("_"):
                        self.written.add(key)
                    del current[key]
            for key, value in snapshot.items():
                if current.get(key, _MISSING) is not value:
                    if not key.startswith("_") and type(value) not in (dict, list):
                        self.written.add(key)
                    current[key] = value

    def reset(self) -> None:
        self._restore()
        self._swap()

    def __exit__(self, *exc: Any) -> None:
        self._restore()


class DynamoGlobalState:
    """Dynamo remembers across calls that a module *class* is "dynamic" once it met one instance
    with hooks (``GenerationTracker.mark_class_dynamic``); every later capture then inlines that
    class and, on the flag route, fails on its parameters. Undo what one capture added (private
    state, feature-detected: without it this is a no-op).

    Dynamo also keeps every backend it compiled with in a process-wide table; export's backend holds
    the captured graph, and with it the user's leaf modules and their parameters, so each prepared
    model would stay in memory for the life of the process (about the parameter bytes per call on
    resnet50). The entries one capture added are dropped too; the user's own ``torch.compile``
    entries are left alone."""

    def __enter__(self) -> DynamoGlobalState:
        try:
            from torch._dynamo import eval_frame

            self.backends: dict[int, Any] | None = eval_frame.cached_backends
            self.backends_before = set(self.backends)
        except Exception:  # noqa: BLE001 - a private Dynamo table missing on this torch: nothing to restore
            self.backends = None
        try:
            from torch._dynamo.mutation_guard import GenerationTracker

            self.tables = [GenerationTracker.dynamic_classes, GenerationTracker.generation_values]
            self.before = [set(t.values) for t in self.tables]
        except Exception:  # noqa: BLE001 - a private Dynamo table missing on this torch: nothing to restore
            self.tables = []
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.backends is not None:
            for key in set(self.backends) - self.backends_before:
                backend = self.backends.pop(key, None)
                if hasattr(backend, "reset"):
                    backend.reset()
        for table, before in zip(self.tables, getattr(self, "before", [])):
            try:
                for idx in set(table.values) - before:
                    table._remove_id(idx)
            except Exception:  # noqa: BLE001 - cleaning Dynamo's private table is best effort
                pass


# Dynamo's limits on how often one code object is compiled. An export is a one-off capture, never
# run again from Dynamo's cache, so a limit reached by earlier captures (or by the user's own
# torch.compile calls) must not stop it: it is lifted for fxprep's call only.
_LIMITS = ("recompile_limit", "accumulated_recompile_limit", "cache_size_limit", "accumulated_cache_size_limit")
_NO_LIMIT = 1 << 30


def _limit_patches(config: Any) -> dict[str, Any]:
    names = [n for n in _LIMITS if hasattr(config, n)]
    aliases = {"cache_size_limit": "recompile_limit", "accumulated_cache_size_limit": "accumulated_recompile_limit"}
    # an alias and its target cannot both be patched; keep the new names when present
    return {n: _NO_LIMIT for n in names if not (n in aliases and aliases[n] in names)}


def _shared_wrapper_code() -> Any:
    """The code object of Dynamo's ``wrap_inline`` frame (``external_utils.wrap_inline``'s
    ``inner``): export runs every module whose ``forward`` is torch's own (``nn.Sequential``) through
    this one frame, so its cache entries are shared by every such capture. None where this torch
    has no such helper."""
    try:
        from torch._dynamo import external_utils

        return external_utils.wrap_inline(lambda: None).__code__
    except Exception:  # noqa: BLE001 - private API, feature-detected
        return None


class DynamoCacheScope:
    """Drops the cache entries one export added to the shared ``wrap_inline`` frame.

    ``torch._dynamo.export`` resets the cache of the model's own ``forward`` before and after the
    call, but not of the wrapper frame it runs torch-defined forwards through; each capture of an
    ``nn.Sequential`` root left one entry there, and after eight of them (``recompile_limit``) Dynamo
    refused to capture any more in the process. The entries are only dropped when the frame had
    none before (they are then all fxprep's): a user's own compiled entries are never touched.
    """

    def __enter__(self) -> DynamoCacheScope:
        self.code = _shared_wrapper_code()
        self.had_entries = True
        if self.code is not None:
            try:
                from torch._dynamo.eval_frame import _debug_get_cache_entry_list

                self.had_entries = bool(_debug_get_cache_entry_list(self.code))
            except Exception:  # noqa: BLE001 - a private Dynamo helper missing on this torch: the cache is not reset
                self.code = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.code is None or self.had_entries:
            return
        try:
            from torch._C._dynamo.eval_frame import reset_code

            reset_code(self.code)
        except Exception:  # noqa: BLE001 - private API, feature-detected
            pass


def dynamo_export(model: nn.Module, call: ExampleInputs, route: str, dynamic_spec: dict[str, Any] | None,
                  *, real_values: bool = False, fresh_kwargs: bool = False) -> Any:
    """``torch._dynamo.export`` of ``model`` on ``call``, configured for ``route`` (static shapes
    unless ``dynamic_spec`` names dynamic dimensions), with Dynamo's global state put back after.
    ``real_values``: values read from data (``.item()``, ``.tolist()``) become symbols, and
    questions about them are decided from the example's real values, each decision kept in the
    graph as a runtime check (:mod:`fxprep.decisions`). ``fresh_kwargs``: trace from
    :func:`fresh_kwargs_root`. Where ``dynamic_spec`` declares a dimension the trace runs without the
    fake-tensor cache (:data:`SYMBOLIC_PATCHES`; inputs marked dynamic instead: :func:`symbolic_sizes`).

    Runs under :data:`fxprep.core.threads.GLOBAL_LOCK` (Dynamo's config and caches are process-wide),
    with the recompile limits lifted and the cache entries the call added dropped
    (:class:`DynamoCacheScope`) and the inputs' dimension marks put back
    (:func:`fxprep.capture.dynamo.marks.marks_restored`), so the hundredth capture in a process is
    the same as the first; the parameters are not copied
    (:func:`fxprep.capture.dynamo.no_copies.parameters_aliased`)."""
    import torch._dynamo as dynamo

    patches: dict[str, Any] = _limit_patches(dynamo.config)
    if route == "flag":
        patches[FLAG] = False
    elif flag_available():
        patches[FLAG] = True
    if hasattr(dynamo.config, "allow_rnn"):
        patches["allow_rnn"] = True
    if hasattr(dynamo.config, "side_effect_replay_policy"):
        # "info" formats a message with the user's stack for every side effect even when no log
        # shows it (~15 ms of a 2-layer Llama's 0.75 s prepare); fxprep compares what a run leaves on the model itself
        patches["side_effect_replay_policy"] = "silent"
    kwargs: dict[str, Any] = {"assume_static_by_default": True}
    if dynamic_spec is not None:
        kwargs["dynamic_shapes"] = dynamic_spec
    if _declares(dynamic_spec):
        patches.update(_symbolic_patches())
    if real_values:
        patches["capture_scalar_outputs"] = True
        patches["capture_dynamic_output_shape_ops"] = True
    real = _real_value_propagation() if real_values else contextlib.nullcontext()
    # the graph's outputs from the trace, not a second run of it; with real values the run stays torch's
    outputs = contextlib.nullcontext() if real_values else outputs_from_trace()
    root = fresh_kwargs_root(model) if fresh_kwargs else contextlib.nullcontext()
    with GLOBAL_LOCK, dynamo.config.patch(**patches), instance_forward_as_class(model), real, root, DynamoGlobalState(), DynamoCacheScope(), \
            unguarded_kernel_choice(), violations_kept(), outputs, parameters_aliased(), marks_restored(call):
        result = dynamo.export(model, **kwargs)(*call.args, **call.kwargs)
    heap.freeze_more()  # the passes' full collections then skip the objects Dynamo left (fxprep.core.heap)
    return result


def _declares(spec: Any) -> bool:
    """Whether a ``dynamic_shapes`` spec declares any dimension (a block's may be all ``None``)."""
    if isinstance(spec, dict):
        return any(_declares(v) for v in spec.values())
    if isinstance(spec, (list, tuple)):
        return any(_declares(v) for v in spec)
    return spec is not None


# A trace with symbolic sizes runs without the fake-tensor cache: a cache hit rebuilds its output with
# symbolic sizes and strides (``empty_strided`` and ``set_`` over SymInts: GLM-MoE-DSA's default prepare
# spent 4 s of 23 in them under cProfile), dearer than the op's fake kernel; with static sizes the cache
# pays (its hits are plain). Measured (``benchmarks/general_cost.py``'s models, best of 2, this 2-core CPU):
# default prepare 15-20% faster (llama 1.23 -> 0.99 s, glm_moe_dsa 8.09 -> 6.63, doge 14.7 -> 11.9,
# deepseek_v32 6.24 -> 5.08), static 5-15% slower, hence not for static traces.
SYMBOLIC_PATCHES = {"fake_tensor_cache_enabled": False}


def _symbolic_patches() -> dict[str, Any]:
    """:data:`SYMBOLIC_PATCHES` this torch has (all of torch 2.8 to 2.14 do)."""
    import torch._dynamo as dynamo

    return {k: v for k, v in SYMBOLIC_PATCHES.items() if hasattr(dynamo.config, k)}


@contextlib.contextmanager
def symbolic_sizes() -> Iterator[None]:
    """Around a :func:`dynamo_export` whose inputs carry Dynamo's dynamic marks (no spec declares the
    dimensions: the size- and batch-branch traces): the patches of a trace with symbolic sizes."""
    import torch._dynamo as dynamo

    with dynamo.config.patch(**_symbolic_patches()):
        yield

# torch's own choice of a convolution kernel, asked by its fake convolution with the traced sizes
_KERNEL_CHOICES = ("_select_conv_backend", "_conv_determine_backend_memory_format")


@contextlib.contextmanager
def unguarded_kernel_choice() -> Iterator[None]:
    """For the length of a capture on this thread: torch's fake convolution asks which kernel the
    real one would pick (``torch._C._select_conv_backend``, then the output's memory format) without
    leaving a guard on the sizes it reads.

    Why: that choice reads the batch (oneDNN and NNPACK are taken from a batch of 16 up), so with
    the batch declared dynamic every convolution guarded ``batch < 16``: export refused the declared
    dimension, and each model with a convolution (a CNN, a speech encoder's subsampling, a Mamba
    mixer's causal conv) was captured a second time with the bound declared, then said in the report
    as a bound Dynamo put on the batch. The kernel choice changes no node of the graph (it is one
    ``conv2d`` call whatever runs it, and at run time the real convolution chooses for the real
    batch), only the memory format of a fake output; decided on the example's sizes, as
    ``ShapeEnv.suppress_guards`` evaluates, it costs no capture. Other threads get torch's own
    functions' behaviour."""
    saved: dict[str, Any] = {}
    try:
        for name in _KERNEL_CHOICES:
            original = getattr(torch._C, name, None)
            if original is not None:
                saved[name] = original
                setattr(torch._C, name, confined(_unguarded(original), original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch._C, name, original)


@contextlib.contextmanager
def violations_kept() -> Iterator[None]:
    """For the length of a capture on this thread: a constraint violation reaches fxprep even where
    torch fails to write its suggested fixes.

    Why: after a trace whose guards violate the declared dimensions, torch formats suggested ``Dim``
    ranges (``DimConstraints.prettify_results``); for a size it would write as a multiple of a root
    whose range is one value (``seq = 4*_seq`` with ``_seq`` 2 only: DeepSeek-V4's compressed
    attention, ``seq // 4`` beside ``8 <= seq <= 11``) that formatting raises ``AssertionError:
    Cannot create Dim with inconsistent min=2, max=2``, and the violation, with the guards that say
    which dimension the code specialises, was lost: fxprep gave up on every declared dimension. Here
    a failure to format gives the violation without its suggestions, which
    :func:`~..shapes.violation.findings` reads from the guards themselves."""
    from torch.fx.experimental.symbolic_shapes import DimConstraints

    original = DimConstraints.prettify_results

    def prettify_results(self: Any, *args: Any, **kwargs: Any) -> str:
        try:
            return original(self, *args, **kwargs)
        except AssertionError:
            return ""

    DimConstraints.prettify_results = confined(prettify_results, original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DimConstraints.prettify_results = original  # type: ignore[method-assign]


def _unguarded(choose: Any) -> Any:
    """``choose`` asked with the guards of its tensors' symbolic sizes suppressed (confined to the
    capturing thread by :func:`fxprep.core.threads.confined`)."""

    def chosen(*args: Any, **kwargs: Any) -> Any:
        env = _shape_env(args)
        if env is None:
            return choose(*args, **kwargs)
        with env.suppress_guards():
            return choose(*args, **kwargs)

    return chosen


def _shape_env(args: tuple[Any, ...]) -> Any:
    """The shape environment of the fake tensors among ``args`` (torch's own lookup of their fake
    mode); None for none."""
    return getattr(torch._guards.detect_fake_mode(args), "shape_env", None)


MUTATED_INPUT_DICT = "mapping proxy affected by dictionary mutation"


@contextlib.contextmanager
def quiet_guard_logs() -> Iterator[None]:
    """Dynamo logs a failed constraint at ERROR level (with its stack) before raising it. Where that
    failure is an expected finding (a declared dimension the code specialises, said in the report;
    a block captured static after its dynamic attempt) it is not something for the user's terminal."""
    with quiet_logs("torch._guards", below=logging.CRITICAL):
        yield


@contextlib.contextmanager
def instance_forward_as_class(model: nn.Module) -> Iterator[None]:
    """A root whose ``forward`` is an attribute of the instance (accelerate's hooks and
    compressed-tensors' offloading wrap it there) traced from a one-off subclass whose ``forward``
    calls it, the instance attribute set aside meanwhile.

    Why: Dynamo takes a module whose instance has a ``forward`` attribute for a monkey-patched one and
    traces the attribute as a plain function, with the module's tensors as inputs of the graph that
    no argument of the call matches ("rewrite_signature: cannot trace optional function input").
    The wrapper still runs (traced) and the user's object is as it was after."""
    wrapper = model.__dict__.get("forward")
    if wrapper is None:
        yield
        return
    cls = type(model)
    func, bound = _unbound(wrapper, model)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # the wrapper called with the traced root as its own argument, so that Dynamo reaches the
        # model's modules from the root (their names in its graph), not from a closure
        return func(self, *bound, *args, **kwargs)

    # the parameters the wrapper shows (its __wrapped__'s: Dynamo matches a dynamic-shapes spec by name)
    shown = inspect.signature(wrapper)
    own = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = shown.replace(parameters=[own, *shown.parameters.values()])  # type: ignore[attr-defined]
    namespace = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 ORIGINAL_CLASS: cls}
    del model.__dict__["forward"]
    model.__class__ = type(cls.__name__, (cls,), namespace)
    try:
        yield
    finally:
        model.__class__ = cls
        model.__dict__["forward"] = wrapper


def _unbound(wrapper: Any, model: nn.Module) -> tuple[Any, tuple[Any, ...]]:
    """``(function, leading arguments)`` such that ``function(model, *leading, ...)`` is
    ``wrapper(...)``: a method bound to ``model``, or a ``functools.partial`` over it (accelerate's
    hooked forward); anything else is called as it is."""
    if isinstance(wrapper, types.MethodType) and wrapper.__self__ is model:
        return wrapper.__func__, ()
    if isinstance(wrapper, functools.partial) and wrapper.args and wrapper.args[0] is model and not wrapper.keywords:
        return wrapper.func, tuple(wrapper.args[1:])

    def call(_self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(*args, **kwargs)

    return call, ()


@contextlib.contextmanager
def fresh_kwargs_root(model: nn.Module) -> Iterator[None]:
    """Dynamo traces ``model`` from a one-line forward that calls the class's own with the same
    arguments, so the ``**kwargs`` dict the model's forward receives is made inside the trace.

    Why: transformers' ``merge_with_config_defaults`` writes config defaults into the ``**kwargs``
    of the forward it decorates. When that forward is the root of the trace, Dynamo counts the dict
    as an input, and after any mutation of an input dict it refuses every later ``mappingproxy``
    read ("mapping proxy affected by dictionary mutation"): ``inspect.Signature.bind`` in
    transformers' ``select_hidden_states`` (Mistral3's ``get_image_features``) then stops the
    capture. Made inside the trace, the dict's mutation is the trace's own. ``self`` is still the
    root frame's first argument, so Dynamo's source names are those of a direct trace. The one-line
    forward carries the class forward's signature, to which Dynamo matches a dynamic-shapes spec by
    parameter name (``input_ids``, not ``args``)."""
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return type(self).forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(type(model).forward)  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)
    try:
        yield
    finally:
        del model.forward


@contextlib.contextmanager
def _real_value_propagation() -> Iterator[None]:
    """Fake tensors that carry the real values along (the config switch ``torch.export``'s draft
    mode uses), so that a question about a value read from data has an answer. PyTorch logs each
    answer as a warning ("propagate_real_tensors evaluate_expr(u2*u3 > 1) -> True"); the report
    states them as the graph's checks instead, so they are kept off the user's terminal."""
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "fake_tensor_propagate_real_tensors"):
        yield
        return
    with quiet_logs("torch.fx.experimental.symbolic_shapes", below=logging.ERROR), \
            functorch_config.patch(fake_tensor_propagate_real_tensors=True,
                                   generate_fake_kernels_from_real_mismatches=True), \
            _offsets_unguarded(), _dtype_repaired():
        yield


@contextlib.contextmanager
def _offsets_unguarded() -> Iterator[None]:
    """Real-value propagation cross-checks each op's fake output against its real one, storage
    offset included (``r_offset != f_offset``, whatever its ``storage_offset`` flag says): where the
    fake offset is symbolic (a view at index 1 of a tensor whose size is a declared dimension:
    Qwen2-VL's ``m[i % 3]`` of its 3-axis rotary frequencies, offset ``seq * d``) the comparison is a
    guard, and it specialises the declared dimension to the example's size. During capture such an
    output is not cross-checked (the op's fake kernel stands, as without real values); every other
    output is, and the prepared module is verified on its own anyway."""
    from torch._subclasses import fake_utils

    check = getattr(fake_utils, "_check_fake_real_tensors", None)
    if check is None:
        yield
        return

    def checked(real_out: torch.Tensor, fake_out: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not isinstance(fake_out.storage_offset(), torch.SymInt):
            check(real_out, fake_out, *args, **kwargs)

    fake_utils._check_fake_real_tensors = confined(checked, check)
    try:
        yield
    finally:
        fake_utils._check_fake_real_tensors = check


@contextlib.contextmanager
def _dtype_repaired() -> Iterator[None]:
    """Real-value propagation repairs an op whose fake output has another dtype than its real one
    by keeping the fake kernel's sizes and taking the real output's dtype.

    Why: torch's own repair (``generate_fake_kernels_from_real_mismatches``) makes a fresh fake
    output whose every size is a new unbacked symbol. With a declared dimension, the wrong fake
    kernel is often one step of a decomposition whose result is sized by that dimension, and the
    fresh symbols then match nothing Dynamo returns (``PendingUnbackedSymbolNotFound``): the part
    became opaque. ``prims.signbit``'s fake kernel gives an integer input's dtype, not ``bool``, and
    ``tensor // k`` on integers decomposes through it: transformers' mixture-of-experts layers
    (``perm // num_top_k``) were opaque in every model captured deciding values read from data with
    its length declared (Qwen3-VL-MoE). A fake output whose sizes are the real ones (each
    symbol's value in the example) is right but for its dtype; one with other sizes or another
    mismatch gets torch's repair, as before."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = getattr(FakeTensorMode, "_maybe_infer_fake", None)
    if original is None:
        yield
        return

    def maybe_infer_fake(self: Any, func: Any, path: Any, fake: Any, real: Any) -> tuple[Any, bool]:
        if _dtype_only(fake, real):
            with self:
                out = torch.empty_strided(fake.shape, fake.stride(), dtype=real.dtype, device=fake.device)
            return out, True
        return original(self, func, path, fake, real)

    FakeTensorMode._maybe_infer_fake = confined(maybe_infer_fake, original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensorMode._maybe_infer_fake = original  # type: ignore[method-assign]


def _dtype_only(fake: Any, real: Any) -> bool:
    """Whether fake tensor ``fake`` differs from real tensor ``real`` in its dtype alone: same rank, a
    dense layout, each size equal to the real one (a symbolic size by its value in the example;
    False where it has none)."""
    if not (isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor)) or fake.dtype == real.dtype:
        return False
    if fake.layout != torch.strided or real.layout != torch.strided:
        return False
    return hints(fake.shape) == list(real.shape)
