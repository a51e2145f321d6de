"""The reviewed allow-list (issue 28): a save names only callables someone reviewed, one entry each,
and never one that makes a tensor from a raw pointer or unchecked indices, changes the process's
state, or does I/O; load checks everything before it runs anything, within a whole-load budget, and
leaves the process's global state as it found it.

Each exploit below is a save edited by hand with its checksums recomputed. Before issue 28 the
allow-list admitted every builtin whose ``__module__`` is ``torch``: ``torch._from_blob(8, [16])``
crashed the loading process with SIGSEGV inside ``fxprep.load`` (its self-check runs the graph), an
unchecked ``sparse_coo_tensor(...).to_dense()`` wrote out of bounds, ``torch._C._set_grad_enabled``
switched autograd off for the whole process, an unclosed ``_enter_autocast`` left CPU autocast on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fxprep
from fxprep import io
from fxprep.errors import SerializationError
from fxprep.io import allowlist, reviewed, trust, usage
from fxprep.passes import op_table
from tests.helpers_io import _call, _edit, _node


@pytest.fixture
def saved(seed_save):
    return seed_save  # tests/conftest.py: (directory, prepared module, input)


# --- the list itself ---------------------------------------------------------------------------------------
USAGE = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "allowlist_usage.json").read_text())


def test_the_list_is_what_the_measurement_derived():
    """fxprep.io.reviewed lists exactly the default-namespace names benchmarks/allowlist_usage.py
    measured on the suites and zoos (issue 63: the smallest list that serves), each with a reason."""
    listed = reviewed.listed()
    for kind in ("functions", "methods", "aten", "classes"):
        assert set(listed[kind]) == set(USAGE["default"][kind]), kind
        assert all(reason and "TODO" not in reason for reason in listed[kind].values()), kind
        for name in listed[kind]:  # and each was measured on at least one model
            assert USAGE["used"][kind][name]["count"] >= 1
    print(f"default list: {len(listed['functions'])} functions, {len(listed['methods'])} Tensor methods, "
          f"{len(listed['aten'])} aten ops, {len(listed['classes'])} layer classes")
    assert len(listed["functions"]) + len(listed["methods"]) + len(listed["aten"]) < 400  # was ~1,740


def test_every_listed_callable_resolves_and_none_is_excluded():
    """Each listed function is one object of this torch, found by one lookup in its fixed namespace,
    and none of the excluded objects (by identity); each method is a Tensor method; each class a layer."""
    excluded = allowlist.excluded_objects()
    table = allowlist.functions()
    for name in reviewed.listed()["functions"]:
        assert name in table, f"{name} is listed but this torch has no such callable"
        assert allowlist.resolve(name) is table[name]
        assert id(table[name]) not in excluded, f"{name} is {excluded.get(id(table[name]))}, an excluded callable"
    excluded_methods = {m for entries in reviewed.EXCLUDED_METHODS.values() for m in entries}
    assert not allowlist.methods() & excluded_methods
    for name in allowlist.methods():
        assert callable(getattr(torch.Tensor, name)), name
    for name in reviewed.listed()["classes"]:
        assert name in allowlist.module_classes() or name in allowlist.torchvision_classes(), name


def test_aliases_follow_from_identity_and_are_not_listed():
    """``torch.functional.split`` is the very object ``torch.split`` is: accepted because it resolves to a
    listed object, never listed itself; a name of another object is not an alias."""
    policy = io.TrustPolicy()
    aliases = [(name, other) for name in allowlist.functions()
               for other in allowlist.candidate_functions()
               if other != name and allowlist.candidate_functions()[other] is allowlist.functions()[name]]
    assert aliases, "no listed function has a second name (the test would check nothing)"
    for name, other in aliases:
        assert other not in reviewed.listed()["functions"]
        assert policy.function(other) is allowlist.functions()[name]
    with pytest.raises(SerializationError, match="not on fxprep's default list"):
        policy.function(_unlisted_function())


def _unlisted_function() -> str:
    name = "torch.special.xlogy"  # a function no prepared graph of the suites or zoos calls
    assert name not in reviewed.listed()["functions"] and allowlist.alias(name) is None
    return name


def test_an_opt_in_widens_the_list_for_the_callers_own_files(seed_save, tmp_path):
    """``allow=`` lets a caller name more callables (any function of the fixed namespaces, Tensor
    method, aten op or torch.nn layer), for save and load alike; never an excluded one."""
    name = _unlisted_function()
    policy = io.TrustPolicy.of((), [name, "Tensor.resize_"])
    assert policy.function(name) is torch.special.xlogy
    trust.check_member("resize_", "method", policy.allow)
    for refused in ("torch._from_blob", "Tensor.data_ptr", "torch.ops.aten._from_blob", "os.system", "builtins.eval",
                    "builtins.exec", "builtins.open", "builtins.setattr", "builtins.breakpoint", "operator.call"):
        with pytest.raises(fxprep.InvalidInput, match="never allowed"):
            io.TrustPolicy.of((), [refused])
    # a save naming it: refused at load (naming the allow= that loads it), loaded with it
    directory, gm, x = seed_save
    graph = json.loads((directory / io.GRAPH).read_text())
    inp = next(n["name"] for n in graph["nodes"] if n["op"] == "placeholder")
    _call(directory, name, [{"$": "node", "v": inp}, {"$": "node", "v": inp}])
    with pytest.raises(SerializationError, match=rf"not on fxprep's default list.*allow=\['{name}'\]"):
        io.load(directory)
    with pytest.raises(SerializationError, match="does not describe the module that was saved"):
        io.load(directory, allow=[name])  # allowed: what stops it now is the self-check (the graph changed)


class _Xlogy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.xlogy(x, x.abs() + 1)


@pytest.mark.off_list
def test_save_refuses_a_callable_off_the_list_and_names_the_opt_in(tmp_path):
    """What every load would refuse is refused at save, with the allow= that would write and load it;
    with it, the save round-trips."""
    gm = fxprep.prepare_model(_Xlogy(), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    names = usage.names_of_module(gm)
    unlisted = sorted(n for n in names.functions if n not in reviewed.listed()["functions"])
    assert unlisted, names
    with pytest.raises(SerializationError, match=r"cannot save: fxprep.load refuses by default .*allow=\["):
        io.save(gm, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    directory = io.save(gm, tmp_path / "s", allow=unlisted)
    x = torch.randn(2, 3)
    torch.testing.assert_close(io.load(directory, allow=unlisted)(x), gm(x))


@pytest.mark.parametrize("model", ["seed", "tied", "autocast"])
def test_what_a_module_names_is_what_its_save_names(tmp_path, model):
    """usage.names_of_module (what the measurement reads from each prepared module) agrees with
    usage.names_in (what the save it writes names)."""
    from tests.helpers_io import Tied

    if model == "seed":
        from fxprep.cli.demo import ModelWithReusedReLU

        gm = fxprep.prepare_model(ModelWithReusedReLU().eval(), example_inputs=torch.randn(1, 3, 32, 32),
                                  progress=False)
    elif model == "tied":
        gm = fxprep.prepare_model(Tied().eval(), example_inputs=torch.randint(0, 10, (2, 5)), progress=False)
    else:
        gm = fxprep.prepare_model(_AutocastRegion().eval(), example_inputs=torch.randn(2, 8), tracer="dynamo",
                                  progress=False)
    directory = io.save(gm, tmp_path / "s")
    assert usage.names_of_module(gm).as_dict() == usage.names_in(directory).as_dict()


@pytest.mark.parametrize("family", list(reviewed.EXCLUDED_FUNCTIONS))
def test_excluded_callables_are_refused_under_every_name(family):
    policy = io.TrustPolicy()
    table = allowlist.functions()
    for name in reviewed.EXCLUDED_FUNCTIONS[family]:
        with pytest.raises(SerializationError, match="refusing to load"):
            policy.function(name)
        obj = allowlist.excluded_objects()
        assert not any(id(v) in obj for v in table.values())
        op = name.rpartition(".")[2]
        with pytest.raises(SerializationError, match="refusing to load"):
            policy.function(f"torch.ops.aten.{op}")
        with pytest.raises(fxprep.InvalidInput):
            io.TrustPolicy.of((), [name])


@pytest.mark.parametrize("method", sorted(m for v in reviewed.EXCLUDED_METHODS.values() for m in v))
def test_excluded_tensor_methods_are_refused(method):
    with pytest.raises(SerializationError, match="refusing to load"):
        trust.check_member(method, "method")
    with pytest.raises(SerializationError, match="refusing to load"):
        trust.check_member(method, "method", [f"Tensor.{method}"])


def test_what_fxprep_puts_in_graphs_can_be_loaded():
    """Derived from the op table: every function and Tensor method fxprep's passes may leave in a
    prepared graph (or put in an op) is on the list, or one an opt-in may allow (a graph fxprep writes
    is never one no load could take), or excluded (save refuses it, naming it)."""
    excluded = allowlist.excluded_objects()
    excluded_methods = {m for v in reviewed.EXCLUDED_METHODS.values() for m in v}
    functions = {*op_table.VIEW_AND_METADATA_FUNCTIONS, *op_table.ACTIVATION_FUNCTIONS, *op_table.DROPOUTS,
                 *op_table.NAMED_FUNCTIONS}
    missing = []
    for fn in functions:
        if isinstance(fn, type) or id(fn) in excluded:
            continue  # a container class (OrderedDict) is saved as a class, not a function
        if trust.default_function_name(fn) is None:
            missing.append(repr(fn))
    assert not missing, f"op-table functions no opt-in could allow: {missing}"
    methods = {*op_table.VIEW_AND_METADATA_METHODS, *op_table.NAMED_METHODS, *op_table.ACTIVATION_METHODS}
    for name in sorted(methods - excluded_methods):
        if name.startswith("__"):  # operator dunders: allowed by rule (trust.check_member)
            trust.check_member(name, "method")
        elif hasattr(torch.Tensor, name):  # the table also names methods of other torch versions (flatten_)
            assert name in allowlist.methods() or name in allowlist.candidate_methods(), name


# --- the issue's exploits --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, args", [
    ("torch._from_blob", [8, [16]]),  # an integer is an address: SIGSEGV inside fxprep.load before
    ("torch.ops.aten._from_blob", [8, [16]]),
    ("torch.sparse_coo_tensor", [{"$": "node", "v": "x"}, {"$": "node", "v": "x"}, [4, 4]]),
    ("torch.ops.aten._sparse_coo_tensor_unsafe", [{"$": "node", "v": "x"}, {"$": "node", "v": "x"}, [4, 4]]),
    ("torch._C._set_grad_enabled", [False]),
    ("torch.set_default_dtype", [{"$": "dtype", "v": "float64"}]),
    ("torch.use_deterministic_algorithms", [True]),
    ("torch.manual_seed", [0]),
    ("torch.set_num_threads", [1]),
    ("torch.from_file", ["/etc/passwd", False, 16]),
    ("torch.ops.prims.view_of", [{"$": "node", "v": "x"}]),
])
def test_exploits_naming_excluded_callables_fail_to_load(saved, fn, args):
    directory, _, _ = saved
    _call(directory, fn, args)
    before = torch.is_grad_enabled(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)
    assert (torch.is_grad_enabled(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()) == before


@pytest.mark.parametrize("method", ["data_ptr", "set_", "untyped_storage", "to_dense", "apply_", "register_hook",
                                    "backward", "share_memory_"])
def test_exploits_calling_excluded_tensor_methods_fail_to_load(saved, method):
    directory, _, _ = saved

    def change(data):
        node = _node(data, "conv1")
        node.update(op="call_method", target=method, args=[{"$": "node", "v": "x"}], kwargs={})
    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="refusing to load"):
        io.load(directory)


def test_an_autocast_region_never_left_fails_to_load(saved):
    """``_enter_autocast`` without its exit: one call would leave CPU autocast on for the process."""
    directory, _, _ = saved
    enter = {"name": "enter", "op": "call_function", "target": {"fn": "torch.amp.autocast_mode._enter_autocast"},
             "args": ["cpu", {"$": "dtype", "v": "bfloat16"}, True, None], "kwargs": {}}

    def change(data):
        data["nodes"].insert(1, enter)
    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="autocast region"):
        io.load(directory)
    assert not torch.is_autocast_enabled("cpu")


def test_an_exit_of_another_value_fails_to_load(saved):
    directory, _, _ = saved

    def change(data):
        data["nodes"].insert(1, {"name": "leave", "op": "call_function", "args": [{"$": "node", "v": data["nodes"][0]["name"]}],
                                 "target": {"fn": "torch.amp.autocast_mode._exit_autocast"}, "kwargs": {}})
    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="autocast region"):
        io.load(directory)


# --- static checks first, a budget, global state -----------------------------------------------------
def _guard_edit(directory: Path, change) -> None:
    def edit(manifest):
        change(manifest["input_guard"]["params"])
    _edit_manifest(directory, edit)


def _edit_manifest(directory: Path, change) -> None:
    path = directory / io.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_declared_inputs_past_the_whole_load_budget_are_refused_before_allocating(saved, monkeypatch):
    """64 probe inputs of 2**28 complex128 elements: ~4 GiB each, 256 GiB in all, were allocated one
    by one before any check (the per-input limit only). Now the declared total is checked first."""
    directory, _, _ = saved
    allocated = []
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: allocated.append(a) or real_randn(*a, **k))

    def change(params):
        name = next(iter(params))
        big = {"kind": "leaf", "example": {"shape": [2**14, 2**14], "dtype": "complex128"}}
        params[name] = {"kind": "seq", "type": "list", "items": [big] * 64}
    _guard_edit(directory, change)
    with pytest.raises(SerializationError, match="whole-load budget"):
        io.load(directory)
    assert allocated == []


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2", "bits8", "bits16", "nope", 7])
def test_odd_guard_dtypes_are_serialization_errors(saved, dtype):
    """An input guard example of dtype qint8 raised torch's INTERNAL ASSERT FAILED, bits8
    NotImplementedError, out of fxprep.load."""
    directory, _, _ = saved

    def change(params):
        node = next(iter(params.values()))
        node["example"]["dtype"] = dtype
    _guard_edit(directory, change)
    with pytest.raises(SerializationError):
        io.load(directory)


class _AutocastRegion(nn.Module):
    """An autocast region inside the model (timm's EfficientViT has float32 islands): Dynamo keeps the
    region as an enter/exit pair of calls in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.b(y)
        return torch.relu(y.float())


def _global_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
            torch.is_inference_mode_enabled(), bytes(torch.get_rng_state().numpy()))


