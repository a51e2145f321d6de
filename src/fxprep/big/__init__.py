"""Models bigger than the device: weights loaded after a meta prepare (:mod:`.weights`), checkpoints,
the graph cut into stages (:mod:`.partition`) and run stage by stage (:mod:`.sequential`),
device maps (:mod:`.placement`), where weights wait (:mod:`.weight_store`).
"""
