"""The user's model, touched without changing it: example inputs and the calling convention, runs
that restore what they change, dotted module paths, the capture lock, the heap freeze, a
node's source frames. Every other layer uses these; they use nothing of fxprep's but errors.
"""
