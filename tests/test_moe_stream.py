"""The family-free MoE streaming plan (engine.kernels.moe_stream), fed sizes directly (no model, no GPU).

Each expectation is derived from the rule it checks: resident weights and state first, the reserve kept
free, then whole expert layers in the given order while two stream buffers still fit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.errors import DeviceBudgetError, DeviceError
from engine.gguf.quant import row_bytes
from engine.kernels.cuda_layout import Matrix, aligned
from engine.kernels.moe_stream import (LayerTelemetry, PrefillTelemetry, expected_distinct, expert_layout,
                                       place_experts)

MIB = 1 << 20


def _place(budget: int, layers: tuple[int, ...] = tuple(range(6)), layer_bytes: int = 100 * MIB):
    mats = [Matrix(f"m{i}", Q.Q8_0, 512, 1024, row_bytes(Q.Q8_0, 1024), False) for i in range(4)]
    weights = sum(aligned(m.nbytes) for m in mats) + MIB
    plan = place_experts(budget, mats, MIB, 3 * MIB, layers, layer_bytes, 128, reserve=40 * MIB,
                         minimum_reserve=10 * MIB)
    return weights, plan


def test_all_layers_resident_when_they_fit():
    weights, p = _place(1 << 30)
    assert p.resident_experts == tuple(range(6)) and not p.streamed_experts and p.n_slots == 0
    assert p.fixed_bytes == weights + 3 * MIB + 6 * aligned(100 * MIB)


def test_layers_stream_in_the_given_order_through_two_buffers():
    layers = (5, 4, 3, 2, 1, 0)
    budget = 500 * MIB
    weights, p = _place(budget, layers)
    slot = aligned(100 * MIB)
    n_res = (budget - weights - 3 * MIB - 2 * slot - 40 * MIB) // slot
    assert 0 < n_res < len(layers)
    assert p.resident_experts == layers[:n_res] and p.streamed_experts == layers[n_res:]
    assert p.n_slots == 2 and p.slot_bytes == slot
    assert p.fixed_bytes + p.reserve <= p.budget
    assert "pinned host RAM" in p.text() and f"({len(layers) - n_res} layers," in p.text()


def test_dense_model_places_no_experts():
    _, p = _place(64 * MIB, layers=(), layer_bytes=0)
    assert p.resident_experts == p.streamed_experts == () and p.n_slots == 0 and p.expert_layer_bytes == 0


def test_budget_below_buffers_and_minimum_reserve_is_a_budget_error():
    weights, _ = _place(1 << 30)
    minimum = weights + 3 * MIB + 2 * aligned(100 * MIB) + 10 * MIB
    _place(minimum)
    with pytest.raises(DeviceBudgetError, match="VRAM budget"):
        _place(minimum - 1)


def test_expert_layout_packs_gate_up_then_down_and_names_the_layer():
    lay = expert_layout("blk.7", 8, 64, 96, Q.Q4_0, Q.Q4_0, Q.Q6_K)
    assert lay.down_qtype == Q.Q8_0
    assert lay.stride == 2 * 64 * row_bytes(Q.Q4_0, 96) + 96 * row_bytes(Q.Q8_0, 64)
    assert lay.nbytes == 8 * lay.stride
    with pytest.raises(DeviceError, match="blk.7"):
        expert_layout("blk.7", 8, 64, 96, Q.Q4_0, Q.Q8_0, Q.Q8_0)


def test_expected_distinct_matches_sampling():
    rng = np.random.default_rng(0)
    E, k, n = 32, 4, 10
    draws = [len(np.unique(np.concatenate([rng.permutation(E)[:k] for _ in range(n)]))) for _ in range(2000)]
    assert abs(np.mean(draws) - expected_distinct(E, k, n)) < 0.2


def test_telemetry_sums_events_per_layer():
    tel = PrefillTelemetry(n_tokens=10, passes=1, mode="streamed", wall_ms=5.0, gpu_ms=4.0, h2d_bytes=0, h2d_ms=0.0,
                           vram_budget=0, vram_used=0, vram_free=0,
                           layers=[LayerTelemetry(0, "attention", "resident"), LayerTelemetry(1, "gdn", "streamed")])
    tel.add_events([(0, "compute", 1.5, 0), (1, "copy", 2.0, 3000), (1, "copy", 1.0, 1000)], {0: 1000, 1: 1000})
    assert tel.layers[0].compute_ms == 1.5 and tel.layers[1].experts_copied == 4
    assert tel.h2d_bytes == 4000 and tel.h2d_ms == 3.0 and tel.h2d_gbs == 4000 / 3.0 / 1e6
    assert tel.tok_s == 10 / 5e-3
