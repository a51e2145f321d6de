"""Hand-off adapters: what a prepared graph needs to be accepted by a particular toolkit.

:mod:`.aimet` (AIMET's preparer, drop-in) and :mod:`.aimet_quantsim` (fxprep's ops in QuantSim);
:mod:`.retrace` (a graph for toolkits that re-trace it), used by :mod:`.brevitas` and :mod:`.mct`;
:mod:`.nncf`; :mod:`.llmcompressor`. Each keeps one contract, a module-level ``ADAPTER``
(:mod:`.contract`), and imports its toolkit only when used; nothing outside ``compat/`` and ``cli/``
imports one. torch's own flows (``prepare_fx``, PT2E) need no adapter.

See docs/handoff/ (a page per toolkit) and docs/architecture.md (a new toolkit adapter).
"""
