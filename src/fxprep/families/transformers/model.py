"""transformers specifics: cache off, attention implementation, example inputs from the config.

Nothing here imports ``transformers`` unless the model already is a transformers model (the
module is looked up in ``sys.modules``), so fxprep works without it installed.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...capture.common import CaptureResult
from ...capture.routes import Route
from ...core.inputs import ExampleInputs
from ...reporting.report import CaptureAttempt
from .attention import VALUE_DEPENDENT, WINDOW_LIMIT, WINDOWED, eager_attention_paths
from .methods import rewritten_methods

CAPTURE_ATTENTION = ("eager", "sdpa")


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers)."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    return base is not None and isinstance(model, base)


def hf_submodels(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers models in ``model`` (``model`` itself when it is one): a user's
    wrapper around a VLM (returning only its logits, say) runs transformers' code all the same."""
    if is_hf_model(model):
        return [model]
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if is_hf_model(child):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def _forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def capture_concrete_args(model: nn.Module, concrete_args: dict[str, Any] | None, example: Any) -> dict[str, Any] | None:
    """``concrete_args`` plus ``use_cache=False`` for transformers models whose forward takes
    ``use_cache`` and where the user fixed it nowhere: a KV cache is not part of a graph to quantize,
    and ``DynamicCache`` outputs cannot be captured. The original is verified with the same value."""
    if not is_hf_model(model):
        return concrete_args
    params = _forward_params(model)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if "use_cache" not in params and not (takes_kwargs and getattr(text, "use_cache", None) is not None):
        return concrete_args  # (Llava's forward takes use_cache through **kwargs)
    given = set(concrete_args or {})
    if example is not None:
        given |= set(getattr(example, "kwargs", {}) or {})
    if "use_cache" in given:
        return concrete_args
    return {**(concrete_args or {}), "use_cache": False}


# What a transformers model captured with use_cache=False does not return that the original may
# (the output is named ``cache`` from transformers 5.24 on, ``past_key_values`` before).
ABSENT_WITHOUT_CACHE = {"past_key_values": "captured with use_cache=False", "cache": "captured with use_cache=False"}
CACHE_OFF_NOTE = (
    "transformers model captured with use_cache=False (fxprep's default when you do not fix use_cache): a KV "
    "cache is not part of a graph to quantize, and Dynamo cannot capture cache objects. The prepared module "
    "returns no past_key_values (or cache) where the original, called with its default use_cache=True, does; "
    "verification compares everything else and states this difference. Pass concrete_args={'use_cache': "
    "False} to say you expect it."
)


def absent_outputs(user_concrete: dict[str, Any] | None, concrete: dict[str, Any] | None) -> dict[str, str]:
    """``{output key: why}`` the prepared module will not return although the original may: what
    :func:`capture_concrete_args` added (``use_cache=False``) and the user did not ask for."""
    if "use_cache" in (concrete or {}) and "use_cache" not in (user_concrete or {}):
        return dict(ABSENT_WITHOUT_CACHE)
    return {}


def without_added(concrete: dict[str, Any] | None, absent: dict[str, str]) -> dict[str, Any] | None:
    """``concrete`` without what fxprep added on its own (how the user calls the original)."""
    if not absent or not concrete:
        return concrete
    return {k: v for k, v in concrete.items() if k != "use_cache"} or None


