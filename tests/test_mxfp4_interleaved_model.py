"""MXFP4 weights rewritten at load into the 8-row interleaved layout (weights "ram", engine.arch.qwen35.cpu
interleaves): a synthetic MXFP4 model's logits bit for bit those of the same file mapped (row-major), in prefill
(the GEMMs and the grouped MoE: on VNNI the interleaved GEMV a column at a time, elsewhere the stripes
de-interleaved for the row-major kernel), decode (the one-call step and its fused MoE) and the batched step of
three sequences, at 1 and 2 threads and at every supported level after the load."""

from functools import partial

from layout_model_cases import (MARKS, assert_numpy_twins_match, assert_same_logits, batched_logits, decode_logits,
                                mapped_and_held)

from engine.kernels import cpu

pytestmark = MARKS


def test_interleaved_mxfp4_model_has_the_mapped_logits(synth_model, vnni):
    mapped, held, hp = mapped_and_held(synth_model("tiny", "mxfp4"))
    interleaved = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert interleaved and all(r.startswith("MXFP4 resident") for r in interleaved), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == cpu.MXFP4_IL.cpu_kernel for m in held.fused_moe.values())
    assert held.step is not None
    assert_same_logits(mapped, held, hp, [decode_logits, partial(batched_logits, lengths=(2, 5, 9))])


def test_numpy_twins_read_the_interleaved_mxfp4_weights(synth_model, vnni):
    assert_numpy_twins_match(synth_model("tiny", "mxfp4"), 3)
