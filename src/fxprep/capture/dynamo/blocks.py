"""Repeated blocks: which submodules are many instances of one block, and when two run the same code.

Block reuse (:mod:`.reuse`) stamps one instance's graph out for the others only where they provably
run the same code on the same kind of inputs. Three checks, cheapest first: the same module tree and
settings (:func:`find_groups`, :func:`signature`), the same input specs at the call
(:func:`input_key`), and the first instance's Dynamo guards holding for the other
(:func:`guard_differences`). Also here: :func:`groups_apart_from` and :func:`structure_whys`.

See docs/concepts/block-reuse.md ("Under the hood") for what each check compares.
"""

from __future__ import annotations

import functools
import re
import types
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..common import LeafPolicy
from .names import Names, _SourceParser, canonical_source, default_leaf, self_alias
from .recording import original_class

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_MISSING = object()


def is_leaf(module: nn.Module, policy: LeafPolicy) -> bool:
    return policy.reason(module) is not None or default_leaf(module)


def find_groups(model: nn.Module, policy: LeafPolicy,
                descend: set[int] | None = None) -> list[list[tuple[str, nn.Module]]]:
    """The outermost non-leaf submodules that have a twin: another instance of the same class with
    the same :func:`signature`, each owning everything under it (:func:`owned_by`). Grouped by
    class and signature, in model order.

    Walks the tree from the root and stops at the first module whose class has other instances (a
    decoder layer, not its attention). An instance without a twin (Llama's final ``norm``, whose
    siblings sit inside the layers; T5's encoder stack next to its decoder stack; T5's first block,
    the only one with the position bias) is descended into instead. Modules without submodules
    are not worth a capture of their own and are skipped. ``descend``: ids of modules to look
    inside of in any case."""
    counts = Counter(type(m) for m in model.modules() if eligible_kind(m, model, policy))
    names = Names(model)
    descend = set(descend or ())
    while True:
        chosen = _outermost(model, policy, counts, descend)
        groups: dict[Any, list[tuple[str, nn.Module]]] = {}
        for qual, module in chosen:
            key = (type(module), signature(module, policy)) if owned_by(module, qual, names) else ("own", id(module))
            groups.setdefault(key, []).append((qual, module))
        lonely = [m for group in groups.values() if len(group) < 2 for _, m in group]
        if not lonely:
            return list(groups.values())
        descend.update(id(m) for m in lonely)


def _outermost(model: nn.Module, policy: LeafPolicy, counts: Counter[type],
               descend: set[int]) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            qual = f"{prefix}{name}"
            if eligible_kind(child, model, policy) and counts[type(child)] >= 2 and id(child) not in descend \
                    and not _hooked(child):
                chosen.append((qual, child))
            elif not is_leaf(child, policy):
                visit(f"{qual}.", child)

    visit("", model)
    return chosen


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own (transformers' output-capturing hooks on Pixtral's
    layers, a user's): Dynamo never calls such a module as one node, it traces its ``_call_impl``
    (the hooks, then ``forward``), and would trace into a stand-in's code. Its repeated children
    are the blocks instead, and the outer capture traces the hooks as the whole-model one does."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def eligible_kind(module: nn.Module, model: nn.Module, policy: LeafPolicy) -> bool:
    return (
        module is not model
        and not isinstance(module, _CONTAINERS)
        and not is_leaf(module, policy)
        and bool(module._modules)
        and not isinstance(module, torch.jit.ScriptModule)
    )


def _tensor_key(t: torch.Tensor | None) -> Any:
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)


def size_key(sizes: Any) -> tuple[Any, ...]:
    """Sizes or strides as a hashable tuple: a symbolic size (dynamic shapes) by its expression
    (``SymInt`` itself cannot be hashed). Equal within one capture's shape environment."""
    return tuple(s if type(s) is int else str(s) for s in sizes)


def shape_kind(sizes: Any) -> tuple[Any, ...]:
    """Sizes with every symbolic one as ``"?"``: comparable across two captures (a block captured on
    its own names its symbols afresh), where the static sizes must still be equal."""
    return tuple(s if type(s) is int else "?" for s in sizes)


