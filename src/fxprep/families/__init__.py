"""Model-family knowledge: what fxprep does differently for a family's models. One sub-package
per family (:mod:`.transformers`).
"""