@pytest.mark.parametrize("model", ["seed", "autocast"])
def test_global_state_is_unchanged_by_load_and_by_each_call(saved, tmp_path, model):
    if model == "seed":
        directory, _, x = saved
    else:
        x = torch.randn(2, 8)
        gm = fxprep.prepare_model(_AutocastRegion().eval(), example_inputs=x, tracer="dynamo", progress=False)
        directory = io.save(gm, tmp_path / "autocast")
        assert "_enter_autocast" in (directory / io.MODULES).read_text()  # an op module calling it
    before = _global_state()
    loaded = io.load(directory)
    assert _global_state() == before
    for _ in range(2):
        loaded(x)
        assert _global_state() == before
    with torch.no_grad():
        loaded(x)
    assert _global_state() == before


def test_an_autocast_op_whose_exit_was_removed_fails_to_load(tmp_path):
    """The same region as op modules (what fxprep's pass makes of the calls): the exit node deleted."""
    x = torch.randn(2, 8)
    gm = fxprep.prepare_model(_AutocastRegion().eval(), example_inputs=x, tracer="dynamo", progress=False)
    directory = io.save(gm, tmp_path / "autocast")

    def change(data):
        data["nodes"] = [n for n in data["nodes"] if "exit_autocast" not in json.dumps(n.get("target"))]
    _edit(directory, io.GRAPH, change)
    with pytest.raises(SerializationError, match="autocast region"):
        io.load(directory)
    assert not torch.is_autocast_enabled("cpu")


