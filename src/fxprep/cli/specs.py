"""Model specs: a model and inputs it accepts from one short string, offline.

``torchvision:resnet50``, ``timm:convnext_atto``, ``transformers:bert``, ``path/to/file.py:Factory``
and ``demo:ModelWithReusedReLU`` name a model; ``--input`` strings (``1x3x224x224``,
``input_ids=1x8:int64``) name its inputs. Weights are never downloaded (``weights=None``,
``pretrained=False``, transformers from a tiny config), and each family gets inputs of the size its
models need (detectors take a list of images, video models a clip, RAFT two frames).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import examples
from .demo import DEMOS
from .tiny import tiny_configs
from .validate import SPEC_FORMS, SpecError, did_you_mean

ZOOS = ("torchvision", "timm", "transformers", "demo")
__all__ = ["SpecError", "BuiltModel", "resolve", "parse_input", "inputs_from_strings", "zoo_specs"]


@dataclass
class BuiltModel:
    """A model ready for ``prepare_model``: the module, example inputs, and a display name."""

    name: str
    model: nn.Module
    example_inputs: Any
    note: str = ""
    #: the input sets guessed from a transformers config, the given one among them (empty when the
    #: user named the inputs): what :func:`examples.inputs_explained` tries when preparing fails
    input_options: list[dict[str, torch.Tensor]] = field(default_factory=list)


# --- inputs --------------------------------------------------------------------------------------
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64, "long": torch.int64,
           "int32": torch.int32, "int": torch.int64, "bool": torch.bool}


_INPUT_RE = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dims>\d+(?:x\d+)*)(?::(?P<dtype>\w+))?$")
# No real input has a dimension of more than 12 digits; longer ones would reach Python's limit on
# converting long digit strings (4300 digits: a ValueError from int()) or overflow torch's int64 sizes.
_MAX_DIM_DIGITS = 12


def parse_input(text: str, *, high: int = 100) -> tuple[str | None, torch.Tensor]:
    """``1x3x224x224`` → a random float tensor; ``input_ids=1x8:int64`` → a keyword input of random
    integers below ``high``."""
    m = _INPUT_RE.match(text.strip())
    if m is None:
        raise SpecError(
            f"cannot read input {text!r}: write DIMS[:DTYPE] or NAME=DIMS[:DTYPE], e.g. 1x3x224x224 or input_ids=1x16:int64."
        )
    dims = m["dims"].split("x")
    if len(dims) > 64 or any(len(d.lstrip("0")) > _MAX_DIM_DIGITS for d in dims):
        raise SpecError(
            f"input {text[:80]!r}{'...' if len(text) > 80 else ''} has a dimension of more than {_MAX_DIM_DIGITS} "
            f"digits (or more than 64 dimensions); give the sizes of one real input, e.g. 1x3x224x224."
        )
    shape = tuple(int(d) for d in dims)
    dtype = _DTYPES.get(m["dtype"] or "float32")
    if dtype is None:
        raise SpecError(f"unknown dtype {m['dtype']!r} in input {text!r}; known: {', '.join(sorted(_DTYPES))}.")
    numel = math.prod(shape)
    need = numel * max(torch.empty((), dtype=dtype).element_size(), 4)  # float inputs are drawn in fp32
    if need > memory_bytes() // 2:
        raise SpecError(
            f"input {text!r} has {numel:,} elements ({_bytes(need)}), more than half of this machine's memory "
            f"({_bytes(memory_bytes())}); give the sizes of one real input, e.g. 1x3x224x224."
        )
    gen = torch.Generator().manual_seed(0)
    try:
        if dtype.is_floating_point:
            tensor = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            tensor = torch.ones(shape, dtype=torch.bool)
        else:
            tensor = torch.randint(0, high, shape, generator=gen, dtype=dtype)
    except (RuntimeError, MemoryError) as err:
        raise SpecError(f"cannot make input {text!r} ({_bytes(need)}): {type(err).__name__}: {err}") from err
    return m["name"], tensor


def memory_bytes() -> int:
    """This machine's physical memory (1 TiB when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 40


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def inputs_from_strings(texts: Iterable[str], *, high: int = 100) -> Any:
    """Several ``--input`` strings → a tuple of positional tensors or a dict of keyword tensors
    (integer tensors drawn below ``high``: token ids below the vocabulary size)."""
    parsed = [parse_input(t, high=high) for t in texts]
    named = [n for n, _ in parsed if n]
    if named and len(named) != len(parsed):
        raise SpecError("mix of named and positional --input values: name all of them or none.")
    if named:
        return {n: t for n, t in parsed}
    return tuple(t for _, t in parsed)


