"""Preparation passes: each one a plain ``GraphModule -> GraphModule`` function in its own module,
testable alone. ``api.py`` runs them in order; each appends what it did to a
:class:`fxprep.reporting.report.Report` when given one."""