class _DataPtr(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.data_ptr() % 2


def test_save_refuses_what_load_would_refuse(tmp_path):
    """A graph calling an excluded Tensor method is refused at save, naming the node, rather than
    written and then refused by every load."""
    gm = fxprep.prepare_model(_DataPtr(), example_inputs=torch.randn(2, 3), tracer="fx", progress=False)
    with pytest.raises(SerializationError, match="cannot save node .*'data_ptr'"):
        io.save(gm, tmp_path / "s")
    assert not (tmp_path / "s").exists()


# --- the whole-load budget also counts what the graph itself allocates (literal sizes) ---------------------
def _insert(directory: Path, nodes: list) -> None:
    """Insert ``nodes`` after the input placeholder (``"$x"`` in their args stands for it)."""
    def change(data):
        x = {"$": "node", "v": data["nodes"][0]["name"]}
        filled = json.loads(json.dumps(nodes).replace('"$x"', json.dumps(x)))
        data["nodes"][1:1] = filled
    _edit(directory, io.GRAPH, change)


def _fn(name: str, fn: str, args: list, kwargs: dict | None = None) -> dict:
    return {"name": name, "op": "call_function", "target": {"fn": fn}, "args": args, "kwargs": kwargs or {}}


def _method(name: str, method: str, args: list) -> dict:
    return {"name": name, "op": "call_method", "target": method, "args": args, "kwargs": {}}


# the constructors these cases call: allowed for them where the default list does not hold them (an
# opt-in's callables are counted like the list's: the budgets are the defence behind the list)
CONSTRUCTORS = ["torch.zeros", "torch.full", "torch.arange", "torch.empty_strided", "torch.randn", "torch.ones",
                "torch.empty", "torch.ops.aten.zeros", "Tensor.new_empty", "Tensor.expand", "Tensor.repeat",
                "operator.mul"]


@pytest.mark.parametrize("nodes, what", [
    ([_fn("big", "torch.zeros", [2**40])], "zeros"),  # 4 TiB of float32
    ([_fn("big", "torch.full", [[2**20, 2**20], 1.5])], "full"),
    ([_fn("big", "torch.arange", [2**40])], "arange"),
    ([_fn("big", "torch.empty_strided", [[2, 2], [2**40, 1]])], "empty_strided"),  # the storage its strides reach
    ([_fn("big", "torch.randn", [2**20, 2**20], {"dtype": {"$": "dtype", "v": "float64"}})], "randn"),
    ([_fn("big", "torch.ops.aten.zeros", [[2**40]])], "zeros"),
    ([_method("big", "new_empty", ["$x", [2**40]])], "new_empty"),
    ([_method("big", "expand", ["$x", 2**20, 1, 3, 32, 32])], "expand"),  # a view; anything on it allocates it all
    ([_method("big", "repeat", ["$x", 2**20, 2**20, 1, 1])], "repeat"),  # at least its factors
    # the size computed by the graph from literals: folded, not hidden
    ([_fn("n", "operator.mul", [2**20, 2**20]), _fn("big", "torch.ones", [{"$": "node", "v": "n"}])], "ones"),
])
def test_literal_allocations_past_the_whole_load_budget_are_refused_before_running(saved, nodes, what):
    """A hand-edited save whose graph calls ``torch.zeros(2**40)`` (or any constructor with literal sizes)
    was run by load's self-check, which allocated whatever it named (or failed trying, reported as
    a self-check difference). Now the sizes are counted before anything runs, and the node named."""
    directory, _, _ = saved
    _insert(directory, nodes)
    with pytest.raises(SerializationError, match=rf"node 'big' \({what} with literal sizes\) would (allocate|expand "
                                                 rf"to) [0-9,]+ bytes.*whole-load budget.*Nothing was allocated"):
        io.load(directory, allow=CONSTRUCTORS)


def test_views_with_literal_sizes_count_once_not_per_layer(saved):
    """A graph traced with static shapes writes every size as a literal: a Llama's ``repeat_kv``
    expands keys and values in every layer (4 GiB summed over 32 layers at 4096 tokens, for views
    that allocate nothing). Views count by the largest, so such a save loads; constructors add up."""
    directory, gm, x = saved
    views = [_method(f"view{i}", "expand", ["$x", 2**14, 1, 3, 32, 32]) for i in range(30)]  # 192 MiB each
    _insert(directory, views)
    loaded = io.load(directory, allow=CONSTRUCTORS)
    with torch.no_grad():
        assert torch.equal(loaded(x), gm(x))
    _insert(directory, [_fn(f"made{i}", "torch.empty", [2**14, 1, 3, 32, 32]) for i in range(30)])
    with pytest.raises(SerializationError, match=r"node 'made\d+' \(empty with literal sizes\) would allocate "
                                                 r"201,326,592 bytes; .*in all, more than"):
        io.load(directory, allow=CONSTRUCTORS)


def test_literal_allocations_in_an_op_module_are_counted(tmp_path):
    """The same constructor as an op module (fxprep's functional -> module pass makes calls into
    BoundOps): its argument template is read, with the call site's literals filled in."""
    from tests.helpers_io import _module

    class _Adds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.ones(4) + x.new_zeros(2, 4)  # literal sizes, a few bytes: loads

    gm = fxprep.prepare_model(_Adds().eval(), example_inputs=torch.randn(2, 4), tracer="dynamo", progress=False)
    directory = io.save(gm, tmp_path / "adds")
    io.load(directory)

    def change(data):
        _module(data, "add").update(fn="Tensor.repeat", args=[{"$": "slot", "v": 0}, 2**20, 2**20])
    _edit(directory, io.MODULES, change)
    with pytest.raises(SerializationError, match=r"node 'add\w*' \(repeat with literal sizes\).*whole-load budget"):
        io.load(directory, allow=CONSTRUCTORS)


def test_save_refuses_a_graph_that_load_would_refuse_for_its_literal_allocations(tmp_path, monkeypatch):
    """``save`` counts the same sum as ``load``: what every load would refuse is not written."""
    class _Mask(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.zeros(64, 64).sum()

    gm = fxprep.prepare_model(_Mask().eval(), example_inputs=torch.randn(2, 3), tracer="dynamo", progress=False)
    monkeypatch.setitem(io.format.LIMITS, "probe_bytes", 4096)  # 64 * 64 float32 = 16384 bytes
    with pytest.raises(SerializationError, match=r"cannot save to .*node 'zeros' \(zeros with literal sizes\) would "
                                                 r"allocate 16,384 bytes.*load would refuse it"):
        io.save(gm, tmp_path / "mask")
    assert not (tmp_path / "mask").exists()
    monkeypatch.undo()
    io.load(io.save(gm, tmp_path / "mask"))


@pytest.mark.off_list
def test_cli_allow_option_saves_a_graph_calling_a_callable_off_the_list(tmp_path):
    from tests.helpers_cli import invoke

    model_file = tmp_path / "xlogy_model.py"
    model_file.write_text("import torch\n\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n"
                          "        return torch.special.xlogy(x, x.abs() + 1)\n\n\n"
                          "def example_inputs():\n    return (torch.randn(2, 3),)\n")
    spec = f"{model_file}:Net"
    refused = invoke("prepare", spec, "--tracer", "fx", "-o", str(tmp_path / "no"))
    assert refused.exit_code == 4, refused.output
    assert "allow=['torch.special.xlogy']" in refused.output and "--allow NAME" in refused.output
    assert not (tmp_path / "no").exists()
    saved = invoke("prepare", spec, "--tracer", "fx", "-o", str(tmp_path / "yes"), "--allow", "torch.special.xlogy")
    assert saved.exit_code == 0, saved.output
    x = torch.randn(2, 3)
    torch.testing.assert_close(io.load(tmp_path / "yes", allow=["torch.special.xlogy"])(x),
                               torch.special.xlogy(x, x.abs() + 1))
