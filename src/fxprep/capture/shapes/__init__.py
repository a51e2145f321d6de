"""The dims a shape-general capture declares, reasoned about without running Dynamo: proposed
from the inputs (:mod:`.autodims`), declared (:mod:`.dims`), what a constraint violation
(:mod:`.violation`) and a guard's range (:mod:`.guard_range`) say of them. The capture
itself is :mod:`fxprep.capture.shape_general`; Dynamo's guards are read in
:mod:`fxprep.capture.dynamo`.
"""
