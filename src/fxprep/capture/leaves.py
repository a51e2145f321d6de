"""Hybrid capture: when a model cannot be captured whole, make only its untraceable parts opaque.

The loop: trace with fx; on failure, find the innermost *site* in the user's code that was running
(:func:`failure_site`): a submodule's ``forward`` (that submodule becomes an opaque leaf) or another
method of a submodule, e.g. ``rpn.filter_proposals`` (that method alone becomes an opaque call, so
the module's layers around it stay module-level). Trace again, until it succeeds or the failure is
in the root's own ``forward`` (nothing smaller is left to make opaque).

The result is ONE GraphModule: each opaque part is a ``call_module`` node that runs the original
code eagerly. An opaque part's *output structure* is recorded from one eager run on the example
inputs, so code after it sees a real tuple/list/dict of traced values (``images, targets =
self.transform(...)`` then ``if targets is not None``) instead of an opaque Proxy it cannot branch on.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch.fx as fx
from torch import nn

from ..core.inputs import ExampleInputs
from ..core.paths import get_path, has_path, install
from ..core.threads import GLOBAL_LOCK, confined
from ..reporting import progress
from ..reporting.diagnose import Issue, diagnose
from ..reporting.report import CaptureAttempt
from ..runtime.wrap import find_proxy
from .common import CaptureResult, LeafPolicy
from .fx import FxprepTracer, capture_fx, flatten_container_inputs
from .request import CaptureRequest
from .routes import Route
from .sites import FUNCTIONS, MISSING, OpaqueFunction, OpaqueMethod, Site, failure_site, put_back

MAX_ROUNDS = 40


# --- output structure --------------------------------------------------------------------------
def structure_of(value: Any) -> Any:
    """A template of ``value``: containers kept, tensors → ``...``, plain constants kept,
    anything else (a custom class) → ``...`` too (it stays one traced value)."""
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(structure_of(v) for v in value)
    if type(value) is dict:
        return {k: structure_of(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, str)):
        return value
    return ...


def _apply_structure(proxy: fx.Proxy, template: Any) -> Any:
    if template is ...:
        return proxy
    if isinstance(template, (tuple, list)):
        return type(template)(_apply_structure(proxy[i], t) for i, t in enumerate(template))
    if isinstance(template, dict):
        return {k: _apply_structure(proxy[k], t) for k, t in template.items()}
    return template


def record_structures(model: nn.Module, example: ExampleInputs, sites: list[Site]) -> dict[Site, Any]:
    """Run the model once and note each site's first output structure."""
    from ..core.runs import preserved_state, run_model

    found: dict[Site, Any] = {}
    handles = []
    patched: list[tuple[nn.Module, str]] = []
    restore: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for site in sites:
            if site.func is not None:
                fn, places = FUNCTIONS[site]

                def recording_fn(*args: Any, _site: Site = site, _fn: Any = fn, **kwargs: Any) -> Any:
                    out = _fn(*args, **kwargs)
                    found.setdefault(_site, structure_of(out))
                    return out

                for g in places:
                    g[site.method] = confined(recording_fn, fn)  # other threads call the function itself
                    restore.append((g, site.method, fn))
                continue
            owner = site.owner(model)
            if site.method == "forward" and site.attr is None:
                def hook(m: nn.Module, i: Any, o: Any, _site: Site = site) -> None:
                    found.setdefault(_site, structure_of(o))  # returns None: a hook's value would replace o

                handles.append(owner.register_forward_hook(hook))
            else:
                original = getattr(type(owner), site.method)

                def recording(*args: Any, _site: Site = site, _orig: Any = original, _owner: Any = owner, **kwargs: Any) -> Any:
                    out = _orig(_owner, *args, **kwargs)
                    found.setdefault(_site, structure_of(out))
                    return out

                owner.__dict__[site.method] = recording
                patched.append((owner, site.method))
        with preserved_state(model):
            run_model(model, example)
    except Exception:  # noqa: BLE001 - without structures the sites stay single opaque values
        pass
    finally:
        for h in handles:
            h.remove()
        for owner, name in patched:
            owner.__dict__.pop(name, None)
        for g, name, fn in restore:
            g[name] = fn
    return found


