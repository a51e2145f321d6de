"""``prepare_model``'s pipeline, run by ``fxprep/api.py``: what its stages share (:mod:`.state`),
AIMET's positional arguments checked (:mod:`.arguments`), the model's own hooks set aside
(:mod:`.root_hooks`), the verification stage (:mod:`.verification`); and
``check_traceability`` (:mod:`.traceability`), each tracer alone.
"""
