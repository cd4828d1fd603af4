"""Q4_K weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves) on a Q4_K_M synth model: the logits bit for bit those of the same file mapped (row-major), in prefill
(the GEMMs and the grouped MoE on de-interleaved stripes), decode (the one-call step, its fused MoE, the VNNI
interleaved GEMV) and the batched decode step (the few-column products), at 1 and 2 threads and every level."""

from functools import partial

from layout_model_cases import (MARKS, assert_numpy_twins_match, assert_same_logits, batched_logits, decode_logits,
                                mapped_and_held)

from engine.kernels import cpu

pytestmark = MARKS


def test_interleaved_q4_k_model_has_the_mapped_logits(synth_model, vnni):
    mapped, held, hp = mapped_and_held(synth_model("small", "q4_k_m"))
    assert any(r == "Q4_K resident interleaved" for r in held.weight_rules), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.Q4_K_IL.cpu_kernel for m in held.fused_moe.values())
    assert_same_logits(mapped, held, hp, [decode_logits, partial(batched_logits, lengths=(2, 5, 7))])


def test_numpy_twins_read_the_interleaved_q4_k_weights(synth_model, vnni):
    assert_numpy_twins_match(synth_model("small", "q4_k_m"), 2)
