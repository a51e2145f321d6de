"""What a prepared module runs and carries: its class (:mod:`.prepared`), forward code, input
guard, baked values, modes, and the helpers its graph calls (:mod:`.wrap`, :mod:`.opaque`).
The op modules (``fxprep.ops``), ``fxprep.cond`` and ``fxprep.decisions`` stay at the package
root: saves name them.
"""
