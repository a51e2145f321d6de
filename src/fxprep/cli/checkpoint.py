"""``fxprep prepare path/to/checkpoint``: the user's own transformers checkpoint (issue 27, item 5).

A local directory with ``config.json`` and safetensors weights (one file or shards, as
``save_pretrained`` writes them). The model class is the config's first ``architectures`` entry
(``LlamaForCausalLM``), else the causal-LM or base auto class. Two ways to prepare:

* default: ``from_pretrained`` in ``--dtype`` onto ``--device``, then ``prepare_model`` verifies;
* ``--meta``: the model built on ``meta`` from the config alone (no weights in memory), prepared
  without verification, then :func:`fxprep.load_weights` reads the checkpoint shard by shard onto
  ``--device`` and :func:`fxprep.verify_prepared` compares with the original, now real. This is how
  a 7B-70B model is prepared on a machine that holds its weights once.

Example inputs are those :mod:`.examples` finds the model runs on (16 tokens below the vocabulary
size; a dual encoder's image too), tried on ``meta``; ``--input`` overrides. Everything else
(``--dynamic``, ``-o``, ``--onnx``, ``--show``) is the command's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import examples
from .specs import BuiltModel, SpecError, inputs_from_strings, model_types
from .validate import CHECKPOINT_DTYPES, check_choice, did_you_mean

DTYPES = {name: None if torch_name is None else getattr(torch, torch_name) for name, torch_name in CHECKPOINT_DTYPES.items()}


def parse_dtype(text: str | None) -> torch.dtype | None:
    if text is None:
        return None
    check_choice("--dtype", text.lower(), DTYPES)
    return DTYPES[text.lower()]


def parse_device(text: str | None) -> torch.device:
    try:
        device = torch.device(text or "cpu")
    except RuntimeError as err:
        raise SpecError(f"--device {text!r} is not a device torch knows ({err}).") from err
    if device.type == "meta":
        raise SpecError("--device meta cannot hold the weights; use --meta to prepare without them.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecError(f"--device {text}: this machine has no CUDA device torch can use.")
    return device


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            auto._model_mapping[type(config)]  # noqa: B018 - raises KeyError when the auto class has no model
        except KeyError:
            continue
        return auto
    raise SpecError(f"transformers has no model class for this checkpoint's config ({type(config).__name__}).")


def _config(directory: Path) -> Any:
    """The checkpoint's config; a usage error (exit 2) naming the model type when transformers does not
    know it (a newer model than this transformers, or one that needs its own code)."""
    import transformers

    raw = json.loads((directory / "config.json").read_text())
    model_type = str(raw.get("model_type"))
    known = model_types()
    if model_type not in known:
        raise SpecError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not one transformers {transformers.__version__} "
            f"knows.{did_you_mean(model_type, known)} A model newer than this transformers needs a newer one "
            f"(pip install -U transformers); one whose code ships with the checkpoint (trust_remote_code) is "
            f"not built by fxprep: build it in a Python file and give path/to/file.py:Factory.")
    try:
        return transformers.AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise SpecError(f"{directory / 'config.json'}: transformers cannot read it ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else err})") from err


def _checkpoint_dtype(path: Path) -> torch.dtype:
    raw = json.loads((path / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).removeprefix("torch."), torch.float32) or torch.float32


def _inputs(texts: list[str], config: Any, model: nn.Module, meta_twin: Callable[[], nn.Module],
            device: torch.device) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """``--input`` strings, else what :mod:`.examples` finds the model runs on (tried on ``meta``:
    the model itself with ``--meta``, else a twin built from the config), else 1x16 token ids; and
    the sets guessed (none when ``texts`` named the inputs)."""
    text_config = getattr(config, "text_config", None) or config
    high = int(getattr(text_config, "vocab_size", 0) or 100)
    if texts:
        return _to(inputs_from_strings(texts, high=high), device), []
    options = examples.candidates(model, seq_len=16)
    if len(options) > 1:
        probe = model if examples.device_of(model).type == "meta" else meta_twin()
        inputs = examples.choose(options, probe)
    else:
        inputs = options[0] if options else None
    if inputs is None:
        inputs = {"input_ids": torch.randint(0, high, (1, 16), generator=torch.Generator().manual_seed(0))}
        options = [inputs]
    return _to(inputs, device), options


def _to(inputs: Any, device: torch.device | str) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return tuple(v.to(device) for v in inputs)


def build(path: str, texts: list[str], *, meta: bool, device: str | None, dtype: str | None) -> BuiltModel:
    """The checkpoint's model (on ``meta`` with ``meta``) and its example inputs on ``device``."""

    directory = Path(path)
    config = _config(directory)
    cls = _model_class(config)
    target = parse_device(device)
    chosen = parse_dtype(dtype) or _checkpoint_dtype(directory)

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return (cls.from_config(config, dtype=chosen) if hasattr(cls, "from_config") and cls.__name__.startswith("Auto")
                    else cls._from_config(config, dtype=chosen)).eval()

    if meta:
        model = on_meta()
        note = f"built on meta from {directory / 'config.json'} ({chosen}); weights loaded after preparing"
    else:
        model = cls.from_pretrained(directory, dtype=chosen).to(target).eval()
        note = f"weights from {directory} ({chosen}, {target})"
    inputs, options = _inputs(texts, config, model, on_meta, target)
    return BuiltModel(f"{cls.__name__} from {directory}", model, inputs, note, options)


def prepare(built: BuiltModel, path: str, *, meta: bool, device: str | None, dtype: str | None,
            modules_to_exclude: list[Any] | None, classes: list[type] | None, options: dict[str, Any],
            clock: Any = None) -> nn.Module:
    """``prepare_model`` on the checkpoint's model; with ``meta``, then ``load_weights`` from ``path``
    (its tensors cast to the dtype the model was built in: ``--dtype``, else the checkpoint's own)
    and ``verify_prepared`` (unless ``options['verify']`` is false) on the real inputs. ``clock``
    (:class:`.prepare.Clock`) is told each phase."""
    import fxprep

    def lap(phase: str) -> None:
        if clock is not None:
            clock.lap(phase)

    explained = examples.inputs_explained(built.name, built.model, built.input_options)
    if not meta:
        with explained:
            gm = fxprep.prepare_model(built.model, modules_to_exclude, classes,
                                      example_inputs=built.example_inputs, **options)
        lap("prepare_model")
        return gm
    verify = options.pop("verify", True)
    options.pop("verify_inputs", None)
    with explained:
        gm = fxprep.prepare_model(built.model, modules_to_exclude, classes,
                                  example_inputs=_to(built.example_inputs, "meta"), verify=False, **options)
    lap("prepare_model")
    # --dtype bfloat16 on a float32 checkpoint: the model was built in bfloat16, so its weights are
    # cast as they are read (from_pretrained does the same without --meta)
    fxprep.load_weights(gm, path, device=parse_device(device), dtype=parse_dtype(dtype) or _checkpoint_dtype(Path(path)))
    lap("loading weights")
    if verify:
        fxprep.verify_prepared(gm, built.example_inputs)
        lap("verifying")
    return gm