class HybridTracer(FxprepTracer):
    """FxprepTracer that calls the given sites instead of tracing them."""

    def __init__(self, policy: LeafPolicy, sites: list[Site], model: nn.Module, structures: dict[Site, Any],
                 autowrap_functions: tuple[Any, ...] = ()):
        super().__init__(policy, autowrap_functions)
        self.module_sites = {id(model.get_submodule(s.path)): s for s in sites
                             if s.method == "forward" and s.attr is None and s.func is None}
        self.method_sites = [s for s in sites if s not in self.module_sites.values()]
        self.targets: dict[Site, str] = {}
        self.model = model
        self.structures = structures

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.module_sites and module_qualified_name:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        site = self.module_sites.get(id(m))
        result = super().call_module(m, forward, args, kwargs)
        if site is not None and site in self.structures and isinstance(result, fx.Proxy):
            return _apply_structure(result, self.structures[site])
        return result

    def target_for(self, site: Site) -> str:
        """Where the site's module goes in the prepared graph: under its owner's path when that
        owner is traced through (a plain container in the GraphModule), else a flat name at the
        root, because a leaf owner is the user's own object and must not gain children."""
        if site not in self.targets:
            owner = self.model.get_submodule(site.path)
            leaf = (
                id(owner) in self.module_sites or self.policy.reason(owner) is not None
                or fx.Tracer.is_leaf_module(self, owner, site.path)
            )
            tail = f"{site.attr}_{site.method}" if site.attr else site.method
            if leaf and site.path:
                self.targets[site] = f"{site.path.replace('.', '_')}_{tail}"
            else:
                self.targets[site] = f"{site.path}.{tail}" if site.path else tail
        return self.targets[site]

    def _call_site(self, site: Site, *args: Any, **kwargs: Any) -> Any:
        if find_proxy((args, kwargs)) is None:
            return site.original(self.model)(*args, **kwargs)
        proxy = self.create_proxy("call_module", self.target_for(site), args, kwargs)
        if site in self.structures:
            return _apply_structure(proxy, self.structures[site])
        return proxy

    def make_graph_module(self, graph: fx.Graph, class_name: str) -> fx.GraphModule:
        """Install the user's objects (and the opaque-method modules) under the graph's targets."""
        gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name)
        by_target = {self.target_for(s): s for s in self.method_sites}
        for node in graph.nodes:
            if node.op not in ("call_module", "get_attr") or has_path(gm, str(node.target)):
                continue
            target = str(node.target)
            site = by_target.get(target)
            if site is not None and site.func is not None:
                value: Any = OpaqueFunction(FUNCTIONS[site][0])
            elif site is not None:
                value = OpaqueMethod(site.owner(self.model), site.method, site.qualname.rpartition(".")[0])
            else:
                value = get_path(self.model, target)
            install(gm, target, value)
        gm.graph = graph
        return gm

    def patch_methods(self) -> list[tuple[dict[str, Any], str, Any]]:
        """Route each method/function site through :meth:`_call_site`; returns what to restore."""
        patched: list[tuple[dict[str, Any], str, Any]] = []
        for site in self.method_sites:
            call = functools.partial(self._call_site, site)
            if site.func is not None:
                fn, places = FUNCTIONS[site]
                for g in places:
                    patched.append((g, site.method, g.get(site.method, MISSING)))
                    g[site.method] = confined(call, fn)  # a module global: other threads call the function itself
                continue
            owner = site.owner(self.model)
            if not hasattr(owner, "__dict__"):
                continue
            patched.append((owner.__dict__, site.method, owner.__dict__.get(site.method, MISSING)))
            owner.__dict__[site.method] = call
        return patched


def capture_hybrid(request: CaptureRequest) -> tuple[CaptureResult | None, CaptureAttempt, list[tuple[Site, Issue]]]:
    """Capture ``request`` with the smallest opaque parts that make fx succeed (``request.example``:
    the call of the prepared module, :func:`fxprep.core.inputs.split_calls`; None: no structures recorded).

    Returns the result (or None), the attempt for the report, and each opaque site with the issue
    that made it opaque (or, on failure, the issue nothing smaller could fix). ``request.handled`` is
    asked first about each failure: True means it was dealt with otherwise (``control_flow="rewrite"``
    rewrote the failing ``if``) and the trace is simply tried again. Runs under
    :data:`fxprep.core.threads.GLOBAL_LOCK`: the opaque functions are routed through the tracer in their
    modules' globals for the length of each trace.
    """
    with GLOBAL_LOCK:
        return _capture_hybrid(request)


def _capture_hybrid(request: CaptureRequest) -> tuple[CaptureResult | None, CaptureAttempt, list[tuple[Site, Issue]]]:
    model, policy, example = request.model, request.policy, request.example
    autowrap_functions, handled = request.autowrap_functions, request.handled
    start = time.perf_counter()
    concrete = flatten_container_inputs(model, example, request.concrete_args)
    sites: list[Site] = []
    found: list[tuple[Site, Issue]] = []
    structures: dict[Site, Any] = {}
    last_error: BaseException | None = None
    for _ in range(MAX_ROUNDS):
        if example is not None and any(s not in structures for s in sites):
            structures.update(record_structures(model, example, [s for s in sites if s not in structures]))
        tracer = HybridTracer(policy, sites, model, structures, autowrap_functions)
        patched = tracer.patch_methods()
        try:
            result, attempt = capture_fx(model, policy, concrete, autowrap_functions, tracer=tracer)
        finally:
            put_back(patched)
        if result is not None:
            result.tracer = Route.FX_LEAVES
            for site, issue in found:
                result.extra_leaves[site.qualname] = f"opaque: {issue.category} at {issue.location}"
            return result, CaptureAttempt(Route.FX_LEAVES, True, time.perf_counter() - start), found
        last_error = attempt.exception
        assert last_error is not None
        if handled is not None and handled(last_error):
            continue
        failed = failure_site(last_error, model)
        issue = diagnose(last_error, Route.FX, model)[0]
        if failed is None or (failed.path == "" and failed.method == "forward") or failed in sites:
            found.append((failed or Site(""), issue))
            break
        sites.append(failed)
        found.append((failed, issue))
        progress.step(f"{failed.qualname or 'root'} made opaque ({issue.category})")
    error = f"{type(last_error).__name__}: {str(last_error).splitlines()[0] if str(last_error) else ''}"
    return None, CaptureAttempt(Route.FX_LEAVES, False, time.perf_counter() - start, error, type(last_error).__name__, last_error), found


__all__ = ["capture_hybrid", "OpaqueMethod", "Site", "failure_site"]
