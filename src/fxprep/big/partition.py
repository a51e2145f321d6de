"""A prepared graph cut into ordered stages at its repeated blocks (decoder layers, ViT blocks, ...).

Sequential calibration needs the model as disjoint pieces run in order. :func:`partition` cuts the
graph's topological node order into contiguous stages at the target blocks, with the nodes between
blocks joining the next block's stage unless they hold weights of their own (``head``, ``tail``, a
projector). Each :class:`Stage` is a ``GraphModule`` calling the user's own modules; it takes and
returns values by name, and ``stage.frees`` names what no later stage reads.

See docs/guides/big-models.md ("Under the hood").
"""

from __future__ import annotations

import copy
import fnmatch
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn

from ..core.lazy import LazyGraphModule
from ..errors import InvalidInput

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
Target = type | str


class Stage(LazyGraphModule):
    """One piece of a partitioned graph. ``forward(**values)`` takes :attr:`inputs` by name and
    returns ``{name: value}`` for :attr:`outputs`.

    Attributes: ``name`` (its block, or ``head`` / ``tail`` / ``after <block>``), ``blocks`` (the
    target blocks it holds), ``inputs`` / ``outputs`` (value names in the partitioned graph),
    ``frees`` (values a runner may drop after this stage: no later stage and not the final output
    reads them), ``weight_modules`` (``{path: module}``: the user's modules whose parameters and
    buffers this stage reads, what a runner onloads for it)."""

    name: str
    blocks: tuple[str, ...]
    frees: tuple[str, ...]
    weight_modules: dict[str, nn.Module]

    # Its code is generated at its first call (or ``.code``, or an explicit ``recompile()``), not when it
    # is made (:class:`~fxprep.core.lazy.LazyGraphModule`): llm-compressor's own subgraphs do the same,
    # and generating the code of a 7B's 33 stages was a fifth of making them.

    @property
    def inputs(self) -> tuple[str, ...]:
        """Its placeholders' targets: the keyword names ``forward`` takes."""
        return tuple(str(n.target) for n in self.graph.find_nodes(op="placeholder"))

    @property
    def outputs(self) -> tuple[str, ...]:
        """The keys of the dict its output node returns."""
        (output,) = self.graph.find_nodes(op="output")
        return tuple(output.args[0])

    def __repr__(self) -> str:
        return (f"Stage({self.name!r}, {len(self.graph.nodes) - len(self.inputs) - 1} nodes, "
                f"inputs={list(self.inputs)}, outputs={list(self.outputs)})")

    __str__ = __repr__  # GraphModule's prints the code: stage.code / print_readable() still do