# --- torchvision -----------------------------------------------------------------------------------
def _image(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def torchvision_models() -> list[str]:
    from torchvision import models

    return sorted(models.list_models())


def _torchvision(name: str) -> BuiltModel:
    from torchvision import models

    known = models.list_models()
    if name not in known:
        raise SpecError(f"torchvision has no model {name!r}.{did_you_mean(name, known)} ({len(known)} models: "
                        f"python -c 'import torchvision; print(torchvision.models.list_models())' lists them.)")
    kwargs: dict[str, Any] = {"weights": None}
    detection = name in models.list_models(module=models.detection)
    if detection or name in models.list_models(module=models.segmentation):
        kwargs["weights_backbone"] = None
    if name in models.list_models(module=models.quantization):
        kwargs["quantize"] = False
    if name in ("googlenet", "inception_v3", "quantized_googlenet", "quantized_inception_v3"):
        kwargs["init_weights"] = True  # silences the "default init will change" warning
    model = models.get_model(name, **kwargs).eval()
    if detection:
        size = 320 if "320" in name else 224
        return BuiltModel(f"torchvision:{name}", model, ([_image(3, size, size)],), "eval mode, a list of one image")
    if name in models.list_models(module=models.video):
        t, hw = (16, 224) if name.startswith("mvit") else (8, 112)
        if name == "s3d":
            t, hw = 16, 224
        return BuiltModel(f"torchvision:{name}", model, (_image(1, 3, t, hw, hw),), f"clip 1x3x{t}x{hw}x{hw}")
    if name in models.list_models(module=models.optical_flow):
        return BuiltModel(f"torchvision:{name}", model, (_image(1, 3, 128, 128), _image(1, 3, 128, 128)), "two frames")
    size = 299 if "inception" in name else 224
    return BuiltModel(f"torchvision:{name}", model, (_image(1, 3, size, size),))


# --- timm ------------------------------------------------------------------------------------------
TIMM_SURVEY = (
    "resnet18", "resnet50d", "convnext_atto", "efficientnet_b0", "mobilenetv3_small_100", "vit_tiny_patch16_224",
    "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "regnetx_002", "densenet121", "mixer_b16_224",
    "convmixer_768_32", "levit_128s", "poolformer_s12", "coat_lite_tiny", "edgenext_xx_small", "mobilevit_xxs",
    "ghostnet_100", "rexnet_100", "dla34", "hrnet_w18_small", "cspresnet50", "dpn68", "tf_efficientnetv2_b0",
    "repvgg_a0", "mobileone_s0", "fastvit_t8", "efficientformer_l1", "maxvit_nano_rw_256", "eva02_tiny_patch14_224",
)


def _timm(name: str) -> BuiltModel:
    import timm

    if not timm.is_model(name):
        known = timm.list_models()
        raise SpecError(f"timm has no model {name!r}.{did_you_mean(name, known)} ({len(known)} models: "
                        f"timm.list_models() lists them.)")
    try:
        model = timm.create_model(name, pretrained=False).eval()
    except RuntimeError as err:
        raise SpecError(f"timm cannot build {name!r}: {err}") from err
    size = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    return BuiltModel(f"timm:{name}", model, (_image(1, *size),))


# --- transformers ----------------------------------------------------------------------------------
TRANSFORMERS_SURVEY = ("bert", "gpt2", "llama", "distilbert", "roberta", "vit", "t5", "bart", "mistral", "qwen2", "opt", "albert")


def _tiniest(model_type: str, build: Callable[[Any], nn.Module]) -> nn.Module:
    """The model ``build`` makes from the first of :func:`~.tiny.tiny_configs` it builds from (some
    sizes transformers checks only when it builds the model); a ``SpecError`` if none. Each is
    built on ``meta`` first (no memory): a model that would still not fit is refused, where building
    it would have the process killed. A config not tiny at every level that cannot be built on
    ``meta`` is not built at all: its size is unknown, and Cohere Compass's real-size language model
    allocated 8 GB on its way to the error it raised on ``meta`` too (two such at once: killed)."""
    failure: Exception | None = None
    candidates = tiny_configs(model_type)
    while True:
        try:
            config, tiny = next(candidates)
        except StopIteration:
            break
        except Exception as err:  # noqa: BLE001 - transformers refused every config (GraniteMoeHybrid's head count)
            failure = err
            break
        try:
            with torch.device("meta"):
                probe: nn.Module | None = build(config)
        except Exception as err:  # noqa: BLE001 - a size check we do not know (or a model that cannot be on meta)
            probe = None
            if not tiny:
                failure = err
                continue
        if probe is not None:
            _fits(model_type, probe)
        try:
            return build(config)
        except Exception as err:  # noqa: BLE001 - the next, larger config
            failure = err
    raise SpecError(f"transformers cannot build {model_type!r} from a tiny config ({type(failure).__name__}: "
                    f"{failure}); build it in a Python file with a config of your own (path/to/file.py:Factory)."
                    ) from failure


def _fits(model_type: str, model: nn.Module) -> None:
    """Refuse a tiny model that is not tiny: more than half of this machine's memory in float32."""
    count = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    need = count * 4
    if need > memory_bytes() // 2:
        raise SpecError(
            f"transformers:{model_type}: even its tiny config has {count:,} parameters and buffers ({_bytes(need)} in float32), "
            f"more than half of this machine's memory ({_bytes(memory_bytes())}): some of its sizes are not ones "
            "fxprep knows to shrink. Build it in a Python file with a config of your own (path/to/file.py:Factory), "
            "or prepare a checkpoint with --meta.")


def _from_config(config: Any) -> nn.Module:
    """``AutoModel.from_config``, else the model class of the config's own family that takes this
    config class: a tower's config (``aimv2_text_model``, ``blip_2_vision_model``) has a model type
    of its own but no place in ``AutoModel``'s table, and its model class sits in the same package."""
    import transformers

    try:
        return transformers.AutoModel.from_config(config)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        cls = _own_model_class(type(config))
        if cls is None:
            raise
        return cls(config)


def _own_model_class(config_class: type) -> type | None:
    """The model class of ``config_class``'s package whose ``config_class`` it is exactly and that has
    a forward, a bare model (``Aimv2TextModel``) before a headed one (``...ForCausalLM``); None for
    none. Looked for in the ``modeling_`` module beside the config's, then in the package's other
    ``modeling_`` modules (BLIP's text tower is in ``modeling_blip_text``)."""
    import importlib
    import pkgutil

    import transformers

    module_name = config_class.__module__
    if ".configuration_" not in module_name:
        return None
    package, _, _ = module_name.rpartition(".")
    sibling = module_name.replace(".configuration_", ".modeling_")
    try:
        others = [f"{package}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(package).__path__)
                  if m.name.startswith("modeling_")]
    except (ImportError, AttributeError):
        others = []
    for name in [sibling, *sorted(set(others) - {sibling})]:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a modelling module that needs what is not installed: the next
            continue
        found = [v for v in vars(module).values()
                 if isinstance(v, type) and issubclass(v, transformers.PreTrainedModel)
                 and v.__module__ == module.__name__ and getattr(v, "config_class", None) is config_class
                 and getattr(v, "forward", None) is not nn.Module.forward]  # a family's PreTrainedModel base has no forward
        if found:
            return min(found, key=lambda c: ("For" in c.__name__, len(c.__name__), c.__name__))
    return None


def _transformers(name: str) -> BuiltModel:
    import transformers

    if name[:1].isupper():  # a class name: BertForSequenceClassification
        cls = getattr(transformers, name, None)
        config_class = getattr(cls, "config_class", None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and config_class):
            classes = [n for n in dir(transformers) if n[:1].isupper() and ("Model" in n or "For" in n)]
            raise SpecError(f"transformers has no model class {name!r}.{did_you_mean(name, classes)}")
        model = _tiniest(config_class.model_type, cls)
    else:
        try:
            transformers.AutoConfig.for_model(name)
        except (ValueError, KeyError) as err:
            raise SpecError(f"transformers {transformers.__version__} has no model type {name!r}."
                            f"{did_you_mean(name, model_types())} A model type is a config's model_type (bert, "
                            f"llama, t5...); a class name (BertForSequenceClassification) works too.") from err
        model = _tiniest(name, _from_config)
    model.eval()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    options = examples.candidates(model, seq_len=8)
    inputs = examples.choose(options, model) or {}  # {}: --input must name them
    return BuiltModel(f"transformers:{name}", model, inputs, "tiny config, random weights", options)


# --- python files and demos ------------------------------------------------------------------------
def _from_file(path: str, attr: str) -> BuiltModel:
    file = Path(path)
    if not file.is_file():
        raise SpecError(f"no such file {path!r} (spec form: path/to/file.py:ClassOrFactory).")
    module_name = f"fxprep_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {path!r} as a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # the user asked to run this file
    factory = getattr(module, attr, None)
    if factory is None:
        raise SpecError(f"{path} defines no {attr!r}.")
    model = factory()
    if not isinstance(model, nn.Module):
        raise SpecError(f"{path}:{attr}() returned a {type(model).__name__}, not an nn.Module.")
    example = None
    for holder in (model, factory, module):
        found = getattr(holder, "example_inputs", None) or getattr(holder, "EXAMPLE_INPUTS", None)
        if found is not None:
            example = found() if callable(found) else found
            break
    return BuiltModel(f"{file.name}:{attr}", model, example)


def _demo(name: str) -> BuiltModel:
    builders = {d.name: d for d in DEMOS}
    if name not in builders:
        raise SpecError(f"no demo model {name!r}.{did_you_mean(name, builders)} Known: {', '.join(builders)}.")
    model, inputs = builders[name].build()
    return BuiltModel(f"demo:{name}", model, inputs, builders[name].description)


def resolve(spec: str, inputs: Iterable[str] = ()) -> BuiltModel:
    """Build the model a spec names (offline, random weights), with ``--input`` strings overriding
    the default example inputs."""
    # split at the *last* colon: a file's directory may hold one (``runs/2024-01-01T10:00/model.py:Net``);
    # a file that exists wins over a builder prefix (``demo:x.py:Net`` names the file ``demo:x.py``)
    source, sep, name = spec.rpartition(":")
    if sep and name and not Path(source).is_file():
        first, _, rest = spec.partition(":")
        if first in ("torchvision", "timm", "transformers", "demo"):
            source, name = first, rest
    if not sep or not name or not source:
        raise SpecError(f"cannot read model spec {spec!r}: a spec is {SPEC_FORMS}.")
    builders: dict[str, Callable[[str], BuiltModel]] = {
        "torchvision": _torchvision, "timm": _timm, "transformers": _transformers, "demo": _demo,
    }
    if source.endswith(".py") or "/" in source or os.sep in source or Path(source).is_file():
        built = _from_file(source, name)
    elif source in builders:
        try:
            built = builders[source](name)
        except ImportError as err:
            raise SpecError(f"{source} is not installed: pip install {source}") from err
    else:
        raise SpecError(f"unknown model source {source!r} in {spec!r}.{did_you_mean(source, builders)} "
                        f"A spec is {SPEC_FORMS}.")
    revived = revive_zero_weights(built.model)
    if revived:
        built.note = (built.note + "; " if built.note else "") + f"zero-initialised weights re-drawn: {', '.join(revived)}"
    inputs = list(inputs)
    if inputs:
        built.example_inputs = inputs_from_strings(inputs, high=integer_high(built.model))
        built.input_options = []
    elif isinstance(built.example_inputs, dict) and not built.example_inputs:
        raise SpecError(f"{spec}: fxprep cannot tell this model's inputs from its config; name them with "
                        "--input NAME=DIMS[:DTYPE] (e.g. --input past_values=1x64x1).")
    return built


def model_types() -> list[str]:
    """Every ``model_type`` the installed transformers knows."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def integer_high(model: nn.Module) -> int:
    """Integer inputs are drawn below this: a transformers model's vocabulary size (token ids must
    index its embedding), else 100."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else 100


def revive_zero_weights(model: nn.Module) -> list[str]:
    """Re-draw weight matrices that random init leaves at exactly zero (torchvision's ViT head).

    With a zero head every output is 0 whatever the network computes, and verification would pass
    for any graph; a small random head makes the comparison mean something.
    """
    revived = []
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.is_floating_point() and not p.is_meta and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
                revived.append(name)
    return revived


def zoo_specs(zoo: str, pattern: str | None = None) -> list[str]:
    """Every spec of a zoo (``torchvision`` is the whole torchvision model list), filtered by a regex."""
    if zoo == "torchvision":
        names = torchvision_models()
    elif zoo == "timm":
        names = list(TIMM_SURVEY)
    elif zoo == "transformers":
        names = list(TRANSFORMERS_SURVEY)
    elif zoo == "demo":
        names = [d.name for d in DEMOS]
    else:
        raise SpecError(f"unknown zoo {zoo!r}; known: {', '.join(ZOOS)}.")
    specs = [f"{zoo}:{n}" for n in names]
    if pattern:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise SpecError(f"bad --filter regex {pattern!r}: {err}") from err
        specs = [s for s in specs if regex.search(s)]
    return specs
