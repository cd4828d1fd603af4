"""Q4_0 weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves): the model's logits bit for bit those of the same file mapped (row-major), in prefill (the GEMMs and
the grouped MoE, stripes de-interleaved for the row-major kernel) and decode (the one-call step and its fused MoE,
the VNNI interleaved GEMV), at 1 and 2 threads and at every supported level after the load."""

from __future__ import annotations

import pytest
from layout_model_cases import (MARKS, assert_numpy_twins_match, assert_same_logits, decode_logits, mapped_and_held,
                                open_model)


from engine import placement
from engine.api_types import EngineOptions
from engine.kernels import cpu
from engine.registry import open_text

pytestmark = MARKS


def test_interleaved_model_has_the_mapped_logits(synth_model, vnni):
    mapped, held, hp = mapped_and_held(synth_model("tiny", "q4_0"))
    interleaved = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert interleaved and all(r.startswith("Q4_0 resident") for r in interleaved), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.Q4_0_IL.cpu_kernel for m in held.fused_moe.values())
    assert_same_logits(mapped, held, hp, [decode_logits])


def test_numpy_twins_read_the_interleaved_weights(synth_model, vnni):
    assert_numpy_twins_match(synth_model("tiny", "q4_0"), 3)


def test_not_interleaved_on_other_levels(synth_model):
    try:
        cpu.set_isa("avx2")
        held, _ = open_model(synth_model("tiny", "q4_0"), "ram")
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
