"""Measure what loading a model really costs, for tests/test_hub_fit.py: run as
``python tests/hub_fit_probe.py MODEL MMPROJ CONTEXT`` in a fresh process; prints one JSON line.

RSS growth (psutil) from after the imports to after ``Engine.load`` (CPU, no prefix cache), a read of every
page of the mapped model file (what decode touches over time: all of a dense model each token, all experts of
a MoE model after a few hundred tokens) and a greedy decode of 32 tokens, whose decode tok/s is reported too.
"""

import json
import sys

import numpy as np
import psutil

from engine.api import Engine, EngineOptions
from engine.sampling import SamplingParams


def main() -> None:
    model, mmproj, context = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
    proc = psutil.Process()
    before = proc.memory_info().rss
    engine = Engine.load(model, mmproj, EngineOptions(context=context, device="cpu", prefix_cache=False))
    for name in engine.text.file.tensor_names:
        np.asarray(engine.text.file.raw(name)).reshape(-1)[::4096].sum()
    summary = None
    for ev in engine.generate(list(range(1000, 1016)), SamplingParams.greedy(32)):
        summary = ev
    after = proc.memory_info().rss
    print(json.dumps({"rss_growth": after - before, "decode_tok_s": summary.decode_tok_s,
                      "generated": summary.generated_tokens}))


if __name__ == "__main__":
    main()
