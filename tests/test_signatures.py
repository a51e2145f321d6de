"""The capture's inputs travel as one request (issue 30), checked on the source with
``benchmarks/signatures.py``: no capture function grows back a long parameter list, and the routes
take a :class:`~fxprep.capture.request.CaptureRequest` rather than the example and its options loose."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "fxprep"

# A pass over torch.cond branches whose keyword-only options mirror functional_to_module.run's.
EXEMPT = {("capture/rewrite/branches.py", "run")}
MAX_PARAMETERS = 6

ROUTES = {
    "capture/cascade.py": ("run_tracer", "capture", "capture_with_opaque_parts"),
    "capture/dynamo/__init__.py": ("capture_dynamo",),
    "capture/dynamo/fallback.py": ("capture_dynamo_leaves",),
    "capture/dynamo/values.py": ("capture_deciding_values",),
    "capture/leaves.py": ("capture_hybrid",),
}


def _measure():  # benchmarks/ is not a package: loaded from its file
    spec = importlib.util.spec_from_file_location("fxprep_signatures", ROOT / "benchmarks" / "signatures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_no_capture_function_takes_more_than_six_parameters() -> None:
    long = [f"{s.path}:{s.line} {s.name} takes {len(s.params)}" for s in _measure().signatures(PACKAGE)
            if s.path.startswith("capture/") and len(s.params) > MAX_PARAMETERS and (s.path, s.name) not in EXEMPT]
    assert long == [], "bundle the arguments (CaptureRequest, LiftTarget, ReuseJob) instead:\n" + "\n".join(long)


def test_the_capture_routes_take_the_request() -> None:
    found = {(s.path, s.name): s.params for s in _measure().signatures(PACKAGE)}
    for path, names in ROUTES.items():
        for name in names:
            params = found[(path, name)]
            assert "request" in params, f"{path} {name}{params}"
            assert not {"model", "example", "policy", "concrete_args"} & set(params), f"{path} {name}{params}"


def test_the_measure_counts_what_a_signature_declares(tmp_path: Path) -> None:
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / "m.py").write_text(
        "class C:\n"
        "    def method(self, a, b=1, *args, c, **kw):\n"
        "        pass\n"
        "def route(request, example, /, x, *, y=None):\n"
        "    return (request,\n"
        "            example)\n")
    measure = _measure()
    got = {s.name: s for s in measure.signatures(tmp_path)}
    assert got["method"].params == ("a", "b", "*args", "c", "**kw")  # self left out
    assert got["route"].params == ("request", "example", "x", "y")
    assert got["route"].length == 3
    text = measure.report(tmp_path)
    assert "functions with > 5 parameters: 0" in text
    assert "capture/ functions with a parameter named 'request': 1" in text
    assert "capture/ functions with a parameter named 'example': 1" in text