def freeze(value: Any, depth: int = 0) -> Any:
    """A hashable stand-in for ``value`` that is equal for equal plain values; any other object
    stands for itself (by identity), which errs on the side of "different"."""
    if isinstance(value, (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                          torch.memory_format, torch.layout, type)) or value is Ellipsis:
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return ("tensor", _tensor_key(value))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value), str(value))  # a symbolic size (dynamic shapes): by its expression
    if depth < 4 and type(value) in (tuple, list):
        return (type(value), tuple(freeze(v, depth + 1) for v in value))
    if depth < 4 and type(value) is dict:
        return (dict, tuple(sorted(((repr(k), freeze(v, depth + 1)) for k, v in value.items()))))
    if isinstance(value, slice):
        return (slice, freeze((value.start, value.stop, value.step), depth + 1))
    return ("id", id(value))


def _settings(module: nn.Module) -> tuple[Any, ...]:
    return tuple(sorted((k, freeze(v)) for k, v in vars(module).items()
                        if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))))


def signature(block: nn.Module, policy: LeafPolicy) -> tuple[Any, ...]:
    """What must be equal between two instances before their guards are even looked at (see the
    module docstring). ``forward`` set on an instance counts as a setting (compared by identity)."""
    entries = []
    for rel, m in block.named_modules(remove_duplicate=False):
        leaf = is_leaf(m, policy) and m is not block
        entries.append((
            rel, original_class(type(m)), m.training, policy.reason(m),  # not the class an opaque module is switched to
            tuple((k, _tensor_key(p)) for k, p in m._parameters.items()),
            tuple((k, _tensor_key(b), k in m._non_persistent_buffers_set) for k, b in m._buffers.items()),
            _settings(m) if leaf else (),
            freeze(m.__dict__.get("forward")),
        ))
    return tuple(entries)


def structure_difference(block: nn.Module, other: nn.Module, other_name: str, policy: LeafPolicy) -> str:
    r"""Why ``block`` is not reused from ``other`` (same class), for the report: the first submodule
    where their :func:`signature`\ s differ, or the sharing that kept it out of :func:`find_groups`."""
    mine = {entry[0]: entry for entry in signature(block, policy)}
    theirs = {entry[0]: entry for entry in signature(other, policy)}
    for rel in [*mine, *(r for r in theirs if r not in mine)]:
        a, b = mine.get(rel), theirs.get(rel)
        if a is None:
            return f"it has no submodule '{rel}', which '{other_name}' has"
        if b is None:
            return f"its submodule '{rel}' is not in '{other_name}'"
        where = f"'{rel}'" if rel else "own settings"
        if a[1] is not b[1]:
            return f"its {where} is a {a[1].__name__}, in '{other_name}' a {b[1].__name__}"
        if a != b:
            return f"its {where} has other parameters, buffers or settings than in '{other_name}'"
    return "it shares a module or tensor with another part of the model"


def owned_by(block: nn.Module, prefix: str, names: Names) -> bool:
    """Whether every module and tensor of ``block`` is known to the model under ``prefix`` + its
    name inside the block (nothing tied to a module outside it, or to another instance)."""
    inner = Names(block)
    for mid, rel in inner.modules.items():
        if names.modules.get(mid) != (f"{prefix}.{rel}" if rel else prefix):
            return False
    for tid, (rel, _) in inner.tensors.items():
        if names.tensors.get(tid, ("",))[0] != f"{prefix}.{rel}":
            return False
    return True


# --- inputs -------------------------------------------------------------------------------------
def call_inputs(node: fx.Node) -> tuple[list[Any], Any]:
    """The flattened ``(args, kwargs)`` of a call node (fx Nodes and constants) and their spec."""
    plain = fx.node.map_aggregate((tuple(node.args), dict(node.kwargs)), lambda a: a)
    args, kwargs = _plain(plain)
    return pytree.tree_flatten((tuple(args), dict(kwargs)))