def _configs(model: nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    out = [config]
    for name in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.append(sub)
    return out


@contextlib.contextmanager
def capture_context(model: nn.Module, notes: list[str] | None = None,
                    example: ExampleInputs | None = None, dynamic_length: int | None = None) -> Iterator[None]:
    """During capture: attention implementations Dynamo cannot capture (flash, flex, paged) are
    switched to ``sdpa``, and transformers' output-capturing hooks are marked installed
    (:func:`_hooks_flagged`); both are put back afterwards. transformers' mask and attention code
    takes eager's branch where that is static for ``example``'s structure (:mod:`.attention`;
    ``dynamic_length``: the example's sequence length where one is declared dynamic, which decides a
    local attention window's mask). Methods whose source takes another path under a trace for a
    reason plain from the source run a rewritten copy (:mod:`.methods`: a check's message built
    lazily, a padding mask the model fills with ones itself given to the mask builder as none).
    Also for a model that wraps
    transformers models (:func:`hf_submodels`); a no-op for other models."""
    submodels = hf_submodels(model)
    if not submodels:
        yield
        return
    changed: list[tuple[Any, Any]] = []
    flagged: list[nn.Module] = []
    try:
        flagged = _hooks_flagged(model)
        configs = {id(c): c for m in submodels for c in _configs(m)}
        for config in configs.values():
            impl = getattr(config, "_attn_implementation", None)
            if impl is not None and impl not in CAPTURE_ATTENTION:
                changed.append((config, impl))
                config._attn_implementation = "sdpa"
        if changed and notes is not None:
            notes.append(
                f"attention implementation {changed[0][1]!r} cannot be captured; captured with 'sdpa' instead."
            )
        given = example is None or example.kwargs.get("position_ids") is not None or len(example.args) > 2
        masked = example is not None and isinstance(example.kwargs.get("attention_mask"), torch.Tensor)
        if masked and notes is not None and any(getattr(c, "_attn_implementation", None) == "sdpa"
                                                for c in configs.values()):
            notes.append(VALUE_DEPENDENT)
        windows: list[tuple[int, bool]] = []
        with eager_attention_paths(positions_given=given, length=dynamic_length, windows=windows), \
                rewritten_methods(model):
            yield
        for masked, text in ((True, WINDOWED), (False, WINDOW_LIMIT)):
            met = sorted({w for w, m in windows if m is masked})
            if met and notes is not None:
                notes.append(text.format(windows=", ".join(map(str, met)), longest=met[-1]))
    finally:
        for config, impl in changed:
            config._attn_implementation = impl
        for m in flagged:
            m.__dict__.pop(_HOOKS_FLAG, None)


_HOOKS_FLAG = "_output_capturing_hooks_installed"
_INSTALLED: list[dict[int, nn.Module]] = []  # per prepare in progress: the submodels whose hooks it installed


@contextlib.contextmanager
def output_capturing_hooks(model: Any) -> Iterator[None]:
    """For as long as fxprep works on a transformers ``model``: its output-capturing hooks are
    installed once, by the first run that needs them, as transformers would; never a second time.

    Why: transformers 5 installs these hooks on a model's first call that collects hidden states or
    attentions (``maybe_install_capturing_hooks``) and marks the model with a flag, the installation
    under a ``threading.Lock`` that Dynamo cannot trace ("Unsupported context manager"). fxprep puts
    the model back as it was after each of its runs: the flag went, the hooks stayed, so every later
    eager run installed them again (hidden states recorded twice) and the capture stopped at the
    lock: a Llava or Mistral3 built and handed straight to ``prepare_model`` could not be prepared.
    Here the installer remembers what it installed (by identity, not by the flag), and
    :func:`capture_context` sets the flag on those submodels while Dynamo traces, so the lock is
    never reached. :func:`fxprep.core.runs.hooks_left_as_found` takes the hooks out at the end."""
    installer = None
    if isinstance(model, nn.Module) and hf_submodels(model):
        with contextlib.suppress(ImportError):
            from transformers.utils import output_capturing

            installer = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if installer is None:
        yield
        return
    installed: dict[int, nn.Module] = {}
    ours = {id(m) for m in model.modules()}  # another thread's models get transformers' own behaviour

    def install_once(submodel: nn.Module) -> None:
        if id(submodel) not in ours:
            installer(submodel)
            return
        if getattr(submodel, _HOOKS_FLAG, False) or id(submodel) in installed:
            return
        installer(submodel)
        installed[id(submodel)] = submodel

    output_capturing.maybe_install_capturing_hooks = install_once
    _INSTALLED.append(installed)
    try:
        yield
    finally:
        _INSTALLED.remove(installed)
        if output_capturing.maybe_install_capturing_hooks is install_once:
            output_capturing.maybe_install_capturing_hooks = installer
        for submodel in installed.values():
            submodel.__dict__.pop(_HOOKS_FLAG, None)


def stopped_at_hook_installation(err: BaseException) -> bool:
    """Whether Dynamo's failure ``err`` is transformers' hook installer (its ``threading.Lock``,
    "Unsupported context manager"), reached because no run before the capture installed the hooks:
    ``prepare_model(verify=False)`` and ``check_traceability`` capture a never-called model without
    a reference run. Told by the frame's file (transformers' own ``output_capturing`` module) and
    function, from Dynamo's user stack."""
    module = sys.modules.get("transformers.utils.output_capturing")
    filename = getattr(module, "__file__", None)
    stack = getattr(err, "real_stack", None) or getattr(err.__context__, "real_stack", None) or []
    return filename is not None and any(
        getattr(f, "filename", None) == filename and getattr(f, "name", None) == "maybe_install_capturing_hooks"
        for f in stack)


def install_hooks_by_running(model: nn.Module, call: ExampleInputs) -> None:
    """Run ``model`` once on ``call`` (no grad, its state put back), as the user's first call would,
    so that transformers installs its output-capturing hooks before Dynamo traces: the installer
    of :func:`output_capturing_hooks` remembers them and :func:`capture_context` flags them, and
    :func:`fxprep.core.runs.hooks_left_as_found` takes them out at the end."""
    from ...core.runs import preserved_state, run_model

    with preserved_state(model):
        run_model(model, call)


def _hooks_flagged(model: nn.Module) -> list[nn.Module]:
    """The flag set, for a capture, on the submodels whose hooks :func:`output_capturing_hooks`
    installed and lacking it now; returns those, to take it off again."""
    mine = {k: m for installed in _INSTALLED for k, m in installed.items()}
    flagged = [m for m in model.modules() if id(m) in mine and not getattr(m, _HOOKS_FLAG, False)] if mine else []
    for m in flagged:
        m.__dict__[_HOOKS_FLAG] = True
    return flagged


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def example_inputs_for(model: nn.Module, batch: int = 2, seq_len: int = 8, *,
                       device: torch.device | str | None = None) -> dict[str, torch.Tensor] | None:
    """Keyword example inputs built from a transformers model's config (None for other models):
    ``input_ids``/``attention_mask``, ``pixel_values``, ``input_values``, ``input_features``,
    ``decoder_input_ids``, whichever its forward takes, on ``device`` (the model's by default;
    the CPU keeps the values of inputs for a model on ``meta``)."""
    if not is_hf_model(model):
        return None
    config = model.config
    params = _forward_params(model)
    main = getattr(model, "main_input_name", "input_ids")
    if main not in params and "pixel_values" in params and "input_ids" not in params:
        main = "pixel_values"  # a vision encoder that kept the library's default name (DeepSeek-OCR 2's SAM tower)
    if device is None:
        tensor = next(model.parameters(), None)
        device = tensor.device if tensor is not None else torch.device("cpu")
    text = _get(config, "text_config", default=config)
    vision = _get(config, "vision_config", default=config)
    vocab = int(_get(text, "vocab_size", default=100) or 100)
    inputs: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def ids(length: int) -> torch.Tensor:
        low = 1 if vocab > 2 else 0
        return torch.randint(low, max(vocab, low + 1), (batch, length), generator=gen).to(device)

    if main == "input_ids" or ("input_ids" in params and main not in params):
        inputs["input_ids"] = ids(seq_len)
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    # Vision models, and text-image models (CLIP) whose forward needs both towers' inputs.
    if main == "pixel_values" or ("pixel_values" in params and _get(config, "vision_config") is not None):
        size = _get(vision, "image_size", default=32)
        if isinstance(size, dict):
            size = (size.get("height", 32), size.get("width", size.get("height", 32)))
        height, width = (size[0], size[-1]) if isinstance(size, (tuple, list)) else (size, size)  # MGP-STR: 32x128
        channels = int(_get(vision, "num_channels", default=3))
        inputs["pixel_values"] = torch.randn(batch, channels, int(height), int(width), generator=gen).to(device)
    if main == "input_values":
        inputs["input_values"] = torch.randn(batch, 1600, generator=gen).to(device)
    if main == "input_features":
        audio = _get(config, "audio_config", "encoder_config", default=config)  # Parakeet/Canary: the encoder's
        bins = int(_get(config, "num_mel_bins", "feature_size", default=None) or _get(audio, "num_mel_bins", default=80))
        frames = int(_get(config, "max_source_positions", default=1500)) * 2
        inputs["input_features"] = torch.randn(batch, bins, frames, generator=gen).to(device)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = ids(max(2, seq_len // 2))
    return inputs or None


def hf_symbolic_trace(model: nn.Module, input_names: list[str] | None = None) -> Any:
    """transformers < 5's own fx tracer when it exists (it was removed in transformers 5), else None."""
    try:
        from transformers.utils.fx import symbolic_trace  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - absent in transformers 5, or transformers not installed
        return None
    return symbolic_trace(model, input_names=input_names)


def capture_hf_fx(model: nn.Module, example: ExampleInputs | None) -> tuple[CaptureResult | None, CaptureAttempt | None]:
    """One more fx-path option for ``transformers < 5``: its own ``HFTracer`` knows that library's
    dynamic code (masks, ``len()`` of shapes) better than a generic tracer. ``(None, None)`` when it
    does not apply (not a transformers model, or transformers 5, which removed
    ``transformers.utils.fx``)."""
    if not is_hf_model(model):
        return None, None
    try:
        import transformers.utils.fx  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # noqa: BLE001 - transformers' fx module failing to import means it has none
        return None, None
    names = list(example.kwargs) if example is not None and example.kwargs else None
    if names is None and example is not None and example.args:
        names = list(_forward_params(model))[: len(example.args)]
    start = time.perf_counter()
    try:
        gm = hf_symbolic_trace(model, input_names=names)
    except Exception as err:  # noqa: BLE001 - reported like every tracer failure
        return None, CaptureAttempt.failed(Route.HF_FX, err, start)
    note = "traced with transformers.utils.fx.symbolic_trace (transformers < 5's HFTracer)."
    return CaptureResult(gm, Route.FX, notes=[note]), CaptureAttempt(Route.HF_FX, True, time.perf_counter() - start)


__all__ = [
    "absent_outputs",
    "hf_submodels",
    "capture_concrete_args",
    "capture_context",
    "capture_hf_fx",
    "example_inputs_for",
    "hf_symbolic_trace",
    "is_hf_model",
    "without_added",
]
