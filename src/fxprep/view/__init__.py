"""``fxprep.show``: a prepared graph as a page a person can read, from Python or the command line.

One self-contained HTML file (no server, no network at view time) shows what fxprep changed: modules
added, unrolled copies, opaque parts, ops left functional, shapes and dtypes on the edges, the
report, a search box, and a layout folded into the module hierarchy for big graphs. ``fxprep show
DIR -o graph.html`` and ``fxprep.show(gm, "graph.html")`` write the same page from the same code.

See docs/pictures.md (including why not an existing viewer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.fx as fx

from ..errors import InvalidInput, SerializationError
from .describe import KINDS, describe, describe_saved, record_values
from .html import render_dot, render_html

__all__ = ["KINDS", "describe", "describe_saved", "record_values", "render_dot", "render_html", "show"]


def show(source: fx.GraphModule | str | os.PathLike[str], path: str | os.PathLike[str] = "graph.html", *,
         example_inputs: Any = None) -> Path:
    """Write the HTML view of ``source`` to ``path`` (docs/pictures.md).

    Args:
        source: A module returned by :func:`fxprep.prepare_model` (its report shown too) or a directory written by :func:`fxprep.save` (read, not run).
        path: The HTML file to write.
        example_inputs: For a live module only: run it once on them to show every edge's shape and dtype.

    Returns:
        ``path``.

    Raises:
        InvalidInput: ``source`` is neither a ``GraphModule`` nor a directory, or ``example_inputs`` given with a directory.
        SerializationError: The saved directory cannot be read, or ``path`` cannot be written.
    """
    if isinstance(source, fx.GraphModule):
        view = describe(source, example_inputs)
    elif isinstance(source, (str, os.PathLike)):
        if example_inputs is not None:
            raise InvalidInput("fxprep.show: example_inputs are for a live module; a saved graph is shown as saved "
                               "(nothing of it is run).")
        view = describe_saved(source)
    else:
        raise InvalidInput(f"fxprep.show expects a torch.fx.GraphModule or a saved directory, not {type(source).__name__}.")
    out = Path(path)
    try:
        out.write_text(render_html(view), encoding="utf-8")
    except OSError as err:
        raise SerializationError(f"cannot write the graph view to {out}: {err.strerror or err}.") from err
    return out