class Stages(list):
    """The ordered stages of :func:`partition` (a ``list`` of :class:`Stage`), with what connects them
    to calls of the partitioned graph: :meth:`bind` (a call's arguments as the named values the
    first stages read), :meth:`result` (``gm``'s return value from the named values) and ``__call__``
    (all stages in order: the same as calling ``gm``)."""

    def __init__(self, stages: Iterable[Stage], binder: fx.GraphModule, result_graph: fx.GraphModule, codegen: Any,
                 spec: Any = None):
        super().__init__(stages)
        self._binder = binder
        self._result_graph = result_graph
        self._codegen = codegen
        self._spec = spec  # the prepared module's guard.InputSpec (None for a graph fxprep did not prepare)
        # gm's placeholders (the binder's are copies, same names) and the values gm's output is made of
        self.placeholders = tuple(n.name for n in binder.graph.find_nodes(op="placeholder"))
        self.result_reads = tuple(str(n.target) for n in result_graph.graph.find_nodes(op="placeholder"))

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``{placeholder name: value}`` for a call ``gm(*args, **kwargs)``, flattened by ``gm``'s own
        calling convention (its generated signature, defaults and input spec). A call ``gm`` would
        refuse (inputs structured or shaped unlike those it was captured for: :mod:`fxprep.runtime.guard`) is
        refused here too, with the same :class:`~fxprep.errors.InputMismatch`; arguments its signature
        does not take are :class:`~fxprep.errors.InvalidInput` naming those it takes."""
        from ..runtime import guard

        if self._spec is not None:
            guard.check_inputs(self._binder, self._spec, args, kwargs)
        return self.bind_unchecked(*args, **kwargs)

    def bind_unchecked(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """:meth:`bind` without the input spec's check, for a caller that checked the call another way
        (llm-compressor's adapter runs the stages against the model on a batch shaped otherwise)."""
        try:
            flat = self._binder(*args, **kwargs)
        except TypeError as err:
            import inspect

            takes = ", ".join(inspect.signature(self._binder.forward).parameters)
            raise InvalidInput(f"the partitioned graph takes ({takes}); called with {len(args)} positional "
                               f"argument(s) and keywords {sorted(kwargs)}: {err}") from err
        return dict(zip(self.placeholders, flat))

    def result(self, values: Mapping[str, Any]) -> Any:
        """What ``gm`` returns, from the values its output node reads (a ``ModelOutput`` stays one)."""
        missing = [n for n in self.result_reads if n not in values]
        if missing:
            raise InvalidInput(f"the final output needs {missing}, which are not among the values given.")
        flat = self._result_graph(**{n: values[n] for n in self.result_reads})
        return self._codegen.process_outputs(flat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = self.bind(*args, **kwargs)
        for stage in self:
            values.update(stage(**{n: values[n] for n in stage.inputs}))
            for name in stage.frees:
                values.pop(name, None)
        return self.result(values)


# --- which blocks ------------------------------------------------------------------------------
def _scopes(gm: fx.GraphModule) -> dict[str, Any]:
    """Every module scope the graph's nodes ran in, ``{qualified name: class}``, in graph order: the
    ``nn_module_stack`` entries, and the paths leading to ``call_module`` / ``get_attr`` targets (a
    graph re-traced by a toolkit, ``prepare_fx``'s, keeps only leaf scopes)."""
    found: dict[str, Any] = {}
    for node in gm.graph.nodes:
        for qual, cls in (node.meta.get("nn_module_stack") or {}).values():
            found.setdefault(str(qual), cls)
        if node.op in ("call_module", "get_attr"):
            parts = str(node.target).split(".")
            for i in range(1, len(parts)):
                found.setdefault(".".join(parts[:i]), None)
            if node.op == "call_module":
                found.setdefault(str(node.target), type(gm.get_submodule(str(node.target))))
    found.pop("", None)
    return found


def _classes(gm: fx.GraphModule, limit: int = 20) -> list[str]:
    """The module classes the graph's scopes have (for a message that says what targets exist)."""
    names = list(dict.fromkeys(c.__name__ for c in _scopes(gm).values() if isinstance(c, type)))
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _outermost(names: Iterable[str]) -> list[str]:
    chosen: list[str] = []
    for name in sorted(set(names), key=lambda n: (n.count("."), n)):
        if not any(_under(name, c) for c in chosen):
            chosen.append(name)
    return chosen


def _is_container(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, _CONTAINERS)


def default_blocks(gm: fx.GraphModule) -> list[str]:
    """The repeated blocks, as :mod:`fxprep.capture.dynamo.blocks` sees them: the outermost
    scopes (not containers, with scopes or modules under them) whose class has another outermost
    instance. A scope whose class has no twin (Llama's final norm, whose siblings are inside the
    layers) is looked into instead. A graph whose nodes do not say their modules' classes (re-traced
    by a toolkit) falls back to the numbered children of a list (``model.layers.0``, ``.1``, ...)."""
    scopes = _scopes(gm)
    parents = {n for n in scopes for m in scopes if m != n and _under(m, n)}
    eligible = {n: c for n, c in scopes.items() if n in parents and c is not None and not _is_container(c)}
    skip: set[str] = set()
    while eligible:
        candidates = [n for n in eligible if n not in skip and not any(_under(n, s) and n != s for s in skip)
                      and sum(1 for m, c in eligible.items() if c is eligible[n] and m not in skip) >= 2]
        chosen = _outermost(candidates)
        counts: dict[Any, int] = {}
        for n in chosen:
            counts[eligible[n]] = counts.get(eligible[n], 0) + 1
        lonely = {n for n in chosen if counts[eligible[n]] < 2}
        if not lonely:
            if chosen:
                return [n for n in scopes if n in set(_outermost(_lift(n, scopes) for n in chosen))]
            break
        skip |= lonely
    numbered = [n for n in parents if n.rpartition(".")[2].isdigit()]
    siblings: dict[str, int] = {}
    for n in numbered:
        siblings[n.rpartition(".")[0]] = siblings.get(n.rpartition(".")[0], 0) + 1
    outermost = set(_outermost(n for n in numbered if siblings[n.rpartition(".")[0]] >= 2))
    return [n for n in scopes if n in outermost]


def _lift(name: str, scopes: dict[str, Any]) -> str:
    """A block inside a numbered list child that ran without a scope of its own (Idefics3's text layers,
    iterated as ``self.layers[:n]``: Dynamo records their attention and MLP, not the layer) stands
    for that child: the stage is the whole layer."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if parts[i - 1].isdigit() and scopes.get(prefix, "missing") is None:
            return prefix
    return name


def _blocks(gm: fx.GraphModule, targets: Target | Sequence[Target] | None) -> list[str]:
    if targets is None:
        return default_blocks(gm)
    wanted = [targets] if isinstance(targets, (str, type)) else list(targets)
    for t in wanted:
        if not isinstance(t, (str, type)):
            raise InvalidInput(f"partition targets are module classes, names or glob patterns, not {t!r}.")
    scopes = _scopes(gm)
    matched = [n for n, cls in scopes.items()
               if any((isinstance(t, type) and isinstance(cls, type) and issubclass(cls, t))
                      or (isinstance(t, str) and fnmatch.fnmatchcase(n, t)) for t in wanted)]
    chosen = set(_outermost(matched))
    return [n for n in scopes if n in chosen]


# --- the cut -------------------------------------------------------------------------------------
def _block_of(node: fx.Node, blocks: set[str]) -> str | None:
    names = [str(q) for q, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op in ("call_module", "get_attr"):
        names.append(str(node.target))
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in blocks:
                return prefix
    return None


def _reads_weights(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> bool:
    for node in nodes:
        if node.op == "call_module" and any(True for _ in gm.get_submodule(str(node.target)).parameters()):
            return True
        if node.op == "get_attr" and isinstance(_attr(gm, str(node.target)), torch.Tensor):
            return True
    return False


def _attr(gm: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _segments(gm: fx.GraphModule, blocks: list[str], cut: _Cut) -> list[tuple[str, list[str], list[fx.Node]]]:
    """Contiguous pieces of the computing nodes; then each ``get_attr`` (a read Dynamo hoists to the
    top of the graph) joins every stage that uses it (:func:`_place_reads`)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return _place_reads(gm, _cut(gm, nodes, blocks, cut))


def _place_reads(gm: fx.GraphModule, segments: list[tuple[str, list[str], list[fx.Node]]]
                 ) -> list[tuple[str, list[str], list[fx.Node]]]:
    stage_of = {n: k for k, (_, _, nodes) in enumerate(segments) for n in nodes}
    reads: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        users = sorted({stage_of[u] for u in node.users if u in stage_of}) or ([len(segments) - 1] if segments else [])
        for k in users:
            reads.setdefault(k, []).append(node)
    if not segments and reads:
        return [("all", [], reads[-1])]
    return [(name, members, reads.get(k, []) + nodes) for k, (name, members, nodes) in enumerate(segments)]


@dataclass(frozen=True)
class _Cut:
    """How blocks make stages: ``per_stage`` consecutive blocks (or interleaved groups) in one stage;
    the nodes between two stages' blocks join the ``between`` one (``"next"``: unless they read
    weights, then they are a stage of their own; ``"previous"``: always, and the nodes after the
    last block too, llm-compressor's sequential pipeline's cut)."""

    per_stage: int = 1
    between: str = "next"


def _stage_name(members: list[str]) -> str:
    return "+".join(members) if len(members) <= 2 else f"{members[0]}+{len(members) - 1} more"


def _cut(gm: fx.GraphModule, nodes: list[fx.Node], blocks: list[str], cut: _Cut
         ) -> list[tuple[str, list[str], list[fx.Node]]]:
    block_set = set(blocks)
    labels = [_block_of(n, block_set) for n in nodes]
    spans: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        if label is not None:
            spans.setdefault(label, [i, i])[1] = i
    intervals: list[list[Any]] = []  # [start, end, [blocks]]
    for block, (start, end) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if intervals and start <= intervals[-1][1]:
            intervals[-1][1] = max(intervals[-1][1], end)
            intervals[-1][2].append(block)
        else:
            intervals.append([start, end, [block]])
    if not intervals:
        return [("all", [], nodes)] if nodes else []
    if cut.per_stage > 1:
        chunks = [intervals[k:k + cut.per_stage] for k in range(0, len(intervals), cut.per_stage)]
        intervals = [[c[0][0], c[-1][1], [b for i in c for b in i[2]]] for c in chunks]
    if cut.between == "previous":
        head: list[tuple[str, list[str], list[fx.Node]]] = [("head", [], nodes[:intervals[0][0]])] if intervals[0][0] > 0 else []
        ends = [i[0] for i in intervals[1:]] + [len(nodes)]
        return head + [(_stage_name(members), list(members), nodes[start:stop])
                       for (start, _, members), stop in zip(intervals, ends)]
    out: list[tuple[str, list[str], list[fx.Node]]] = []
    pending: list[fx.Node] = []
    cursor = 0
    for k, (start, end, members) in enumerate(intervals):
        gap = nodes[cursor:start]
        name = _stage_name(members)
        if gap and (k == 0 or _reads_weights(gm, gap)):
            out.append(("head" if k == 0 else f"after {out[-1][0]}", [], gap))
        else:
            pending = gap
        out.append((name, list(members), pending + nodes[start:end + 1]))
        pending = []
        cursor = end + 1
    tail = nodes[cursor:]
    if tail:
        out.append(("tail", [], tail))
    return out


def _mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """Values a node changes in place (``x.add_(..)``, ``x[i] = v``): a later stage must see them."""
    target = node.target
    inplace = (node.op == "call_method" and isinstance(target, str)
               and ((target.endswith("_") and not target.startswith("_")) or target == "__setitem__")) \
        or (node.op == "call_function" and target is operator.setitem)
    first = node.args[0] if node.args else None
    return [first] if inplace and isinstance(first, fx.Node) else []


def partition(gm: fx.GraphModule, targets: Target | Sequence[Target] | None = None, *,
              blocks_per_stage: int = 1, between: Literal["next", "previous"] = "next") -> Stages:
    """``gm`` cut into ordered :class:`Stage` s at its blocks; running them in order is running ``gm``.

    Nothing is copied: the stages call the user's module objects (docs/guides/big-models.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        targets: Module classes, qualified names or glob patterns (``"model.layers.*"``), the outermost matches the blocks;
            default: the repeated blocks (:func:`default_blocks`).
        blocks_per_stage: How many consecutive blocks one stage holds (llm-compressor's ``sequential_targets_per_subgraph``).
        between: Where the nodes between two blocks go: ``"next"`` (the next block's stage) or ``"previous"`` (llm-compressor's cut).

    Returns:
        The :class:`Stages`, callable as ``stages(*args, **kwargs)``.

    Raises:
        InvalidInput: ``gm`` is not a ``GraphModule``, an option is of the wrong kind, or no module matches ``targets``.
    """
    if not isinstance(gm, fx.GraphModule):
        raise InvalidInput(f"partition takes a GraphModule (what prepare_model returns), not {type(gm).__name__}.")
    if isinstance(blocks_per_stage, bool) or not isinstance(blocks_per_stage, int) or blocks_per_stage < 1:
        raise InvalidInput(f"blocks_per_stage must be an int >= 1, not {blocks_per_stage!r:.80}.")
    if between not in ("next", "previous"):
        raise InvalidInput(f'between must be "next" or "previous", not {between!r:.80}.')
    blocks = _blocks(gm, targets)
    if targets is not None and not blocks:
        raise InvalidInput(f"no module of the graph matches the partition targets {targets!r}; its module classes: "
                           f"{', '.join(_classes(gm))}.")
    segments = _segments(gm, blocks, _Cut(blocks_per_stage, between))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    final = output.all_input_nodes
    last_use: dict[fx.Node, int] = {}
    mutated: dict[int, dict[fx.Node, None]] = {}  # per stage, the values it changes in place (an ordered set)
    for k, (_, _, nodes) in enumerate(segments):
        for node in nodes:
            for used in node.all_input_nodes:
                last_use[used] = max(last_use.get(used, -1), k)
            mutated.setdefault(k, {}).update(dict.fromkeys(_mutated_inputs(node)))
    stages: list[Stage] = []
    for k, (name, members, nodes) in enumerate(segments):
        inside = set(nodes)
        inputs = list(dict.fromkeys(u for n in nodes for u in n.all_input_nodes if u not in inside))
        outputs = [n for n in nodes if (last_use.get(n, -1) > k and n.op != "get_attr") or n in final]
        outputs += [m for m in mutated.get(k, []) if m not in outputs and (last_use.get(m, -1) > k or m in final)]
        frees = [n.name for n in inputs + outputs if last_use.get(n, -1) <= k and n not in final and n.op != "get_attr"]
        stages.append(_stage(gm, name, members, nodes, inputs, outputs, frees))
    from ..runtime.prepared import INPUT_SPEC

    return Stages(stages, _binder(gm), _result_module(gm, output, final), gm.graph._codegen,
                  gm.__dict__.get(INPUT_SPEC))


def _stage(gm: fx.GraphModule, name: str, blocks: list[str], nodes: list[fx.Node], inputs: list[fx.Node],
           outputs: list[fx.Node], frees: list[str]) -> Stage:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output({n.name: env[n] for n in outputs})
    stage = Stage(gm, graph, "Stage")
    owners = _install_owners(gm, stage, nodes)
    stage.name = name
    stage.blocks = tuple(blocks)
    stage.frees = tuple(frees)
    stage.weight_modules = owners
    return stage


def _install_owners(gm: fx.GraphModule, stage: Stage, nodes: list[fx.Node]) -> dict[str, nn.Module]:
    """The modules whose tensors ``stage`` reads. ``GraphModule`` copies a ``get_attr`` tensor into
    a fresh container; the owner itself is put at its path instead, so the stage reads the tensor the
    owner holds *now* (an offloading runner swaps it for the onloaded one)."""
    owners: dict[str, nn.Module] = {}
    for node in nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            for sub_name, sub in module.named_modules():
                if sub._parameters or sub._buffers:
                    owners.setdefault(f"{node.target}.{sub_name}" if sub_name else str(node.target), sub)
        elif node.op == "get_attr":
            path, _, _ = str(node.target).rpartition(".")
            if not path or not isinstance(_attr(gm, str(node.target)), torch.Tensor):
                continue  # a root-level constant stays where it is (the stage holds it)
            owner = gm.get_submodule(path)
            owners.setdefault(path, owner)
            parent_path, _, leaf = path.rpartition(".")
            parent = stage.get_submodule(parent_path) if parent_path else stage
            if parent._modules.get(leaf) is not owner:
                parent._modules[leaf] = owner
    return owners


def _binder(gm: fx.GraphModule) -> fx.GraphModule:
    """A module with ``gm``'s signature that returns its placeholders' values (``gm``'s own input
    flattening, defaults included)."""
    graph = fx.Graph()
    env = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
    graph.output(tuple(env.values()))
    codegen = copy.copy(gm.graph._codegen)
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        codegen.pytree_info = info._replace(out_spec=None)
    graph._codegen = codegen
    return fx.GraphModule(nn.Module(), graph, "Binder")


def _result_module(gm: fx.GraphModule, output: fx.Node, final: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env = {n: graph.placeholder(n.name) for n in final}
    graph.output(fx.node.map_arg(output.args[0], lambda n: env[n]))
    return fx.GraphModule(nn.Module(), graph, "Result")
