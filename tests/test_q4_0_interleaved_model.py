"""Q4_0 weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves): the model's logits bit for bit those of the same file mapped (row-major), in prefill (the GEMMs and
the grouped MoE, stripes de-interleaved for the row-major kernel) and decode (the one-call step and its fused MoE,
the VNNI interleaved GEMV), at 1 and 2 threads and at every supported level after the load."""

from __future__ import annotations

import numpy as np
import pytest

from engine import placement
from engine.api_types import EngineOptions
from engine.gguf import resident
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

pytestmark = [pytest.mark.skipif(not resident.supported(), reason="weights 'ram' needs POSIX readv"),
              pytest.mark.skipif("avx512vnni" not in cpu.supported_isas(), reason="interleaves on avx512vnni only")]

PROMPT, DECODED = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), (11, 12, 13)


def _model(path, weights: str):
    text = open_text(path, weights)
    return text.arch.native_model(text.hparams, text.file), text.hparams


def _logits(model, hp) -> np.ndarray:
    """A 9-token prefill's logits, then three decoded tokens' (each through the one-call step)."""
    state = SequenceState.new(hp, 32)
    out = [np.ravel(model.forward(PROMPT, state))]
    for t in DECODED:
        assert model.step is not None and model.step.takes(1, None)
        out.append(np.ravel(model.forward(np.array([t]), state)))
    return np.concatenate(out)



def test_interleaved_model_has_the_mapped_logits(synth_model, vnni):
    path = synth_model("tiny", "q4_0")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    interleaved = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert interleaved and all(r.startswith("Q4_0 resident") for r in interleaved), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.Q4_0_IL.cpu_kernel for m in held.fused_moe.values())
    assert not any(m.interleaved for m in mapped.mats.values())
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            want = _logits(mapped, hp)
            np.testing.assert_array_equal(_logits(held, hp).view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{level}, {threads} threads")


def test_numpy_twins_read_the_interleaved_weights(synth_model, vnni):
    path = synth_model("tiny", "q4_0")
    mapped, hp = _model(path, "map")
    held, _ = _model(path, "ram")
    cpu.set_isa("numpy")
    state_m, state_h = SequenceState.new(hp, 8), SequenceState.new(hp, 8)
    want = mapped.forward(PROMPT[:3], state_m)
    np.testing.assert_array_equal(held.forward(PROMPT[:3], state_h), want)


def test_not_interleaved_on_other_levels(synth_model):
    try:
        cpu.set_isa("avx2")
        held, _ = _model(synth_model("tiny", "q4_0"), "ram")
    finally:
        cpu.set_isa(None)
    assert not any(r.endswith(" interleaved") for r in held.weight_rules), held.weight_rules


@pytest.mark.parametrize("device,weights,gpu,repacked", [("cpu", "ram", True, True), ("auto", "ram", True, False),
                                                         ("cuda", "ram", True, False), ("auto", "ram", False, True),
                                                         ("cuda", "ram", False, True)])
def test_no_repack_where_gpu_prefill_may_read_the_bytes(synth_model, vnni, monkeypatch, device, weights, gpu,
                                                        repacked):
    monkeypatch.setattr(placement, "_gpu_present", lambda: gpu)   # without a GPU no prefill can upload the bytes
    text = open_text(synth_model("tiny", "q4_0"), weights)
    model = placement.text_model(text, EngineOptions(device=device, weights=weights))
    assert any(r.endswith(" interleaved") for r in model.weight_rules) == repacked, model.weight_rules
