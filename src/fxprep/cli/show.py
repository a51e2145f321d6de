"""``fxprep show``: a saved graph as Graphviz DOT or a self-contained HTML page.

Works from :func:`fxprep.io.inspect_saved`'s view (JSON only: nothing imported or run), so it is
safe on files from anyone.
"""

from __future__ import annotations

from typing import Any


def render_dot(view: dict[str, Any]) -> str:
    """The graph in Graphviz DOT, one box per node coloured by its op."""
    lines = ["digraph fxprep {", '  rankdir=TB; node [shape=box, fontname="Helvetica", fontsize=10];']
    colors = {"placeholder": "lightblue", "output": "lightblue", "call_module": "white",
              "call_function": "lightyellow", "call_method": "lightyellow", "get_attr": "lightgrey"}
    for n in view["nodes"]:
        label = f"{n['name']}\\n{n['what']}".replace('"', "'")
        lines.append(f'  "{n["name"]}" [label="{label}", style=filled, fillcolor={colors.get(n["op"], "white")}];')
        for src in n["inputs"]:
            lines.append(f'  "{src}" -> "{n["name"]}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_html(view: dict[str, Any], svg: str | None) -> str:
    """A page with the SVG (when there is one) and a table of every node."""
    from html import escape

    rows = "\n".join(
        f"<tr><td>{i}</td><td>{escape(n['name'])}</td><td>{n['op']}</td><td>{escape(n['what'])}</td>"
        f"<td>{escape(', '.join(n['inputs']))}</td></tr>"
        for i, n in enumerate(view["nodes"])
    )
    body = svg or ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(view['class_name'])} (fxprep)</title>"
        "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}</style>"
        f"</head><body><h1>{escape(view['class_name'])}</h1><p>{len(view['nodes'])} nodes, saved with fxprep "
        f"{escape(str(view['manifest'].get('fxprep_version')))}, torch {escape(str(view['manifest'].get('torch_version')))}</p>"
        f"{body}<table><tr><th>#</th><th>node</th><th>op</th><th>target</th><th>inputs</th></tr>{rows}</table></body></html>\n"
    )