def _plain(value: Any) -> Any:
    """fx's immutable containers as the plain ones a pytree spec of the eager call has."""
    if isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def input_key(node: fx.Node) -> Any:
    """The specs of a block call's inputs as Dynamo saw them in the outer graph (hashable)."""
    flat, spec = call_inputs(node)
    first: dict[fx.Node, int] = {}
    out: list[Any] = []
    for i, leaf in enumerate(flat):
        if isinstance(leaf, fx.Node):
            ev = leaf.meta.get("example_value")
            if isinstance(ev, torch.Tensor):
                desc: Any = ("t", size_key(ev.shape), size_key(ev.stride()), ev.dtype, ev.device, ev.requires_grad)
            else:
                desc = ("v", freeze(ev))
            out.append((desc, first.setdefault(leaf, i)))
        else:
            out.append(("c", freeze(leaf)))
    return (str(spec), tuple(out))


# --- guards -------------------------------------------------------------------------------------
_SELF_SOURCE = re.compile(r"L\[['\"]self['\"]\](?:\.[A-Za-z_]\w*|\[[^\[\]]*\])*")


def _guard_kind(guard: Any) -> str:
    fn = getattr(guard, "create_fn", None)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "")
    return str(name)


class _Steps:
    """Stands in for the root while a source is parsed: records the attribute and item accesses, so
    each source is parsed once and replayed on every instance (a Llama-70B layer has ~150 guards)."""

    __slots__ = ("_steps",)

    def __init__(self, steps: tuple[tuple[str, Any], ...] = ()):
        object.__setattr__(self, "_steps", steps)

    def __getattribute__(self, name: str) -> _Steps:
        return _Steps(object.__getattribute__(self, "_steps") + (("attr", name),))

    def __getitem__(self, key: Any) -> _Steps:
        return _Steps(object.__getattribute__(self, "_steps") + (("item", key),))


@functools.lru_cache(maxsize=4096)
def _compiled(text: str) -> tuple[tuple[str, Any], ...] | None:
    try:
        parsed = _SourceParser(text, _Steps()).parse()  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - not a source this parser knows: never equal
        return None
    return object.__getattribute__(parsed, "_steps") if type(parsed) is _Steps else None


def _resolve(text: str, root: nn.Module) -> Any:
    steps = _compiled(text)
    if steps is None:
        return _MISSING
    obj: Any = root
    try:
        for kind, key in steps:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except Exception:  # noqa: BLE001 - a source that does not resolve for one instance is compared as such
        return _MISSING
    return obj


def _same(a: Any, b: Any, kind: str, depth: int = 0) -> bool:
    """Whether ``b`` passes the guard of kind ``kind`` that ``a`` was guarded with. Unknown guard
    kinds compare values (the strict reading)."""
    if a is b:
        return True
    if a is _MISSING or b is _MISSING:
        return False
    if kind == LEAF_HOOKS:
        return _hook_code(a) is not None and _hook_code(a) == _hook_code(b)
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):
        return type(a) is type(b)  # its own contents are compared by the static signature and other guards
    if kind in ("TYPE_MATCH", "CLASS_MATCH"):
        return type(a) is type(b)
    if kind == "SEQUENCE_LENGTH":
        return type(a) is type(b) and _len(a) == _len(b)
    if kind in ("DICT_KEYS_MATCH", "DICT_KEYS", "MAPPING_KEYS_CHECK"):
        return type(a) is type(b) and isinstance(a, dict) and list(a) == list(b)
    if kind == "TENSOR_MATCH" or isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _tensor_key(a) == _tensor_key(b) and a.stride() == b.stride()
    if type(a) is not type(b):
        return False
    if isinstance(a, (types.FunctionType, types.BuiltinFunctionType, type)):
        return False  # not the same object (checked above)
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and _same(a.__self__, b.__self__, kind, depth + 1)
    if depth < 4 and isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, kind, depth + 1) for x, y in zip(a, b))
    if depth < 4 and isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], kind, depth + 1) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: different
        return False


