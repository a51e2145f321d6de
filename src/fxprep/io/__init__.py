"""Save and load prepared modules without pickle.

A prepared module is handed to other tools, other machines and other people, so the saved form must
be readable without the original model's source and safe to open when it comes from someone else.
``torch.save`` fails both ways: it pickles (opening a file runs code) and it needs every class the
model was defined with. :func:`save` writes JSON, safetensors and (for people) the generated code
(:mod:`.format` lists the files); :func:`load` rebuilds the module from them without running
anything saved (:mod:`.decode`), after checking every name against the trust policy
(:mod:`.trust`, by object identity: docs/security.md); :func:`inspect_saved` reads the JSON only.
A save is written beside its target and renamed into place (:mod:`.target`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import FxprepError, SerializationError
from ..passes import state_dict as state_dict_pass
from ..runtime import toolkits
from ..runtime.guard import InputSpec
from ..runtime.prepared import INPUT_SPEC, REPORT, PreparedModule, set_preserved
from ..version import __version__
from . import allowlist, selfcheck, usage
from .decode import (
    Decoder,
    assign_tensors,
    build_graph,
    build_modules,
    check_no_meta,
    field_of,
    finish_modules,
    report_from_dict,
)
from .encode import TreeWriter, custom_op_modules, graph_json, init_kwargs
from .format import (
    CHECKED_FILES,
    CODE,
    FORMAT,
    FORMAT_VERSION,
    GRAPH,
    KINDS,
    MANIFEST,
    MODULES,
    WEIGHTS,
    check_manifest,
    contiguous_unshared,
    dumps,
    input_spec,
    load_weights,
    own_attrs,
    read_json,
    sha256,
)
from .target import staged, write_new
from .trust import TrustPolicy, check_member

__all__ = [
    "CHECKED_FILES", "CODE", "FORMAT", "FORMAT_VERSION", "GRAPH", "KINDS", "MANIFEST", "MODULES", "WEIGHTS",
    "TrustPolicy", "check_member", "init_kwargs", "inspect_saved", "load", "save",
]

@contextlib.contextmanager
def _as_serialization_errors(what: str, directory: Any) -> Iterator[None]:
    """Any exception from inside torch or safetensors, as the documented error (issue 28: every
    exception out of ``load`` and ``save`` is an FxprepError; a hostile file must not be able to pick
    what a caller has to catch)."""
    try:
        yield
    except FxprepError:
        raise
    except Exception as err:  # noqa: BLE001 - see the docstring
        raise SerializationError(f"cannot {what} {directory}: {type(err).__name__}: {str(err)[:300]}") from err


def save(
    gm: fx.GraphModule,
    directory: str | os.PathLike[str],
    *,
    example_inputs: Any = None,
    trusted_modules: Iterable[str] = (),
    overwrite: bool = False,
    allow: Iterable[str] = (),
) -> Path:
    """Write ``gm`` to ``directory`` without pickle: JSON, safetensors and the generated code.

    The directory is written beside the target and renamed into place; the module is run once on a
    probe that ``load`` repeats (docs/delivery.md, docs/security.md).

    Args:
        gm: A module returned by :func:`fxprep.prepare_model`.
        directory: Where to write; new or empty, or an earlier fxprep save with ``overwrite=True``.
        example_inputs: Recorded in the manifest as the input spec (optional).
        trusted_modules: Packages whose code the opaque parts may be saved by name (``["torchvision"]``); load with the same.
        overwrite: Replace an earlier fxprep save at ``directory`` whole.
        allow: Callables beyond fxprep's default list the graph may name (``["torch.special.xlogy"]``); load with the same.

    Returns:
        The directory written.

    Raises:
        SerializationError: Something could not be loaded back (naming the module or node) or written; nothing is written then.
        InvalidInput: ``trusted_modules`` or ``allow`` is not a list of names.
    """
    with _as_serialization_errors("save to", directory):
        return _save(gm, directory, example_inputs=example_inputs, trusted_modules=trusted_modules, overwrite=overwrite,
                     allow=allow)


def _save(
    gm: fx.GraphModule,
    directory: str | os.PathLike[str],
    *,
    example_inputs: Any = None,
    trusted_modules: Iterable[str] = (),
    overwrite: bool = False,
    allow: Iterable[str] = (),
) -> Path:
    if not isinstance(gm, fx.GraphModule):
        raise SerializationError(f"fxprep.save expects a torch.fx.GraphModule, not {type(gm).__name__}.")
    from safetensors.torch import save_file

    policy = TrustPolicy.of(trusted_modules, allow)
    # Everything that can fail is done before the first file is written.
    graph = graph_json(gm, policy)
    writer = TreeWriter(gm, policy)
    writer.write()
    tree = {"modules": writer.entries, "tensors": writer.slots, "constants": writer.constants(),
            "aliases": state_dict_pass.aliases(gm)}
    _check_loadable(graph, tree, policy)  # what every load would refuse is refused here, naming it
    inputs = input_spec(example_inputs)
    tensors = contiguous_unshared(writer.tensors)
    report = getattr(gm, "fxprep_report", None)
    guard = getattr(gm, INPUT_SPEC, None)
    where = f"cannot save to {directory}"
    selfcheck.check_budget(gm, guard, where, saving=True)  # what load would refuse
    self_check = selfcheck.record(gm, guard, where, saving=True, until=selfcheck.deadline())
    target = Path(directory)
    with staged(target, overwrite) as fresh:
        try:
            write_new(fresh / GRAPH, dumps(graph))
            write_new(fresh / MODULES, dumps(tree))
            write_new(fresh / CODE, f"# Generated by torch.fx for {graph['class_name']}; for reading only "
                                    f"(fxprep.load never runs it).\n{gm.code}")
            save_file(tensors, str(fresh / WEIGHTS), metadata={"format": FORMAT})
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "fxprep_version": __version__,
                "torch_version": torch.__version__,
                "class_name": graph["class_name"],
                "inputs": inputs,
                "inputs_text": getattr(report, "inputs", ""),
                "devices": sorted({str(t.device) for t in writer.tensors.values()}),
                "trusted_modules": list(policy.modules),
                "allow": sorted(policy.allow),  # for people: load takes only the caller's own allow=
                "op_modules": custom_op_modules(gm),
                "report": report.to_dict() if report is not None and hasattr(report, "to_dict") else None,
                "input_guard": guard.to_dict() if guard is not None else None,
                "self_check": self_check,
                "sha256": {name: sha256(fresh / name) for name in CHECKED_FILES},
            }
            write_new(fresh / MANIFEST, json.dumps(manifest, indent=1, default=str))
        except SerializationError:
            raise
        except Exception as err:  # noqa: BLE001 - a disk or safetensors failure: nothing is left behind
            raise SerializationError(f"cannot write the save to {target}: {type(err).__name__}: {err}") from err
    return target


def load(
    directory: str | os.PathLike[str],
    *,
    trusted_modules: Iterable[str] = (),
    check_integrity: bool = True,
    allow: Iterable[str] = (),
) -> fx.GraphModule:
    """Rebuild a module written by :func:`save`, without the original source and without unpickling.

    Every name is checked against the trust policy by identity and the module is run once on the probe
    ``save`` recorded, within budgets (docs/security.md); the process's global state is left as it was.

    Args:
        directory: A directory written by :func:`save`.
        trusted_modules: Packages whose classes and functions the saved module may use (your own, torchvision, timm, transformers).
        check_integrity: Compare each file with the checksum in the manifest.
        allow: Callables beyond fxprep's default list the file may name, for files you trust.

    Returns:
        The loaded module, with its report and input guard.

    Raises:
        SerializationError: Anything refused or unreadable (tampering included), saying what.
        InvalidInput: ``trusted_modules`` or ``allow`` is not a list of names.
    """
    with _as_serialization_errors("load", directory):
        return _load(directory, trusted_modules=trusted_modules, check_integrity=check_integrity, allow=allow)


def _load(
    directory: str | os.PathLike[str],
    *,
    trusted_modules: Iterable[str] = (),
    check_integrity: bool = True,
    allow: Iterable[str] = (),
) -> fx.GraphModule:
    until = selfcheck.deadline()  # the whole load, the self-check's run included (LIMITS["load_seconds"])
    directory = Path(directory)
    if not directory.is_dir():
        raise SerializationError(f"{directory} is not a directory written by fxprep.save.")
    policy = TrustPolicy.of(trusted_modules, allow)
    manifest = check_manifest(directory, check_integrity)
    policy.import_op_modules(manifest.get("op_modules"))  # libraries that register their ops lazily
    graph_json = read_json(directory / GRAPH)
    tree = read_json(directory / MODULES)
    if not isinstance(graph_json, dict) or not isinstance(tree, dict):
        raise SerializationError(f"{directory}: {GRAPH} / {MODULES} are malformed.")
    weights = load_weights(directory)
    modules = build_modules(tree, Decoder(policy), policy)
    live = assign_tensors(tree, modules, weights)
    finish_modules(tree, modules, live, policy)
    root = modules[""]
    check_no_meta(root)
    for entry in tree["modules"]:  # nested graphs (torch.cond branches): the tree around them exists now
        if entry.get("kind") == "graph":
            branch = modules[entry["path"]]
            branch.graph = build_graph(field_of(entry, "graph", dict), branch, policy)
    graph = build_graph(graph_json, root, policy)
    class_name_ = graph_json.get("class_name", "GraphModule")
    if not isinstance(class_name_, str) or not class_name_.isidentifier():
        raise SerializationError(f"bad class name {str(class_name_)[:80]!r} in {GRAPH}.")
    gm = PreparedModule(nn.Module(), fx.Graph(), class_name_)
    for attr in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        setattr(gm, attr, getattr(root, attr))
    for k, v in own_attrs(root).items():
        object.__setattr__(gm, k, v)
    gm.training = root.training
    try:
        gm.graph = graph
        gm.recompile()
    except Exception as err:  # noqa: BLE001 - fx refusing the graph is a file problem
        raise SerializationError(f"{GRAPH} does not give a valid module: {type(err).__name__}: {str(err)[:200]}") from err
    aliases = tree.get("aliases") or {}
    if aliases:
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise SerializationError(f"malformed aliases in {MODULES}.")
        set_preserved(gm, state_dict_pass.ALIASES_ATTR, dict(aliases))
        gm.register_state_dict_post_hook(state_dict_pass._drop_aliases)
        gm.register_load_state_dict_pre_hook(state_dict_pass._fill_aliases)
    set_preserved(gm, REPORT, report_from_dict(manifest.get("report"), directory))
    spec = None
    if manifest.get("input_guard") is not None:  # plain data (fxprep.runtime.guard): what each call is checked against
        try:
            spec = InputSpec.from_dict(manifest["input_guard"])
        except ValueError as err:
            raise SerializationError(f"the input_guard in {MANIFEST} is malformed.") from err
        set_preserved(gm, INPUT_SPEC, spec)
    # the module does, on fake inputs shaped like its example, what the saved one did (io/selfcheck.py)
    selfcheck.check(gm, spec, manifest.get("self_check"), str(directory), until)
    toolkits.run_hooks()  # the toolkits already imported accept the module (AIMET QuantSim)
    return gm


def _check_loadable(graph: dict[str, Any], tree: dict[str, Any], policy: TrustPolicy) -> None:
    """Refuse to save what every load would refuse: a torch callable, Tensor method, aten op or layer
    class the default list (:mod:`.reviewed`) does not hold and ``allow`` does not add, named with the
    ``allow=`` that would save and load it. Trusted packages' names are load's to check (``save``
    writes them whether or not the loading side trusts the package)."""
    names = usage.names_of(graph, tree)
    refused: list[str] = []
    for kind, check in (("functions", policy.function), ("aten", lambda n: policy.function(f"torch.ops.aten.{n}")),
                        ("methods", lambda n: policy.function(f"Tensor.{n}")), ("classes", policy.module_class)):
        for name in sorted(getattr(names, kind)):
            shown = f"torch.ops.aten.{name}" if kind == "aten" else f"Tensor.{name}" if kind == "methods" else name
            if kind in ("functions", "classes") and not allowlist.default_namespace(name):
                continue
            try:
                check(name)
            except SerializationError as err:
                refused.append(f"{shown} ({str(err).removeprefix('refusing to load: ')[:160]})")
    if refused:
        wanted = [r.partition(" (")[0] for r in refused]
        raise SerializationError(
            f"cannot save: fxprep.load refuses by default what the graph calls: {'; '.join(refused[:5])}"
            f"{' ...' if len(refused) > 5 else ''}. If you trust files that call them, pass allow={wanted!r} to "
            f"fxprep.save and to fxprep.load (docs/security.md, 'Widening the list').")


# --- reading without loading ------------------------------------------------------------------------
def _node_refs(value: Any) -> list[str]:
    refs: list[str] = []
    if isinstance(value, dict):
        if value.get("$") == "node":
            return [str(value.get("v"))]
        for x in value.values():
            refs += _node_refs(x)
    elif isinstance(value, list):
        for x in value:
            refs += _node_refs(x)
    return refs


def inspect_saved(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What a saved directory holds, read from its JSON files only (nothing imported, nothing run).

    Args:
        directory: A directory written by :func:`save`.

    Returns:
        ``{"class_name", "manifest", "nodes"}``: the module's class name, the manifest, one row per node (its inputs; a module's class).

    Raises:
        SerializationError: ``directory`` is not an fxprep save, or its JSON is malformed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SerializationError(f"{directory} is not a directory written by fxprep.save.")
    manifest = check_manifest(directory, check_integrity=False)
    graph_json = read_json(directory / GRAPH)
    tree = read_json(directory / MODULES)
    classes = {}
    for entry in tree.get("modules", []) if isinstance(tree, dict) else []:
        if isinstance(entry, dict):
            name = str(entry.get("class", "")).rpartition(".")[2] or entry.get("kind")
            if entry.get("kind") == "bound_op":
                name = f"{name}({entry.get('fn')})"
            classes[entry.get("path")] = name
    rows = []
    for node in field_of(graph_json, "nodes", list):
        op, target = node.get("op"), node.get("target")
        if op == "call_module":
            what = f"{target}: {classes.get(target, '?')}"
        elif op == "call_function" and isinstance(target, dict):
            what = str(target.get("fn"))
        elif op == "call_method":
            what = f"Tensor.{target}"
        else:
            what = str(target)
        rows.append({"name": node.get("name"), "op": op, "what": what,
                     "inputs": _node_refs([node.get("args"), node.get("kwargs")])})
    return {"class_name": graph_json.get("class_name"), "manifest": manifest, "nodes": rows}
