"""Q4_K weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves) on a Q4_K_M synth model: the logits bit for bit those of the same file mapped (row-major), in prefill
(the GEMMs and the grouped MoE on de-interleaved stripes), decode (the one-call step, its fused MoE, the VNNI
interleaved GEMV) and the batched decode step (the few-column products), at 1 and 2 threads and every level."""

from __future__ import annotations

import numpy as np
import pytest
from test_q4_0_interleaved_model import _logits, _model

from engine.gguf import resident
from engine.kernels import cpu
from engine.turn.state import SequenceState

pytestmark = [pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv"),
              pytest.mark.skipif("avx512vnni" not in cpu.supported_isas(), reason="interleaves on avx512vnni only")]


def _batched(model, hp) -> np.ndarray:
    """Three sequences (prompts of 2, 5 and 7 tokens) decoded together for two steps: the batch's logits."""
    states = [SequenceState.new(hp, 32) for _ in range(3)]
    for i, state in enumerate(states):
        model.forward(np.arange(1, 3 + 2 * i + (i > 0)), state)
    out = [model.forward_batch(np.array([20 + s, 30 + s, 40 + s]), states, [None] * 3) for s in range(2)]
    return np.concatenate(out)


def test_interleaved_q4_k_model_has_the_mapped_logits(synth_model, vnni):
    path = synth_model("small", "q4_k_m")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    assert any(r == "Q4_K resident interleaved" for r in held.weight_rules), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.Q4_K_IL.cpu_kernel for m in held.fused_moe.values())
    assert not any(m.interleaved for m in mapped.mats.values())
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            for run in (_logits, _batched):
                want = run(mapped, hp)
                np.testing.assert_array_equal(run(held, hp).view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{run.__name__}, {level}, {threads} threads")


def test_numpy_twins_read_the_interleaved_q4_k_weights(synth_model, vnni):
    path = synth_model("small", "q4_k_m")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    cpu.set_isa("numpy")
    state_m, state_h = SequenceState.new(hp, 8), SequenceState.new(hp, 8)
    want = mapped.forward(np.array([1, 2]), state_m)
    np.testing.assert_array_equal(held.forward(np.array([1, 2]), state_h), want)