def _len(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def self_guards(guards: Iterable[Any], block: nn.Module) -> list[tuple[str, str]]:
    """``(source, kind)`` of every guard on the block (``L['self']...``, however its ``forward``'s
    frame names it: :func:`~.names.self_alias`); guards on the inputs are covered by
    :func:`input_key`, guards on globals hold for every instance alike."""
    out: dict[tuple[str, str], None] = {}
    alias = self_alias(block)
    for guard in guards:
        name = canonical_source(str(getattr(guard, "name", "")), alias)
        if "L['self']" not in name and 'L["self"]' not in name:
            continue
        kind = _guard_kind(guard)
        if _SELF_SOURCE.fullmatch(name):
            out[(name, kind)] = None
        else:  # e.g. type(L['self'].attn.config).__mro__[1]: the value it starts from, by type
            for m in _SELF_SOURCE.finditer(name):
                out[(m.group(0), "TYPE_MATCH" if "type(" in name else kind)] = None
    return list(out)


LEAF_HOOKS = "LEAF_HOOKS"  # the guard kind :func:`leaf_hook_guards` gives a leaf's hook dict
_HOOK_DICT = re.compile(r"\._(?:forward|forward_pre|backward|backward_pre)_hooks(?:_with_kwargs|_always_called)?$")


def leaf_hook_guards(guards: list[tuple[str, str]], block: nn.Module, policy: LeafPolicy) -> list[tuple[str, str]]:
    """``guards`` with each guard on a leaf's hook dict (``mlp.down_proj._forward_hooks``) made a
    :data:`LEAF_HOOKS` guard. Why: a leaf with hooks is one call of each instance's own module in
    the stamped graph, which runs its own hooks; Dynamo guards them by identity, and an activation
    collector registering one closure per layer (``make_hook(name)``) kept every layer from being
    reused. Hooks running the same code, in the same number and order, are the same to the graph."""
    out = []
    for source, kind in guards:
        found = _HOOK_DICT.search(source)
        owner = _resolve(source[:found.start()], block) if found else None
        if isinstance(owner, nn.Module) and owner is not block and is_leaf(owner, policy):
            kind = LEAF_HOOKS
        out.append((source, kind))
    return list(dict.fromkeys(out))


def beside_parts(guards: list[tuple[str, str]], sites: list[Any]) -> list[tuple[str, str]]:
    """``guards`` without those on the block's opaque parts (``sites``, relative to the block: an
    excluded module, a method kept opaque): each instance's part is switched to a class or given a
    call of its own for the capture, which Dynamo guards by identity; the stamped graph calls each
    instance's own part, which runs its own code whatever the first's was."""
    parts = [(f"{s.path}.{s.method}" if s.path else s.method) if not s.is_module else s.path
             for s in sites if s.func is None]
    if not parts:
        return guards

    def on_part(source: str) -> bool:
        rel = _relative(source)
        return any(rel == p or rel.startswith((f"{p}.", f"{p}[")) for p in parts)

    return [(source, kind) for source, kind in guards if not on_part(source)]


def _hook_code(hooks: Any) -> tuple[Any, ...] | None:
    """What a leaf's hook dict runs: each hook's code (a function's ``__code__``, else its type)."""
    if not isinstance(hooks, dict):
        return None
    return tuple(getattr(h, "__code__", None) or getattr(getattr(h, "__func__", None), "__code__", None) or type(h)
                 for h in hooks.values())


def _hook_names(hooks: Any) -> str:
    if not isinstance(hooks, dict) or not hooks:
        return "none"
    return ", ".join(str(getattr(h, "__qualname__", type(h).__name__)) for h in hooks.values())


def guard_differences(guards: list[tuple[str, str]], first: nn.Module, other: nn.Module) -> list[str]:
    """The guarded sources (relative to the block) whose value on ``other`` fails ``first``'s guard."""
    found = []
    for source, kind in guards:
        a, b = _resolve(source, first), _resolve(source, other)
        if _same(a, b, kind):
            continue
        if kind == LEAF_HOOKS:
            found.append(f"{_relative(source)} (hooks running other code: {_hook_names(a)} vs {_hook_names(b)})")
        else:
            found.append(f"{_relative(source)} ({kind}: {_short(a)} vs {_short(b)})")
    return found


def guard_key(guards: list[tuple[str, str]], block: nn.Module) -> tuple[Any, ...]:
    """What the guarded sources hold on ``block``, hashable: instances with equal keys are grouped
    together for the next capture."""
    out: list[Any] = []
    for source, kind in guards:
        value = _resolve(source, block)
        if kind == LEAF_HOOKS:
            out.append(("hooks", _hook_code(value)))
        elif isinstance(value, nn.Module) or kind in ("TYPE_MATCH", "CLASS_MATCH"):
            out.append(("type", type(value)))
        elif kind == "SEQUENCE_LENGTH":
            out.append(("len", _len(value)))
        else:
            out.append(freeze(value))
    return tuple(out)


def _relative(source: str) -> str:
    text = re.sub(r"^L\[['\"]self['\"]\]\.?", "", source)
    return text or "self"


def _short(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if isinstance(value, nn.Module):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def held_part(name: str, sites: list[Any]) -> Any:
    """The first of ``sites`` (opaque parts; a free function aside, which is called from anywhere)
    inside the module at ``name`` (or a method of it), or None."""
    return next((site for site in sites if site.func is None and name
                 and (site.path == name or site.path.startswith(f"{name}."))), None)


def groups_apart_from(model: nn.Module, policy: LeafPolicy, descend: set[int],
                      sites: list[Any]) -> list[list[tuple[str, nn.Module]]]:
    """:func:`find_groups` with no instance that is an opaque part (``sites``) or inside one: such
    an instance runs only in its part's recorded eager calls. An instance holding opaque parts is
    kept: its capture alone calls them as the whole-model capture does, and the modules calling them
    are stamped out with its graph, bound to each instance (:func:`.reuse._block_box`). Instances are
    grouped by the parts they hold, too: a layer whose MLP alone is excluded runs other code than its
    twins. One left without a twin that way is looked inside (``descend``, updated)."""
    # a module inside an opaque module runs only in its recorded eager calls; one inside the owner of an
    # opaque method is called by the capture as usual, unless from that method (then not at all)
    modules = [site.path for site in sites if site.is_module]

    def within(name: str) -> bool:
        return any(p in ("", name) or name.startswith(f"{p}.") for p in modules)

    def parts(name: str) -> frozenset[tuple[str, str, str | None]]:
        return frozenset((s.path[len(name) + 1:], s.method, s.attr) for s in sites
                         if s.func is None and (s.path == name or s.path.startswith(f"{name}.")))

    while True:
        groups: list[list[tuple[str, nn.Module]]] = []
        for group in find_groups(model, policy, descend):
            by_parts: dict[frozenset[tuple[str, str, str | None]], list[tuple[str, nn.Module]]] = {}
            for name, module in group:
                if not within(name):
                    by_parts.setdefault(parts(name), []).append((name, module))
            groups.extend(by_parts.values())
            if len(by_parts) > 1:
                lonely = {id(module) for kept in by_parts.values() if len(kept) < 2 for _, module in kept}
                if lonely - descend:
                    descend |= lonely
                    break
        else:
            return groups


def structure_whys(model: nn.Module, policy: LeafPolicy, instances: dict[int, tuple[nn.Module, Any]],
                   qualnames: dict[int, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Why instances of a reused block's class are not stamped from its first instance, by their
    module tree: the first of each further group of that class (a MoE layer among dense ones, a
    ResNet stage's wider bottlenecks), and each instance with no twin at all, captured as part of the
    model around it (a layer with ``mlp_only_layers``, T5's first block)."""
    reference: dict[type, tuple[str, nn.Module]] = {}
    groups: dict[str, str] = {}
    seen_keys: set[Any] = set()
    for mid, (module, key) in instances.items():  # group by group, each in model order
        if key in seen_keys:
            continue
        seen_keys.add(key)
        first = reference.setdefault(type(module), (qualnames[mid], module))
        if first[1] is not module:
            groups[qualnames[mid]] = structure_difference(module, first[1], first[0], policy)
    members = set(qualnames.values())
    alone: dict[str, str] = {}
    for name, module in model.named_modules():
        if (type(module) in reference and id(module) not in instances and eligible_kind(module, model, policy)
                and not any(name.startswith(f"{m}.") for m in members)):
            first_name, first = reference[type(module)]
            alone[name] = (f"no other instance has its module tree ({structure_difference(module, first, first_name, policy)}"
                           f"), so its inside is captured with the model around it")
    return groups, alone
