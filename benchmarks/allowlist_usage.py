"""Which callables prepared graphs name: the measurement the default allow-list is derived from (issue 63).

A save may name, without an opt-in, only the callables that prepared graphs of fxprep's own test
suites and model zoos use (``fxprep.io.reviewed``). This script measures them:

``tests``
    runs pytest on the test suite (``-m "not zoo"``, hypothesis derandomized) with this file as a
    plugin: every module ``prepare_model`` returns, and every save a test writes, is read for the
    callables it names (``fxprep.io.usage``), with the test's id (not in tests marked ``off_list``,
    whose models call what the list leaves out on purpose, to test the opt-in);
``zoo``
    prepares, saves and loads the model zoos, a few models per subprocess: torchvision (Dynamo, and
    fx for the classification models), one model per timm family, the transformers architectures of
    ``tests/zoo_models.py``, and every transformers causal-LM type that builds tiny through
    ``fxprep.cli.tiny.tiny_configs`` (``--only`` picks suites, ``--limit`` a sample of each);
``write``
    merges the records into ``benchmarks/allowlist_usage.json`` (each name with the first models that
    use it and how many do) and prints how it differs from ``fxprep.io.reviewed``.

While it measures, the allow-list is widened to every candidate (any callable of the fixed
namespaces that is not excluded: ``fxprep.io.allowlist.candidates``), so a save is never refused for
naming what the list would not hold yet. Re-derive with::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/allowlist_usage.py tests --out /tmp/usage
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/allowlist_usage.py zoo --out /tmp/usage
    PYTHONPATH=src python benchmarks/allowlist_usage.py write --out /tmp/usage

(on a 2-core CPU: ~1 h for the tests, ~1.5 h for the zoos). ``tests/test_io_allowlist.py`` checks that
``fxprep.io.reviewed`` lists exactly the default-namespace names of the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
USAGE_FILE = ROOT / "benchmarks" / "allowlist_usage.json"
RECORD_ENV = "FXPREP_USAGE_RECORD"
TRUSTED = ("torchvision", "timm", "transformers")


# --- widening the list while measuring -------------------------------------------------------------
def widen() -> None:
    """Every candidate callable allowed for this process (the measurement must see what graphs use,
    not what the list already holds): fxprep.io.allowlist.widen_for_measurement."""
    from fxprep.io import allowlist

    allowlist.widen_for_measurement()


def _append(record: dict[str, Any]) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


# --- the pytest plugin (tests) ---------------------------------------------------------------------
_OFF_LIST = [False]  # the running test is marked off_list: its models call what the list leaves out on purpose


def pytest_runtest_setup(item: Any) -> None:
    _OFF_LIST[0] = item.get_closest_marker("off_list") is not None


def pytest_configure(config: Any) -> None:
    if not os.environ.get(RECORD_ENV):
        return
    widen()
    import fxprep.api as api
    import fxprep.io as io
    from fxprep.io import usage

    finish, save = api._finish, io._save

    def test_id() -> str:
        return os.environ.get("PYTEST_CURRENT_TEST", "?").rpartition(" (")[0]

    def recorded_finish(run: Any, gm: Any) -> Any:
        gm = finish(run, gm)
        if _OFF_LIST[0]:
            return gm
        try:
            _append({"suite": "tests", "source": test_id(), "how": "prepared",
                     "names": usage.names_of_module(gm).as_dict()})
        except Exception as err:  # noqa: BLE001 - measuring must not change what the test sees
            _append({"suite": "tests", "source": test_id(), "how": "prepared", "error": repr(err)[:300]})
        return gm

    def recorded_save(gm: Any, directory: Any, **kwargs: Any) -> Any:
        path = save(gm, directory, **kwargs)
        if _OFF_LIST[0]:
            return path
        try:
            _append({"suite": "tests", "source": test_id(), "how": "saved", "names": usage.names_in(path).as_dict()})
        except Exception as err:  # noqa: BLE001 - a measurement records any failure and goes on
            _append({"suite": "tests", "source": test_id(), "how": "saved", "error": repr(err)[:300]})
        return path

    api._finish = recorded_finish
    io._save = recorded_save


def run_tests(out: Path, extra: list[str], name: str) -> int:
    """pytest with this file as its plugin; ``extra``: pytest's arguments (test files to run, ``-n 2``);
    the records go to ``out/<name>.jsonl`` (started afresh)."""
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"{name}.jsonl"
    record.unlink(missing_ok=True)
    env = {**os.environ, RECORD_ENV: str(record), "CI": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.allowlist_usage", "-p", "no:cacheprovider",
               "-m", "not zoo", "--ignore=tests/llmcompressor", "-x" if "--exitfirst" in extra else "-q",
               *[e for e in extra if e != "--exitfirst"]]
    print(" ".join(command), file=sys.stderr)
    # test failures do not matter here (a test expecting a refusal sees the widened list): the names do
    subprocess.run(command, cwd=ROOT, env=env, check=False)
    return 0


# --- the zoos ---------------------------------------------------------------------------------------
def _zoo_builders() -> dict[str, tuple[list[str], Callable[[str], tuple[Any, Any]], str]]:
    """suite -> (model names, build(name) -> (model, example), tracer)."""
    sys.path.insert(0, str(ROOT))
    from tests import zoo_models as zoo

    def tv_fx_train(name: str) -> tuple[Any, Any]:
        return zoo.build_fx(name, training=True)

    return {
        "torchvision": (zoo.TV_CLASSIFICATION + zoo.TV_SEGMENTATION + zoo.TV_VIDEO + zoo.TV_FLOW,
                        zoo.build_torchvision, "dynamo"),
        "torchvision_fx": (list(zoo.ALL_MODELS), zoo.build_fx, "fx"),
        "torchvision_fx_train": (list(zoo.ALL_MODELS), tv_fx_train, "fx"),
        "timm": (sorted(zoo.TIMM_FAMILIES), zoo.build_timm, "dynamo"),
        "transformers": (sorted(zoo.HF_ARCHS), zoo.build_hf, "dynamo"),
        "causal_lm": (_causal_lm_types(), _build_causal_lm, "auto"),
    }


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _build_causal_lm(model_type: str) -> tuple[Any, Any]:
    """The model type's causal-LM class from the first tiny config it builds from (the CLI's
    ``transformers:<Class>`` spec), with the CLI's example inputs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fxprep.cli.specs import resolve

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = names[0] if isinstance(names, (list, tuple)) else names
    built = resolve(f"transformers:{cls}")
    return built.model, built.example_inputs


