"""Expert pruning (REAP): routing statistics over calibration inputs (:mod:`.prune`, :mod:`.inputs`) and
the pruned GGUF file written from them (:mod:`.pruned`).
"""
