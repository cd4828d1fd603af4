"""MXFP4 weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves): a synthetic MXFP4 model's logits bit for bit those of the same file mapped (row-major), in prefill
(the GEMMs and the grouped MoE: on VNNI the interleaved GEMV a column at a time, elsewhere the stripes
de-interleaved for the row-major kernel), decode (the one-call step and its fused MoE) and the batched step of
three sequences, at 1 and 2 threads and at every supported level after the load."""

from __future__ import annotations

import numpy as np
import pytest
from test_q4_0_interleaved_model import PROMPT, _logits, _model

from engine.gguf import resident
from engine.kernels import cpu
from engine.turn.state import SequenceState

pytestmark = [pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv"),
              pytest.mark.skipif("avx512vnni" not in cpu.supported_isas(), reason="interleaves on avx512vnni only")]


def _batched(model, hp) -> np.ndarray:
    """Three sequences after prefills of 2, 5 and 9 tokens, then two batched steps of one token each."""
    states = [SequenceState.new(hp, 32) for _ in range(3)]
    for n, state in zip((2, 5, 9), states):
        model.forward(PROMPT[:n], state)
    out = [model.forward_batch(np.array([20 + i, 30 + i, 40 + i]), states, [None] * 3) for i in range(2)]
    return np.concatenate([np.ravel(o) for o in out])


def test_interleaved_mxfp4_model_has_the_mapped_logits(synth_model, vnni):
    path = synth_model("tiny", "mxfp4")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    interleaved = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert interleaved and all(r.startswith("MXFP4 resident") for r in interleaved), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.MXFP4_IL.cpu_kernel for m in held.fused_moe.values())
    assert held.step is not None and not any(m.interleaved for m in mapped.mats.values())
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            for run in (_logits, _batched):
                want = run(mapped, hp)
                np.testing.assert_array_equal(run(held, hp).view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{run.__name__}, {level}, {threads} threads")


def test_numpy_twins_read_the_interleaved_mxfp4_weights(synth_model, vnni):
    path = synth_model("tiny", "mxfp4")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    cpu.set_isa("numpy")
    state_m, state_h = SequenceState.new(hp, 8), SequenceState.new(hp, 8)
    want = mapped.forward(PROMPT[:3], state_m)
    np.testing.assert_array_equal(held.forward(PROMPT[:3], state_h).view(np.uint32), want.view(np.uint32))