def _outputs_match(a: Any, b: Any) -> bool:
    import torch

    from fxprep.verify.compare import flatten_output

    got, want = flatten_output(a), flatten_output(b)
    if [p for p, _ in got] != [p for p, _ in want]:
        return False
    return all(not isinstance(y, torch.Tensor) or (isinstance(x, torch.Tensor) and x.shape == y.shape
                                                   and torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5,
                                                                      equal_nan=True))
               for (_, x), (_, y) in zip(got, want))


def _call(module: Any, example: Any) -> Any:
    import torch

    with torch.no_grad():
        if isinstance(example, dict):
            return module(**example)
        return module(*example) if isinstance(example, tuple) else module(example)


def zoo_worker(suite: str, names: list[str]) -> None:
    """Prepare, save and load each model of ``names``, appending one record each."""
    import torch

    torch.set_num_threads(1)
    widen()
    import fxprep
    from fxprep.io import usage

    models, build, tracer = _zoo_builders()[suite]
    for name in names:
        record: dict[str, Any] = {"suite": suite, "source": f"{suite}:{name}", "how": "zoo"}
        try:
            model, example = build(name)
            start = time.perf_counter()
            options: dict[str, Any] = {"progress": False}
            if tracer != "auto":
                options["tracer"] = tracer
            gm = fxprep.prepare_model(model, example_inputs=example, **options)
            record["prepare_s"] = round(time.perf_counter() - start, 2)
            record["verification"] = gm.fxprep_report.verification.status
            record["names"] = usage.names_of_module(gm).as_dict()
        except Exception as err:  # noqa: BLE001 - a model that does not prepare names nothing
            record["prepare_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            _append(record)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                start = time.perf_counter()
                fxprep.save(gm, tmp, trusted_modules=TRUSTED)
                record["save_s"] = round(time.perf_counter() - start, 2)
                record["saved_names"] = usage.names_in(tmp).as_dict()
                start = time.perf_counter()
                loaded = fxprep.load(tmp, trusted_modules=TRUSTED)
                record["load_s"] = round(time.perf_counter() - start, 2)
                if not gm.training:  # train mode draws dropout masks: outputs differ by design
                    record["loaded_matches"] = _outputs_match(_call(loaded.eval(), example), _call(gm, example))
            except Exception as err:  # noqa: BLE001 - a measurement records any failure and goes on
                record["save_or_load_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                record["trace"] = traceback.format_exc()[-600:]
        _append(record)
        del gm, model


def run_zoo(out: Path, only: list[str] | None, limit: int | None, chunk: int, timeout: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    builders = _zoo_builders()
    for suite, (names, _, _) in builders.items():
        if only and suite not in only:
            continue
        if limit:
            step = max(len(names) // limit, 1)
            names = names[::step][:limit]
        record = out / f"zoo_{suite}.jsonl"
        done = {json.loads(line)["source"] for line in record.read_text().splitlines()} if record.exists() else set()
        todo = [n for n in names if f"{suite}:{n}" not in done]
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            env = {**os.environ, RECORD_ENV: str(record), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
            print(f"{suite}: {start + len(part)}/{len(todo)} {','.join(part)}", file=sys.stderr, flush=True)
            try:
                subprocess.run([sys.executable, __file__, "zoo-worker", suite, ",".join(part)], cwd=ROOT, env=env,
                               timeout=timeout * len(part), check=False, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                pass
            recorded = {json.loads(line)["source"] for line in record.read_text().splitlines()} if record.exists() else set()
            for name in part:  # a crashed or timed-out worker: the models it did not record, said so
                if f"{suite}:{name}" not in recorded:
                    with open(record, "a") as f:
                        f.write(json.dumps({"suite": suite, "source": f"{suite}:{name}", "how": "zoo",
                                            "prepare_error": "worker crashed or timed out"}) + "\n")
    return 0


# --- merging ----------------------------------------------------------------------------------------
def _records(out: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


KINDS = ("functions", "methods", "aten", "classes")


def merge(out: Path) -> dict[str, Any]:
    """{kind: {name: {"count": models naming it, "first": [up to 3 of them]}}} over every record, and
    what was run (the suites' model counts, which failed to prepare, save or load)."""
    used: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in KINDS}
    runs: dict[str, dict[str, Any]] = {}
    for record in _records(out):
        suite = record["suite"]
        summary = runs.setdefault(suite, {"records": 0, "prepare_failed": 0, "save_or_load_failed": [],
                                          "load_differs": []})
        summary["records"] += 1
        if "prepare_error" in record or "error" in record:
            summary["prepare_failed"] += 1
        if "save_or_load_error" in record:
            summary["save_or_load_failed"].append(f"{record['source']}: {record['save_or_load_error'][:160]}")
        if record.get("loaded_matches") is False:
            summary["load_differs"].append(record["source"])
        for key in ("names", "saved_names"):
            for kind in KINDS:
                for name in (record.get(key) or {}).get(kind, []):
                    entry = used[kind].setdefault(name, {"count": 0, "first": [], "sources": set()})
                    if record["source"] not in entry["sources"]:
                        entry["sources"].add(record["source"])
                        entry["count"] += 1
                        if len(entry["first"]) < 3:
                            entry["first"].append(record["source"])
    for kind in KINDS:
        for entry in used[kind].values():
            del entry["sources"]
    return {"runs": runs, "used": {k: dict(sorted(v.items())) for k, v in used.items()}}


def default_names(used: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The measured names the default list covers: functions of the fixed namespaces (not a trusted
    package's), Tensor methods and aten ops, and torch.nn / torch.ao.nn / torchvision.ops layer
    classes (fxprep.ops classes and module containers are allowed by rule, trusted packages' by
    trusted_modules); an
    excluded callable (a prepared graph's grad toggle, which save refuses) never."""
    from fxprep.io import allowlist

    vision = set(allowlist.torchvision_classes()) if "torchvision" in sys.modules else set()
    return {
        "functions": [n for n in used["functions"] if allowlist.candidate_function(n) is not None],
        "methods": [n for n in used["methods"] if n in allowlist.candidate_methods()],
        "aten": [n for n in used["aten"] if allowlist.candidate_aten(n.split(".")[0])],
        "classes": [n for n in used["classes"] if not n.startswith(allowlist.BY_RULE_CLASSES)
                    and (n in allowlist.candidate_module_classes() or n in vision)],
    }


def write(out: Path) -> int:
    widen()  # the candidate tables, to sort the measured names (nothing is loaded here)
    merged = merge(out)
    merged["default"] = default_names(merged["used"])
    merged["command"] = ("OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/allowlist_usage.py tests --out DIR; ... zoo "
                         "--out DIR; ... write --out DIR")
    USAGE_FILE.write_text(json.dumps(merged, indent=1, sort_keys=False) + "\n")
    from fxprep.io import reviewed

    listed = reviewed.listed()
    for kind in ("functions", "methods", "aten", "classes"):
        measured, have = set(merged["default"][kind]), set(listed[kind])
        print(f"{kind}: measured {len(measured)}, listed {len(have)}; to add {sorted(measured - have)}; "
              f"to drop {sorted(have - measured)}")
    for suite, summary in merged["runs"].items():
        print(f"{suite}: {summary['records']} records, {summary['prepare_failed']} did not prepare, "
              f"{len(summary['save_or_load_failed'])} did not save or load, {len(summary['load_differs'])} differ")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("tests", "zoo", "zoo-worker", "write"))
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fxprep_usage")
    parser.add_argument("--only", default="", help="zoo suites, comma-separated")
    parser.add_argument("--limit", type=int, default=0, help="models per zoo suite (a sample)")
    parser.add_argument("--chunk", type=int, default=6, help="models per worker process")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model before a worker is stopped")
    parser.add_argument("--name", default="tests", help="tests: the record file's name (several runs, one out)")
    args, unknown = parser.parse_known_args(argv)
    if args.command == "tests":
        return run_tests(args.out, args.rest + unknown, args.name)
    if args.command == "zoo":
        return run_zoo(args.out, [s for s in args.only.split(",") if s] or None, args.limit or None, args.chunk,
                       args.timeout)
    if args.command == "zoo-worker":
        zoo_worker(args.rest[0], args.rest[1].split(","))
        return 0
    return write(args.out)


if __name__ == "__main__":
    sys.exit(main())
