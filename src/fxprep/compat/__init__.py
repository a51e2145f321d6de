"""Hand-off adapters: what a prepared graph needs to be accepted by a particular toolkit.

* :mod:`.aimet`: a drop-in for AIMET's ``prepare_model`` (AIMET's names and classes), and the
  registration of fxprep's op modules with AIMET's QuantSim (:mod:`.aimet_quantsim`).

* :mod:`.retrace`: a graph for toolkits that re-trace or read it (shape-only code folded, identity
  casts dropped, shapes on every node), used by :mod:`.brevitas` (Brevitas graph mode) and
  :mod:`.mct` (Sony MCT PTQ); :mod:`.nncf` hands the graph to NNCF's torch backend.

torch's own flows need no adapter: ``prepare_fx`` traces into fxprep's op modules, PT2E takes
``fxprep.export_program(gm, x).module()``, and :mod:`fxprep.passes.to_functional` turns op modules
back into calls for tools that match functional patterns without re-tracing.

Nothing here is imported by ``import fxprep``; each adapter imports its toolkit only when used.
"""
