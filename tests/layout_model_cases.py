"""What the repacked-layout model tests share: a model opened mapped (row-major) and "ram" (repacked at load), the
logits of a prefill, decoded steps and batched steps, and the checks that the two give the same bits (float32
logits compared as uint32) at every supported level and 1 and 2 threads, and under the numpy twins."""

from __future__ import annotations

import numpy as np
import pytest

from engine.gguf import resident
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

MARKS = [pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv"),
         pytest.mark.skipif("avx512vnni" not in cpu.supported_isas(), reason="repacks on avx512vnni only")]

PROMPT, DECODED = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), (11, 12, 13)


def open_model(path, weights: str):
    """The native model of the GGUF at path with weights "map" or "ram", and its hparams."""
    text = open_text(path, weights)
    return text.arch.native_model(text.hparams, text.file), text.hparams


def mapped_and_held(path):
    """(mapped, held, hparams) of the file at path; the mapped model holds no repacked matrix."""
    mapped, hp = open_model(path, "map")
    held, _ = open_model(path, "ram")
    assert not any(m.interleaved for m in mapped.mats.values())
    return mapped, held, hp


def decode_logits(model, hp, then_batch: bool = False) -> np.ndarray:
    """A 9-token prefill's logits, then three decoded tokens' (each through the one-call step); with then_batch,
    then a batched step of two sequences (the prefilled one and a fresh one)."""
    state = SequenceState.new(hp, 32)
    out = [np.ravel(model.forward(PROMPT, state))]
    for t in DECODED:
        assert model.step is not None and model.step.takes(1, None)
        out.append(np.ravel(model.forward(np.array([t]), state)))
    if then_batch:
        states = [state, SequenceState.new(hp, 32)]
        out.append(np.ravel(model.forward_batch(np.array([21, 22]), states, [None, None])))
    return np.concatenate(out)


def batched_logits(model, hp, lengths) -> np.ndarray:
    """Three sequences after prefills of PROMPT[:n] for n in lengths, then two batched steps of one token each."""
    states = [SequenceState.new(hp, 32) for _ in lengths]
    for n, state in zip(lengths, states):
        model.forward(PROMPT[:n], state)
    out = [model.forward_batch(np.array([20 + i, 30 + i, 40 + i]), states, [None] * 3) for i in range(2)]
    return np.concatenate([np.ravel(o) for o in out])


def assert_same_logits(mapped, held, hp, runs) -> None:
    """Every run(model, hp) in runs gives held the bits of mapped, at every supported level and 1 and 2 threads."""
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            for run in runs:
                want = run(mapped, hp)
                np.testing.assert_array_equal(run(held, hp).view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{getattr(run, '__name__', run)}, {level}, {threads} threads")


def assert_numpy_twins_match(path, n: int) -> None:
    """Under the numpy level, a prefill of PROMPT[:n] gives the repacked model the mapped one's logits."""
    mapped, held, hp = mapped_and_held(path)
    cpu.set_isa("numpy")
    state_m, state_h = SequenceState.new(hp, 8), SequenceState.new(hp, 8)
    want = mapped.forward(PROMPT[:n], state_m)
    np.testing.assert_array_equal(held.forward(PROMPT[:n], state_h).view(np.uint32), want.view(np.uint32))
