"""A graph description (:mod:`.describe`) as one self-contained HTML page, or as Graphviz DOT.

The page is a single file with its script and style inline and the graph as JSON inside it: it
opens from disk, by e-mail or from a CI artifact with no server and no network (a
Content-Security-Policy forbids any request, so nothing can be fetched by accident). The script
(``assets/view.js``) folds the graph into its module hierarchy, lays it out and adds search; the
DOT output is for people who prefer Graphviz's layouts (``dot -Tsvg``).
"""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any

# No request of any kind: inline script and style only, images only as data: URLs.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def _json_for_script(value: Any) -> str:
    """JSON that cannot end the ``<script>`` element it sits in (``</script>`` in a module name)."""
    text = json.dumps(value, default=str, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(view: dict[str, Any]) -> str:
    """The page: header (title, node count, verification, search), side panel (module tree,
    report, legend, details of the selected node) and the graph."""
    title = escape(str(view["title"]))
    meta = view.get("meta") or {}
    subtitle = escape(" · ".join(str(v) for v in (
        meta.get("source"), f"fxprep {meta.get('fxprep_version')}", f"torch {meta.get('torch_version')}") if v))
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="fxprep">
<title>{title} · fxprep graph</title>
<style>
{_asset("view.css")}
</style>
<script>
// Any script error is recorded on the page itself, so a headless browser (and a person) can see it.
window.addEventListener("error", function (e) {{
  var root = document.documentElement;
  root.setAttribute("data-errors", (root.getAttribute("data-errors") || "") + (e.message || "error") + "\\n");
}});
</script>
</head>
<body>
<header>
  <h1 title="{subtitle}">{title}</h1>
  <span id="node-count"></span>
  <span id="summary"></span>
  <label><input type="checkbox" id="shapes" checked> edge shapes</label>
  <button id="fit" title="fit the graph to the window">fit</button>
  <button id="fold-all" title="fold every module">fold all</button>
  <button id="unfold-all" title="unfold every module (big graphs get big)">unfold all</button>
  <div id="search-box">
    <input id="search" type="search" placeholder="find a module or node by name (press /)" autocomplete="off">
    <div id="results"></div>
  </div>
</header>
<main>
  <aside>
    <div class="tabs">
      <button class="on" data-panel="tree">modules</button>
      <button data-panel="report">report</button>
      <button data-panel="legend">legend</button>
    </div>
    <div id="tree" class="panel tree on"></div>
    <div id="report" class="panel"></div>
    <div id="legend" class="panel"></div>
    <div id="details">Click a box for its details; click a folded module to unfold it. Drag or scroll to move, Ctrl+wheel to zoom.</div>
  </aside>
  <section id="canvas">
    <svg id="graph" xmlns="http://www.w3.org/2000/svg">
      <defs>
        <marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
          <path d="M0,0 L10,5 L0,10 z" fill="#a0aec0"></path>
        </marker>
        <pattern id="hatch" width="8" height="8" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
          <rect width="8" height="8" fill="#fed7d7"></rect>
          <line x1="0" y1="0" x2="0" y2="8" stroke="#fc8181" stroke-width="3"></line>
        </pattern>
      </defs>
      <g id="viewport"></g>
    </svg>
    <div id="hint">{subtitle}</div>
  </section>
</main>
<script type="application/json" id="fxprep-data">{_json_for_script(view)}</script>
<script>
{_asset("view.js")}
</script>
</body>
</html>
"""


_DOT_STYLE = {
    "input": 'shape=ellipse, style=filled, fillcolor="#bee3f8"',
    "module": 'shape=box, style=filled, fillcolor="#ffffff"',
    "added": 'shape=box, style="rounded,filled", fillcolor="#c6f6d5"',
    "unrolled": 'shape=box, style="dashed,filled", fillcolor="#feebc8"',
    "opaque": 'shape=box3d, style=filled, fillcolor="#fed7d7", color="#c53030"',
    "left": 'shape=hexagon, style=filled, fillcolor="#fefcbf"',
    "functional": 'shape=ellipse, style=filled, fillcolor="#edf2f7"',
    "attr": 'shape=box, style=filled, fillcolor="#e2e8f0"',
}


def _dot_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render_dot(view: dict[str, Any]) -> str:
    """The graph in Graphviz DOT: nodes shaped and coloured by kind (as on the page), module calls
    clustered by the module that holds them, edges labelled with shape and dtype."""
    lines = ["digraph fxprep {", '  rankdir=TB; node [fontname="Helvetica", fontsize=10]; edge [fontsize=8, color="#718096"];']
    by_scope: dict[str, list[dict[str, Any]]] = {}
    for n in view["nodes"]:
        by_scope.setdefault(n.get("scope") or "", []).append(n)
    for i, (scope, members) in enumerate(by_scope.items()):
        indent = "  "
        if scope:
            lines.append(f'  subgraph cluster_{i} {{ label="{_dot_text(scope)}"; style=rounded; color="#a0aec0";')
            indent = "    "
        for n in members:
            title = n.get("module") or n["name"]
            label = f"{title}\\n{n.get('label', '')}"
            style = _DOT_STYLE.get(n.get("kind", ""), _DOT_STYLE["module"])
            tooltip = _dot_text(str(n.get("detail") or n.get("kind", "")))
            lines.append(f'{indent}"{_dot_text(n["name"])}" [label="{_dot_text(label)}", {style}, tooltip="{tooltip}"];')
        if scope:
            lines.append("  }")
    by_name = {n["name"]: n for n in view["nodes"]}
    for n in view["nodes"]:
        for src in n["inputs"]:
            values = (by_name.get(src) or {}).get("values") or []
            label = ", ".join("x".join(map(str, v["shape"])) + f" {v['dtype']}" for v in values[:2])
            attrs = f' [label="{_dot_text(label)}"]' if label else ""
            lines.append(f'  "{_dot_text(src)}" -> "{_dot_text(n["name"])}"{attrs};')
    lines.append("}")
    return "\n".join(lines) + "\n"
