"""fxprep's stages as llm-compressor's subgraphs: :func:`fxprep_subgraphs` in place of its
``trace_subgraphs``.

llm-compressor's sequential pipeline needs the model as subgraphs, each with ``input_names``,
``consumed_names``, ``forward(model, **inputs) -> dict`` and ``submodules(model)``. Its own tracer
(torch.fx with AST autowrapping) makes them; here fxprep does. The model is captured with every
module that is not an ancestor of a sequential target kept as one call (the targets themselves, the
embeddings, the final norm, ``lm_head``), exactly the granularity of llm-compressor's tracer: the
graph holds only the ancestors' code (the masks, the positions, the loop over the layers), and every
module a modifier may hook runs eagerly through ``nn.Module.__call__``, so GPTQ's, AWQ's,
SmoothQuant's and the quantization observers' hooks see the calls eager makes. The capture is
torch.fx's first (``tracing_ignore``'s functions called whole), Dynamo's where fx fails, on a plain
twin of the model (:mod:`.twin`), verified against it where the twin holds real weights.

See docs/handoff/llm-compressor.md.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import api
from ...big.partition import Stage, Stages, partition
from ...capture.routes import Route
from ...errors import EquivalenceError, FxprepError, InputMismatch, InvalidInput, TraceFailure
from ...families import family_for
from ...reporting.report import Report
from ...runtime import guard
from ...runtime.prepared import INPUT_SPEC
from .reproduce import Difference, compare_subgraphs
from .twin import Twin, bind_to_model, plain_twin


@dataclass
class Capture:
    """What the last :func:`fxprep_subgraphs` made: the prepared graph (bound to the model), its
    report, the twin it was captured on, and the subgraphs."""

    gm: Any
    report: Report
    twin: Twin
    subgraphs: list[FxprepSubgraph] = field(default_factory=list)
    check: Difference | None = None  # the stages against the model, where the capture could not verify
    stood_in: list[str] = field(default_factory=list)  # kept-whole modules that could not run on meta
    not_run: list[str] = field(default_factory=list)  # targets the sample does not run (no stage of their own)
    targets: list[tuple[str, nn.Module]] = field(default_factory=list)  # those with a stage
    shape: Any = None  # the shapes of the batch it was captured on (:func:`_shape`)
    other_shape: Any = None  # those of the batch now run, where they are not ``shape``

    @property
    def by_fx(self) -> bool:
        """Captured by torch.fx: the graph holds no input check of its own."""
        return self.report.tracer is not None and not Route(self.report.tracer).dynamo


LAST: list[Capture] = []  # the last capture, for inspection (``last_capture()``)


def last_capture() -> Capture | None:
    """What the last ``pipeline="fxprep"`` run in this process captured.

    Returns:
        The :class:`Capture` (``.report``: fxprep's report, ``.gm``, ``.subgraphs``), or None before any run.
    """
    return LAST[-1] if LAST else None


class FxprepSubgraph:
    """One of fxprep's stages as llm-compressor's sequential pipeline calls a subgraph.

    ``input_names``: the values it reads (for the first, the calibration batch's keys);
    ``consumed_names``: those no later subgraph reads (the pipeline drops them from its cache);
    ``forward(model, **inputs)``: the stage run on them, ``{name: value}`` of what later ones read;
    ``submodules(model)``: the model's modules it calls (the modifiers compress these at its end)."""

    def __init__(self, stage: Stage, model: nn.Module, binder: Stages | None = None,
                 batch_keys: tuple[str, ...] = (), passes_on: tuple[str, ...] = (), gm: Any = None):
        self.stage = stage
        self.model = model
        self.binder = binder  # the first subgraph binds the batch to the graph's inputs
        self.gm = gm  # the prepared graph: its input check (shapes the model's code fixed, None-ness)
        self.batch_keys = batch_keys
        self.passes_on = passes_on  # graph inputs later subgraphs read: the first returns them
        self.input_names: set[str] = set(batch_keys) if binder is not None else set(stage.inputs)
        self.consumed_names: set[str] = set()
        self.capture: Capture | None = None  # all subgraphs and the targets (the first checks a batch against them)
        self.accepted: set[Any] = set()  # shapes the graph was not captured for, checked against the model on a batch
        self._checking = False

    @property
    def name(self) -> str:
        return self.stage.name

    def __repr__(self) -> str:
        return f"FxprepSubgraph({self.stage.name!r}, inputs={sorted(self.input_names)})"

    def forward(self, model: nn.Module, **inputs: Any) -> dict[str, Any]:
        if model is not self.model:
            raise InvalidInput("this subgraph was made for another model object; capture again for this one.")
        if self.binder is None:
            return self._run({n: inputs[n] for n in self.stage.inputs})
        values = self._bind(inputs)
        out = self._run({n: values[n] for n in self.stage.inputs})
        out.update({n: values[n] for n in self.passes_on})
        return out

    def _run(self, values: dict[str, Any]) -> dict[str, Any]:
        """The stage on ``values``. A torch.fx graph holds no input check (it is as general as the
        model's code, which may itself fix a size): on a batch shaped otherwise than the capture's,
        a stage that cannot run says so as :class:`InputMismatch`, with what to do."""
        try:
            return self.stage(**values)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            capture = self.capture
            if capture is None or not capture.by_fx or capture.other_shape is None:
                raise
            raise InputMismatch(f"the calibration batch is shaped {dict(capture.other_shape)}; the graph was captured "
                                f"on {dict(capture.shape)}. The stages do not run on it ({self.name}): "
                                f"{type(err).__name__}: {err}\n{ADVICE}") from None

    def _bind(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(inputs) - set(self.batch_keys))
        missing = sorted(set(self.batch_keys) - set(inputs))
        if unknown or missing:
            raise InputMismatch(f"the calibration batch has keys {sorted(inputs)}; the graph was captured for "
                                f"{sorted(self.batch_keys)} (missing {missing}, unknown {unknown}). Every batch of "
                                "the dataset needs the same columns.")
        assert self.binder is not None
        if self.capture is not None:
            shape = _shape(inputs)
            self.capture.other_shape = None if shape == self.capture.shape else shape
        spec = self.gm.__dict__.get(INPUT_SPEC) if self.gm is not None else None
        if spec is not None and not self._checking:  # the stages hold no input check of their own: the graph's
            try:
                guard.check(self.gm, spec, (), dict(inputs))
            except InputMismatch as err:
                self._check_on_batch(inputs, err)
        try:  # checked above (the spec, or the stages against the model on this batch)
            return self.binder.bind_unchecked(**inputs)
        except (TypeError, InvalidInput) as err:
            raise InputMismatch(f"the calibration batch does not fit the captured graph's inputs: {err}") from None

    def _check_on_batch(self, inputs: Mapping[str, Any], mismatch: InputMismatch) -> None:
        """A batch shaped otherwise than the graph was captured for, where Dynamo fixed a size (a VLM's
        patch count, a length): accepted when the stages reproduce the model on it, every target's
        inputs and outputs compared (once per distinct shape, the modifiers' hooks off), else refused.
        A size the graph really holds fails there (or earlier, in a stage) and is named."""
        shape = _shape(inputs)
        if shape in self.accepted:
            return
        if self.capture is None:
            raise InputMismatch(f"{mismatch}\n{ADVICE}") from None
        from llmcompressor.modifiers.utils.hooks import HooksMixin

        self._checking = True
        try:
            with HooksMixin.disable_hooks():
                found = compare_subgraphs(self.model, self.capture.subgraphs, dict(inputs), self.capture.targets)
        except Exception as err:  # noqa: BLE001 - a stage that cannot run on this shape: the mismatch, with why
            raise InputMismatch(f"{mismatch}\nThe stages do not run on it: {type(err).__name__}: {err}\n{ADVICE}") from None
        finally:
            self._checking = False
        if not found.equal:
            raise InputMismatch(f"{mismatch}\nThe stages do not reproduce the model on it: {found}.\n{ADVICE}") from None
        self.accepted.add(shape)
        from loguru import logger

        logger.info(f"fxprep: a batch shaped {dict(shape)} is not the capture's; its stages reproduce the model on it "
                    f"({found}): calibrating on it.")

    def submodules(self, model: nn.Module, recurse: bool = True) -> list[nn.Module]:
        """The model's modules this subgraph calls or reads tensors of (fxprep's own op modules left
        out), with everything under them when ``recurse``, in graph order."""
        own = {id(m) for m in model.modules()}
        direct: list[nn.Module] = []
        for node in self.stage.graph.nodes:
            if node.op == "call_module":
                direct.append(self.stage.get_submodule(str(node.target)))
        direct += list(self.stage.weight_modules.values())
        out: list[nn.Module] = []
        seen: set[int] = set()
        for module in direct:
            for sub in (module.modules() if recurse else [module]):
                if id(sub) in own and id(sub) not in seen:
                    seen.add(id(sub))
                    out.append(sub)
        return out


ADVICE = ("With llm-compressor: give every calibration sample the shape the graph was captured for (pad or "
          "truncate them to one length: max_seq_length with padding), or capture on a sample of the shape you "
          "calibrate with.")


def _shape(inputs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in sorted(inputs.items()))


ALL = "__ALL__"  # llm-compressor's sequential targets for a model without _no_split_modules


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The items of every ``nn.ModuleList`` of two or more modules of one class (decoder layers,
    encoder blocks, a VLM's vision blocks), outermost lists only: the sequential targets for a model
    that declares none. llm-compressor's own pipeline runs such a model as one subgraph."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        items = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if len(items) >= 2 and len({type(i) for i in items}) == 1:
            taken.append(name)
            found += [(f"{name}.{k}" if name else str(k), item) for k, item in module.named_children()]
    return found


def _ancestors(model: nn.Module, targets: set[int]) -> set[int]:
    """``id`` of every module that holds a target below it (and is not one): what the graph traces."""
    found: set[int] = set()

    def holds(module: nn.Module) -> bool:
        below = [holds(c) for c in module.children()]
        if any(below) and id(module) not in targets:
            found.add(id(module))
        return id(module) in targets or any(below)

    holds(model)
    return found


def _kept_whole(model: nn.Module, ancestors: set[int]) -> list[nn.Module]:
    """The outermost modules that are not ancestors: each is one call in the graph."""
    out: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in ancestors:
                walk(child)
            else:
                out.append(child)

    walk(model)
    return list({id(m): m for m in out}.values())


def _example(model: nn.Module, sample: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The calibration batch's entries the model's forward takes, on the twin's device."""
    params = inspect.signature(type(model).forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {}
    for key, value in sample.items():
        if key in params or takes_any:
            out[key] = value.to(device) if isinstance(value, torch.Tensor) else value
    return out


@contextlib.contextmanager
def calibration_context(model: nn.Module) -> Iterator[None]:
    """llm-compressor's calibration context (eager attention, no cache, eval, no grad, ``lm_head``
    on meta) with quantization and the modifiers' hooks off: what its tracer traces in, and what
    the pipeline's calibration passes run in but for the hooks."""
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context

    with calibration_forward_context(model), DisableQuantization(model), HooksMixin.disable_hooks():
        yield


def fxprep_subgraphs(model: nn.Module, sample_input: Mapping[str, Any], sequential_targets: Any,
                     ignore: Any = (), targets_per_subgraph: int = 1) -> list[FxprepSubgraph]:
    """What llm-compressor's ``trace_subgraphs`` returns, made by fxprep (see the module docstring).

    Args:
        model: The model as the pipeline has it (offloading wrappers and hooks in place).
        sample_input: The first calibration batch (a dict of the model's keyword arguments).
        sequential_targets: Module class names or ``re:`` patterns, as llm-compressor takes them.
        ignore: llm-compressor's ``tracing_ignore``: the functions the fx capture calls whole (Dynamo, where fx fails, traces them).
        targets_per_subgraph: How many targets one subgraph holds.

    Returns:
        One :class:`FxprepSubgraph` per stage, in order; :func:`last_capture` holds the capture.

    Raises:
        InvalidInput: No module matches ``sequential_targets`` (the message lists the model's classes).
        ModelError: The model itself fails on the sample.
        TraceFailure: fxprep could not capture the model (its diagnosis: module, file:line, fix).
        EquivalenceError: The graph does not compute what the model does on the sample.
        PassFailure: The graph could not be bound back to the model's own modules (a bug in fxprep).
    """
    from compressed_tensors.utils.match import match_named_modules

    if sequential_targets in (ALL, [ALL]):  # the model declares no blocks (no _no_split_modules)
        targets = repeated_blocks(model)
    else:
        targets = [(name, module) for name, module in match_named_modules(model, sequential_targets)]
    targets = [(n, m) for n, m in targets if not any(n.startswith(o + ".") for o, _ in targets)]  # outermost
    if not targets:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise InvalidInput(f"no module of {type(model).__name__} matches sequential_targets={sequential_targets!r}; "
                           f"its module classes: {', '.join(classes)}.")
    with calibration_context(model):
        ancestors = _ancestors(model, {id(m) for _, m in targets})
        whole = _kept_whole(model, ancestors)
        functions = ignored_functions(model, ancestors, ignore) + family_for(model).called_whole(model)
        # fx runs none of the modules kept whole: on meta, their twins need nothing inside them
        twin = plain_twin(model, shallow={id(m) for m in whole})
        try:  # torch.fx first: what llm-compressor's tracer does, at its cost; checked as the Dynamo graph is
            capture = _stages(model, twin, _made(Route.FX, twin, whole, sample_input, functions), targets,
                              sample_input, targets_per_subgraph)
        except FxprepError as err:  # any failure of the fx graph: Dynamo's capture, which diagnoses its own
            twin = twin if twin.real else plain_twin(model)  # Dynamo runs the modules kept whole (on meta, for shapes)
            capture = _stages(model, twin, _made(Route.DYNAMO, twin, whole, sample_input), targets, sample_input,
                              targets_per_subgraph)
            capture.report.note(f"torch.fx was tried first (the code around the sequential targets, tracing_ignore's "
                                f"functions called whole) and not kept: {_first_reason(err)}")
    subgraphs = capture.subgraphs
    _log(capture)
    return subgraphs


def _first_reason(err: Exception) -> str:
    """What stopped fx: its failed attempt as the report describes it, or the error's first line."""
    failed = [a for a in getattr(err, "attempts", []) if a.error]
    why = f"{failed[0].tracer}: {failed[0].error}" if failed else (str(err).strip().splitlines() or [type(err).__name__])[0]
    return why[:400]


def _made(tracer: Route, twin: Twin, whole: list[nn.Module], sample_input: Mapping[str, Any],
          functions: tuple[Any, ...] = ()) -> Made:
    """How ``twin`` is captured with ``tracer``: the twins of the model's modules kept ``whole``; for
    Dynamo on meta, each of them runs :func:`_shaped_like_input` (fx runs none of them)."""
    twins = [twin.twin_of[id(m)] for m in whole]
    made = Made(tracer, twins, _example(twin.root, sample_input, twin.device), [], functions)
    if tracer.dynamo and not twin.real:
        names = {id(m): n for n, m in twin.root.named_modules()}
        for module in twins:
            module.__dict__["forward"] = _shaped_like_input(module, names[id(module)], made.stood_in)
    return made


@dataclass
class Made:
    """How one capture of the twin is made: the tracer, the modules kept whole, the example, the
    names of those that could not run on meta (filled as they run), the functions fx calls whole."""

    tracer: Route
    whole: list[nn.Module]
    example: dict[str, Any]
    stood_in: list[str]
    functions: tuple[Any, ...] = ()


def _stages(model: nn.Module, twin: Twin, made: Made, targets: list[tuple[str, nn.Module]],
            sample_input: Mapping[str, Any], targets_per_subgraph: int) -> Capture:
    """The twin captured with ``made.tracer`` (verified where it holds the model's weights), bound to
    the model, cut into subgraphs, and checked on the model itself where it was captured on meta.
    Called in :func:`calibration_context`."""
    options: dict[str, Any] = {"tracer": made.tracer.value}
    if not made.tracer.dynamo:  # torch.fx, the whole graph or nothing: a part kept opaque would hide targets
        options.update(fallback="error", autowrap_functions=made.functions)
    # unroll=False: a layer called several times (a recurrent model's cycles) stays the model's one
    # module at every call, so its hooks see every call as in eager (an unrolled copy has none).
    # convert_functionals=False: the code around the targets (masks, positions) is nothing a modifier
    # compresses; llm-compressor's own subgraphs leave it as functions too.
    gm = api.prepare_model(twin.root, made.whole, example_inputs=made.example, verify=twin.real, progress=False,
                           name=type(model).__name__, unroll=False, convert_functionals=False, **options)
    report = api.get_report(gm)
    not_run = _targets_called(gm, [name for name, _ in targets], report)
    targets = [(name, module) for name, module in targets if name not in not_run]
    bind_to_model(gm, twin)
    stages = partition(gm, targets=[name for name, _ in targets], blocks_per_stage=targets_per_subgraph,
                       between="previous")
    subgraphs = _subgraphs(stages, model, tuple(made.example), gm)
    capture = Capture(gm, report, twin, subgraphs, stood_in=made.stood_in, not_run=not_run, targets=targets,
                      shape=_shape(made.example))
    for sub in subgraphs:
        sub.capture = capture
    if not twin.real:  # captured on meta stand-ins: checked on the model itself, its weights onloaded as they run
        capture.check = _check_on_model(model, subgraphs, sample_input, targets)
    LAST[:] = [capture]
    return capture


def ignored_functions(root: nn.Module, ancestors: set[int], ignore: Any) -> tuple[Any, ...]:
    """The functions llm-compressor's ``tracing_ignore`` names (the mask builders), as the modules
    of the ancestors' ``forward`` code bind them: fx calls them whole, so they run as eager runs
    them, on the values the graph computes. Names of methods (``_update_causal_mask``) are no
    module-level function and stay traced; a failure there sends the capture to Dynamo."""
    names = {ignore} if isinstance(ignore, str) else set(ignore or ())
    found: dict[int, Any] = {}
    for module in root.modules():
        if module is not root and id(module) not in ancestors:
            continue
        code = inspect.getmodule(inspect.unwrap(type(module).forward))
        for name in names:
            fn = getattr(code, name, None)
            if inspect.isfunction(fn):
                found.setdefault(id(fn), fn)
    return tuple(found.values())


def _shaped_like_input(module: nn.Module, name: str, stood_in: list[str]) -> Any:
    """The twin's ``module`` (kept whole, on ``meta``) as a Dynamo capture runs it for the shapes of
    what it returns: its own forward, or where that cannot run on ``meta`` (a mixture-of-experts
    layer's routing reads values: ``nonzero``, ``.item()``) a tensor shaped like its first tensor
    argument, what a decoder layer returns. Only shapes are taken from it, and the stages are then
    checked on the model itself where its weights can be had (:func:`_check_on_model`). The fx
    capture runs none of them."""
    forward = type(module).forward

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(module, *args, **kwargs)
        except (RuntimeError, NotImplementedError):
            first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
            if first is None:
                raise
            if name not in stood_in:
                stood_in.append(name)
            return torch.empty_like(first)

    return run


def _targets_called(gm: Any, names: list[str], report: Report) -> list[str]:
    """Each target must be one call of the graph, unless the sample does not run it (a VLM's vision
    blocks with text alone): returns those. A target inside a part fxprep could not capture and had to
    keep whole (the report's diagnosis says why) cannot be a stage: refused."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    lost = [n for n in names if n not in called]
    opaque = {p: why for p, why in report.leaves.items() if why != "modules_to_exclude"}  # fxprep's fallback's
    holders = sorted({p for p in opaque for t in lost if t.startswith(p + ".")})
    if holders:
        inside = [t for t in lost if any(t.startswith(p + ".") for p in holders)]
        raise TraceFailure(f"the sequential targets {inside[:4]}{' ...' if len(inside) > 4 else ''} are inside "
                           f"{', '.join(holders)}, which fxprep kept whole ({'; '.join(opaque[h] for h in holders)}), so "
                           "the stages cannot be cut there. Fix the code fxprep names below, or choose "
                           f"sequential_targets outside that part.\n{report}")
    return lost


def _check_on_model(model: nn.Module, subgraphs: list[FxprepSubgraph], sample: Mapping[str, Any],
                    targets: list[tuple[str, nn.Module]]) -> Difference | None:
    """The stages against the model itself on the first batch, every target's inputs and outputs
    (:func:`.reproduce.compare_subgraphs`); None where the model holds no values (on ``meta``)."""
    if not _holds_values(model):
        return None
    with calibration_context(model):
        found = compare_subgraphs(model, subgraphs, dict(sample), targets)
    if not found.equal:
        raise EquivalenceError(f"fxprep's stages do not reproduce {type(model).__name__} on the first calibration "
                               f"batch: {found}.", max_abs_diff=found.max_abs_diff)
    return found


def _holds_values(model: nn.Module) -> bool:
    """Whether every tensor of the model can be had: stored, or on disk behind an offloading
    wrapper (compressed-tensors' disk cache, accelerate's weights map), not a bare ``meta`` one."""
    from .twin import stored_tensors

    for module in model.modules():
        if getattr(module._parameters, "offload_device", None) == "disk":
            continue
        hook = getattr(module, "_hf_hook", None)
        if getattr(hook, "weights_map", None) is not None:
            continue
        for mapping in (module._parameters, module._buffers):
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in stored_tensors(mapping).values()):
                return False
    return True


def _log(capture: Capture) -> None:
    from loguru import logger

    report = capture.report
    checked = (f"verified against the model ({report.verification.status}, max |diff| {report.verification.max_abs_diff})"
               if capture.twin.real else
               f"captured on meta stand-ins; stages checked on the model: {capture.check}" if capture.check is not None
               else "captured on meta stand-ins; not checked (the model's weights are on meta)")
    if capture.not_run:
        checked += (f"; {len(capture.not_run)} sequential target(s) do not run on the first batch and have no stage "
                    f"({capture.not_run[0]}, ...)")
    if capture.stood_in:
        checked += (f"; {len(capture.stood_in)} module(s) kept whole could not run on meta ({capture.stood_in[0]}, ...): "
                    "their outputs were taken to be shaped like their first input")
    logger.info(f"fxprep: {report.model} captured by {report.tracer} in {report.timings.get('total', 0):.2f}s, "
                f"{len(capture.subgraphs)} subgraphs; {checked}. fxprep.compat.llmcompressor.last_capture().report "
                "has the whole report.")


def _subgraphs(stages: Stages, model: nn.Module, batch_keys: tuple[str, ...], gm: Any) -> list[FxprepSubgraph]:
    placeholders = set(stages.placeholders)
    later = {n for stage in list(stages)[1:] for n in stage.inputs if n in placeholders}
    out = [FxprepSubgraph(stages[0], model, stages, batch_keys, tuple(sorted(later)), gm)]
    out += [FxprepSubgraph(stage, model) for stage in list(stages)[1:]]
    seen: set[str] = set()
    for sub in reversed(out):  # what no later subgraph reads (llm-compressor's trace_consumed_names)
        sub.consumed_names = sub.input_names - seen
        seen |= sub.input_names
    return out
