"""Q2_K and Q3_K weights rewritten at load into the 4-row rows-as-lanes layouts (weights "ram", engine.arch.qwen35.cpu
interleaves): the model's logits bit for bit those of the same file mapped (row-major), in prefill (the GEMMs and
the grouped MoE), decode (the one-call step and its fused MoE) and the batched decode step (a few columns), at 1 and
2 threads and at every supported level after the load (avx512vnni: the rows-as-lanes kernel column by column; the
other levels: the groups unpacked for the row-major kernel)."""

from functools import partial

import pytest
from layout_model_cases import MARKS, assert_numpy_twins_match, assert_same_logits, decode_logits, mapped_and_held

from engine.kernels import cpu

pytestmark = MARKS
QUANTS = pytest.mark.parametrize("quant,traits", [("q2_k", cpu.Q2_K_RL), ("q3_k", cpu.Q3_K_RL)])


@QUANTS
def test_packed_model_has_the_mapped_logits(synth_model, vnni, quant, traits):
    mapped, held, hp = mapped_and_held(synth_model("small", quant))
    packed = {r: v for r, v in held.weight_rules.items() if r.endswith(" interleaved")}
    assert packed and all(r.startswith(f"{quant.upper()} resident") for r in packed), held.weight_rules
    assert held.fused_moe and all(m._c.gate_type == traits.cpu_kernel for m in held.fused_moe.values())
    assert_same_logits(mapped, held, hp, [partial(decode_logits, then_batch=True)])


@QUANTS
def test_numpy_twins_read_the_packed_weights(synth_model, vnni, quant, traits):
    assert_numpy_twins_match(synth_model("small", quant), 3)
