"""One turn of generation: prefill and decode (:mod:`.runtime`), batched decode steps of several turns
(:mod:`.batch`), the per-sequence recurrent and KV state
(:mod:`.state`), the prefix cache and its snapshot files (:mod:`.prefix_cache`, :mod:`.snapshot`), and
constrained decoding's token masks (:mod:`.grammar`).
"""
