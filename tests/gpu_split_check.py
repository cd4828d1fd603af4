"""Split invariance of GPU prefill, measured on a GPU machine (a script, not a test).

Two figures:

1. ``CudaPrefill.prefill`` of one prompt in one pass vs in random pieces (the pieces a resumed
   prefix leaves): are the last-token logits and the recurrent state bit-identical, and if not, how
   far apart (max |a - b| / max |a|)?
2. A 4-turn greedy chat on ``Engine(device="cuda")`` with the prefix cache on vs off: how many
   answer tokens differ, with ``gpu_min_tokens`` = 1 (every piece on the GPU) and at its default
   (short pieces on the CPU model, as a follow-up turn's suffix is).

    python tests/gpu_split_check.py MODEL.gguf
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from engine.api import Engine, EngineOptions
from engine.events import TokenEvent
from engine.sampling import SamplingParams
from engine.turn.state import SequenceState

USERS = ["How many red circles are there?", "Where is the blue square?", "What colour is the triangle?",
         "Describe the picture in one sentence."]


def pieces(engine: Engine, rng: np.random.Generator, n: int = 300, trials: int = 6) -> None:
    gpu, hp = engine.gpu, engine.text.hparams
    tokens = rng.integers(0, hp.n_vocab, n)
    whole_state = SequenceState.new(hp, 512)
    whole = gpu.prefill(tokens, whole_state)[-1]
    for _ in range(trials):
        cuts = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(1, 6)), replace=False).tolist())
        state = SequenceState.new(hp, 512)
        for a, b in zip([0] + cuts, cuts + [n]):
            logits = gpu.prefill(tokens[a:b], state)[-1]
        gap = float(np.abs(logits - whole).max() / np.abs(whole).max())
        ssm = max(float(np.abs(state.ssm[il] - whole_state.ssm[il]).max()) for il in state.ssm)
        print(f"cuts {cuts}: logits bit-identical {np.array_equal(logits, whole)}, rel gap {gap:.2e}, "
              f"max ssm gap {ssm:.2e}")


def chat(path: str, cache: bool, min_tokens: int) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as folder:
        engine = Engine.load(path, options=EngineOptions(device="cuda", prefix_cache=cache, gpu_min_tokens=min_tokens,
                                                         cache_disk_dir=Path(folder) if cache else None))
        messages: list[dict] = []
        turns = []
        for user in USERS:
            messages.append({"role": "user", "content": user})
            ids, text = [], ""
            for event in engine.chat(messages, SamplingParams.greedy(24)):
                if isinstance(event, TokenEvent):
                    ids.append(event.token_id)
                    text += event.text
            messages.append({"role": "assistant", "content": text})
            turns.append(ids)
        engine.close()
    return turns


def main() -> None:
    path = sys.argv[1]
    engine = Engine.load(path, options=EngineOptions(device="cuda", prefix_cache=False))
    print("device:", engine.info.device, engine.info.device_note)
    pieces(engine, np.random.default_rng(0))
    engine.close()
    for min_tokens in (1, 32):
        on, off = chat(path, True, min_tokens), chat(path, False, min_tokens)
        diff = sum(sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(on, off))
        print(f"gpu_min_tokens={min_tokens}: cache on vs off, {diff} of {sum(map(len, off))} answer tokens differ")


if __name__ == "__main__":
    main()
