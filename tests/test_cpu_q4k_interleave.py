"""The 8-row interleaved Q4_K layout (engine.kernels.cpu_q4il, native/cpu/quant/q4k_interleave.c, q4k_il_avx512.h).

The layout is checked against a numpy construction of its definition (deltadesk_cpu.h) from the scales and mins
that gguf's own unpacking gives (engine.gguf.quant's layout, ggml's get_scale_min_k4), the repack's inverse
against the original bytes, and the interleaved products (DD_Q4_K_IL through cpu.Matrix) against the row-major
Q4_K kernel of each level bit for bit (the AVX-512 VNNI GEMV's terms are the same f32 products, scaled by
powers of two that cancel, added in the same order; docs/design/q4-k-row-interleave.md) and against the
float64 product within the summation bound of test_cpu_kquants, (k // 32 + 16) * 2^-24 * sum_i |w_i a_i|.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from layout_cases import Layout, assert_row_major_bits, check_refusals, check_round_trip, check_rows_slice
from test_cpu_kernels import assert_close, reference_product, rng  # noqa: F401 (fixture)
from test_cpu_kquants import random_kquant

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, cpu_q4il
from engine.kernels.cpu_twins import kquant_unpack, q4_k_deinterleave_np

Q = GGMLQuantizationType
native = pytest.mark.skipif(cpu_q4il._native_cpu is None, reason="native kernels not built")


def layout_np(raw: np.ndarray) -> np.ndarray:
    """The interleaved bytes by the layout's definition (deltadesk_cpu.h), from gguf's decoding of each row."""
    rows, rb = raw.shape
    nsb, full = rb // 144, rows // 8 * 8
    out = raw.copy()
    if full == 0:
        return out
    b = raw[:full].view(quant.BLOCK_DTYPES[Q.Q4_K]).reshape(full // 8, 8, nsb)       # (stripe, row, sb)
    _, sc16, mn, _, _ = kquant_unpack(raw[:full], Q.Q4_K)
    sc = sc16[..., ::2].reshape(full // 8, 8, nsb, 8).transpose(0, 2, 3, 1)         # (stripe, sb, i, row)
    mn = mn.reshape(full // 8, 8, nsb, 8).transpose(0, 2, 3, 1)
    blk = np.zeros((full // 8, nsb, 1152), np.uint8)
    blk[..., 0:16] = b["d"].transpose(0, 2, 1).copy().view(np.uint8)
    blk[..., 16:32] = b["dmin"].transpose(0, 2, 1).copy().view(np.uint8)
    blk[..., 32:64] = ((sc[:, :, :4] & 15) | (sc[:, :, 4:] & 15) << 4).reshape(full // 8, nsb, 32)
    blk[..., 64:96] = ((mn[:, :, :4] & 15) | (mn[:, :, 4:] & 15) << 4).reshape(full // 8, nsb, 32)
    blk[..., 96:128] = (sc[:, :, :4] >> 4 | (sc[:, :, 4:] >> 4) << 2 | (mn[:, :, :4] >> 4) << 4
                        | (mn[:, :, 4:] >> 4) << 6).reshape(full // 8, nsb, 32)
    qs = b["qs"].reshape(full // 8, 8, nsb, 4, 8, 4)                                  # (stripe, row, sb, j, u, t)
    blk[..., 128:] = qs.transpose(0, 2, 3, 4, 1, 5).reshape(full // 8, nsb, 1024)
    out[:full] = blk.reshape(full, rb)
    return out


NATIVE = cpu_q4il._native_cpu is not None
LAYOUT = Layout(Q.Q4_K, 8, 144, partial(cpu_q4il.interleave, qtype=Q.Q4_K) if NATIVE else None,
                partial(cpu_q4il.deinterleave, qtype=Q.Q4_K) if NATIVE else None, layout_np)


@native
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 23, 64])
@pytest.mark.parametrize("k", [256, 768, 2304])
def test_repack_is_the_layout_and_its_inverse_restores_the_bytes(rows, k, rng):
    check_round_trip(LAYOUT, rng.integers(0, 256, (rows, k // 256 * 144), dtype=np.uint8))   # every scale bit


@native
def test_repack_refuses_read_only_and_partial_blocks():
    check_refusals(LAYOUT, 160, "whole Q4_K blocks", cpu_q4il.MAX_ROW_BYTES[Q.Q4_K])


def test_numpy_twin_deinterleaves_the_layout(rng):
    raw = rng.integers(0, 256, (29, 512 // 256 * 144), dtype=np.uint8)
    np.testing.assert_array_equal(q4_k_deinterleave_np(layout_np(raw)), raw)


SHAPES = [(5, 256), (8, 256), (13, 768), (69, 512), (41, 2304), (136, 2048)]
COLUMNS = [1, 2, 3, 4, 5, 6, 7, 8, 17, 64]   # 2-8: the few-column product (3-4 columns a stripe visit by one
# walk, 1-2 by another: 7 = 4 + 3, 6 = 4 + 2); more: the prompt GEMM


# The longest rows (one stripe per de-interleaved piece) once per path: GEMV and few columns; the prompt GEMM's
# long rows are test_prompt_gemm_on_the_stripes_has_the_row_major_bits's.
# k = 4352: the four-column walk's passes of 8 super-blocks (8 + 8 + 1); k = 18688: 73 super-blocks, so the call
# holds the activation terms of 3 columns at a time (8 = 3 + 3 + 2).
@pytest.mark.parametrize("rows,k,m", [(r, k, m) for r, k in SHAPES for m in COLUMNS]
                         + [(17, 28672, m) for m in COLUMNS if m <= 8]
                         + [(r, k, m) for r, k in [(16, 4352), (9, 18688)] for m in (3, 4, 7, 8)])
def test_interleaved_matrix_has_the_row_major_bits(rows, k, m, rng):
    raw = random_kquant(rng, rows, k, Q.Q4_K)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_row_major_bits(LAYOUT, raw, k, x, numpy_threads=(1,))
    ref, abs_sum = reference_product(raw, x, Q.Q4_K)
    assert_close(LAYOUT.matrix(raw, k)(x), ref, abs_sum, k // 32)


# The prompt GEMM on the stripes (m > 8): m just above 8 and 1-3 columns past a 4-column tile; 1, 3, 5 and 17
# stripes with and without a rows % 8 tail; more stripes than one expanded range holds (k = 256: 73, k = 2048: 9);
# the longest rows it reads directly (73 super-blocks: one stripe a range, 4 columns a block), one super-block
# more (the de-interleave) and the longest rows the layout takes.
@pytest.mark.parametrize("rows,k,m", [(8, 256, 9), (24, 512, 9), (27, 768, 11), (45, 2048, 13), (136, 2048, 33),
                                      (600, 256, 10), (19, 18688, 9), (17, 18944, 10), (9, 28672, 9)])
def test_prompt_gemm_on_the_stripes_has_the_row_major_bits(rows, k, m, rng):
    raw = random_kquant(rng, rows, k, Q.Q4_K)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_row_major_bits(LAYOUT, raw, k, x, numpy_threads=(1,))


@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_interleaved_gemv_zero_and_extreme_scales(m, rng):
    """Zero rows, the largest and smallest f16 d and dmin, and scales and mins of 0 and 63."""
    k = 768
    raw = random_kquant(rng, 16, k, Q.Q4_K)
    b = raw.view(quant.BLOCK_DTYPES[Q.Q4_K]).reshape(16, 3)
    raw[3, :] = 0
    b["d"][5, 1], b["dmin"][6, 0] = np.float16(65504.0), np.float16(-65504.0)
    b["d"][9, 2], b["dmin"][10, 2] = np.float16(6e-8), np.float16(-6e-8)
    b["scales"][12, 0] = quant.pack_k_scales(np.full(8, 63), np.zeros(8, int))
    b["scales"][13, 1] = quant.pack_k_scales(np.zeros(8, int), np.full(8, 63))
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert_row_major_bits(LAYOUT, raw, k, x, threads=(1, 2), numpy_threads=(1,))


def test_rows_slice_keeps_the_stripes(rng):
    raw = random_kquant(rng, 27, 256, Q.Q4_K)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    check_rows_slice(LAYOUT.matrix(raw, 256), x, ((8, 16), (16, 27), (24, 27)), ((4, 16),), "stripes", cpu.Q4_K_IL)


def test_moe_on_interleaved_experts_has_the_row_major_bits(rng):
    """The fused MoE (one token, and the grouped prompt call) on interleaved Q4_K experts and shared expert:
    the bits of the same experts row-major, on every level (the per-expert products pick DD_Q4_K_IL by type)."""
    d, n_expert, ff = 512, 8, 256
    raws = {"gate": random_kquant(rng, n_expert * ff, d, Q.Q4_K), "up": random_kquant(rng, n_expert * ff, d, Q.Q4_K),
            "down": random_kquant(rng, n_expert * d, ff, Q.Q4_K), "sh_gate": random_kquant(rng, ff, d, Q.Q4_K),
            "sh_up": random_kquant(rng, ff, d, Q.Q4_K), "sh_down": random_kquant(rng, d, ff, Q.Q4_K)}
    packed = {name: LAYOUT.repacked(raw) for name, raw in raws.items()}
    common = dict(router=rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2, n_used=3,
                  sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1)
    rm = cpu_moe.MoEWeights(**raws, qtypes=Q.Q4_K, **common)
    il = cpu_moe.MoEWeights(**packed, qtypes={n: cpu.Q4_K_IL for n in packed}, **common)
    x = rng.standard_normal((5, d)).astype(np.float32)
    try:
        for level in ("numpy", *cpu.supported_isas()):
            cpu.set_isa(level)
            for call, xs in ((cpu_moe.moe_ffn, x[0]), (cpu_moe.moe_prefill, x)):
                want, got = call(xs, rm), call(xs, il)
                np.testing.assert_array_equal(got.out.view(np.uint32), want.out.view(np.uint32), err_msg=level)
                np.testing.assert_array_equal(got.experts, want.experts)
    finally:
        cpu.set_isa(None)

