"""transformers: cache off, attention implementation, config inputs, output recorders,
methods rewritten for capture, hub checkpoints. Nothing here imports
``transformers`` unless the model is a transformers model.
"""
