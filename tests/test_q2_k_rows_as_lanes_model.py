"""Q2_K weights rewritten at load into the 4-row rows-as-lanes layout (weights "ram", engine.arch.qwen35.cpu
interleaves): the model's logits bit for bit those of the same file mapped (row-major), in prefill (the GEMMs and
the grouped MoE), decode (the one-call step and its fused MoE) and the batched decode step (a few columns), at 1 and
2 threads and at every supported level after the load (avx512vnni: the rows-as-lanes kernel column by column; the
other levels: the groups unpacked for the row-major kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.gguf import resident
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

pytestmark = [pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv"),
              pytest.mark.skipif("avx512vnni" not in cpu.supported_isas(), reason="repacks on avx512vnni only")]

PROMPT, DECODED = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), (11, 12, 13)


def _model(path, weights: str):
    text = open_text(path, weights)
    return text.arch.native_model(text.hparams, text.file), text.hparams


def _logits(model, hp) -> np.ndarray:
    """A 9-token prefill's logits, three decoded tokens' (the one-call step), then a batched step of two
    sequences (the prefilled one and a fresh one)."""
    state = SequenceState.new(hp, 32)
    out = [np.ravel(model.forward(PROMPT, state))]
    for t in DECODED:
        assert model.step is not None and model.step.takes(1, None)
        out.append(np.ravel(model.forward(np.array([t]), state)))
    states = [state, SequenceState.new(hp, 32)]
    out.append(np.ravel(model.forward_batch(np.array([21, 22]), states, [None, None])))
    return np.concatenate(out)


def test_packed_model_has_the_mapped_logits(synth_model, vnni):
    path = synth_model("small", "q2_k")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    packed = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert packed and all(r.startswith("Q2_K resident") for r in packed), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.Q2_K_RL.cpu_kernel for m in held.fused_moe.values())
    assert not any(m.interleaved for m in mapped.mats.values())
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            want = _logits(mapped, hp)
            np.testing.assert_array_equal(_logits(held, hp).view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{level}, {threads} threads")


def test_numpy_twins_read_the_packed_weights(synth_model, vnni):
    path = synth_model("small", "q2_k")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    cpu.set_isa("numpy")
    state_m, state_h = SequenceState.new(hp, 8), SequenceState.new(hp, 8)
    want = mapped.forward(PROMPT[:3], state_m)
    np.testing.assert_array_equal(held.forward(PROMPT[:3], state_h), want)
