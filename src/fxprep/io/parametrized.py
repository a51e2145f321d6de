"""Parametrized ``torch.nn`` layers (``torch.nn.utils.parametrize``): torch's ``weight_norm`` (wav2vec2's
and HuBERT's positional convolution) saved as the base layer (``torch.nn.Conv1d``, not the generated
``ParametrizedConv1d``), its g and v in their slots, and ``{"weight": {"kind": "weight_norm", "dim": 2}}``;
at load torch's own ``weight_norm`` is applied again (:func:`apply`), so the module is exactly torch's.

Only the kinds in :data:`KINDS` are saved, recognised by class object, never by name, alone on their
tensor; any other parametrization is refused at save naming the module and its class, and a file naming
another kind is refused at load. See docs/security.md ("What a save may set").
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.utils import parametrizations, parametrize

from ..errors import SerializationError

# kind -> the parametrization class it stands for (compared by identity at save)
KINDS: dict[str, type[nn.Module]] = {"weight_norm": parametrizations._WeightNorm}
_SAVED_FORMS = "fxprep saves torch.nn.utils.parametrizations.weight_norm only"
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
         "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def is_parametrized(module: nn.Module) -> bool:
    """A module whose class ``torch.nn.utils.parametrize`` generated (``ParametrizedConv1d``)."""
    return _generated(type(module))


def _generated(cls: type) -> bool:
    return cls.__module__ == parametrize.__name__ and cls.__name__.startswith("Parametrized")


def describe(module: nn.Module, where: str) -> tuple[type[nn.Module], dict[str, dict[str, Any]]]:
    """The class the parametrized ``module`` was made from, and each parametrized tensor's kind and
    arguments; a :class:`SerializationError` naming the parametrization fxprep cannot save."""
    cls = type(module)
    bases = cls.__bases__
    base = bases[0] if len(bases) == 1 else None
    plists = module._modules.get("parametrizations")
    if base is None or cls.__name__ != f"Parametrized{base.__name__}" or _generated(base) \
            or type(plists) is not nn.ModuleDict or not len(plists):
        raise SerializationError(f"cannot save {where}: a parametrized module of a form fxprep does not know "
                                 f"({_SAVED_FORMS}).")
    spec: dict[str, dict[str, Any]] = {}
    for name, plist in plists.items():
        chain = list(plist) if type(plist) is parametrize.ParametrizationList else []
        found = [next((k for k, c in KINDS.items() if type(p) is c), None) for p in chain]
        if len(chain) != 1 or found[0] is None:
            names = ", ".join(f"{type(p).__module__}.{type(p).__qualname__}" for p in chain) or type(plist).__qualname__
            raise SerializationError(
                f"cannot save {where}: its tensor {name!r} is parametrized by {names}, which has no saved form "
                f"({_SAVED_FORMS}, alone on a tensor). Remove the parametrization first "
                f"(torch.nn.utils.parametrize.remove_parametrizations(module, {name!r})), or save the original model."
            )
        dim = chain[0].__dict__.get("dim")
        if type(dim) is not int:
            raise SerializationError(f"cannot save {where}: the weight_norm of {name!r} has dim {dim!r}, not an int.")
        spec[name] = {"kind": found[0], "dim": dim}
    return base, spec


def apply(module: nn.Module, spec: Any, where: str) -> None:
    """Apply the saved parametrizations to ``module`` (just built on meta, from the saved base class)
    with torch's own functions; anything else in ``spec`` is refused."""
    if not isinstance(spec, dict) or not spec:
        raise SerializationError(f"{where}: malformed parametrizations {str(spec)[:120]}.")
    for name, one in spec.items():
        if not isinstance(one, dict) or set(one) != {"kind", "dim"}:
            raise SerializationError(f"{where}: malformed parametrization of {str(name)[:80]!r}: {str(one)[:120]}.")
        if one["kind"] not in KINDS:
            raise SerializationError(
                f"refusing to load: {where} names parametrization {str(one['kind'])[:80]!r} for {str(name)[:80]!r}; "
                f"fxprep knows only {sorted(KINDS)}."
            )
        dim = one["dim"]
        # a parameter the constructor made: never a method, a buffer or an attribute of the class
        if name not in module._parameters or module._parameters[name] is None or type(dim) is not int:
            raise SerializationError(f"{where}: cannot parametrize {str(name)[:80]!r} (dim {str(dim)[:20]}): "
                                     f"not a parameter of {type(module).__qualname__}, or a malformed dim.")
        try:
            parametrizations.weight_norm(module, name, dim)
        except Exception as err:  # noqa: BLE001 - torch refusing the saved arguments is a file problem
            raise SerializationError(f"{where}: weight_norm of {name!r} with dim {dim} failed: {err}") from err


def same_hooks(original: nn.Module, rebuilt: nn.Module) -> bool:
    """Every hook of ``original`` is the one torch's own code registered on ``rebuilt`` (weight_norm's
    state-dict compat hook): the same code object, in the same order, in every hook dict."""
    def code(hook: Any) -> Any:
        fn = getattr(hook, "hook", hook)  # nn.Module wraps hooks registered with_module
        return getattr(fn, "__code__", fn)

    for h in HOOKS:
        a, b = getattr(original, h, {}), getattr(rebuilt, h, {})
        if len(a) != len(b) or any(code(x) is not code(y) for x, y in zip(a.values(), b.values())):
            return False
    return True


def hooks_hint(module: nn.Module) -> str:
    """What to do about a module's hooks when they are the old ``torch.nn.utils.weight_norm`` (a
    forward pre-hook recomputing ``weight``), which has no saved form."""
    from torch.nn.utils.weight_norm import WeightNorm

    if any(type(h) is WeightNorm for h in module._forward_pre_hooks.values()):
        return (" It has the old torch.nn.utils.weight_norm (a forward pre-hook): apply "
                "torch.nn.utils.parametrizations.weight_norm instead, which fxprep saves, or remove it first "
                "(torch.nn.utils.remove_weight_norm).")
    return ""
