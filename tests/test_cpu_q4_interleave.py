"""The 8-row interleaved Q4_0 layout (engine.kernels.cpu_q4il, native/cpu/quant/q4_interleave.c, q4_il_avx512.h).

The layout is checked against a numpy construction of its definition (deltadesk_cpu.h), the repack's inverse
against the original bytes, and the interleaved products (the DD_Q4_0_IL kernel type through cpu.Matrix) against
the row-major kernel of each level bit for bit (the AVX-512 VNNI GEMV's own contract: the same f32 terms added in
the same order) and against the float64 product within the kernels' summation bound,
(k // 32 + 16) * 2^-24 * sum_i |w_i a_i| (tests/test_cpu_kernels.py derives it).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from layout_cases import Layout, assert_row_major_bits, check_refusals, check_round_trip, check_rows_slice
from test_cpu_kernels import rng  # noqa: F401 (fixture)

from engine.kernels import cpu, cpu_q4il
from engine.kernels.cpu_twins import deinterleave_np

Q4_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0
VNNI = "avx512vnni" in cpu.supported_isas()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the interleaved GEMV is AVX-512 VNNI only")
# Each level's interleaved product (the VNNI GEMV, or the stripes de-interleaved for the row-major kernel) is
# compared with that level's row-major product; the numpy level with the twin, which de-interleaves in numpy.


def layout_np(raw: np.ndarray, qtype=Q4_0) -> np.ndarray:
    """The interleaved bytes by the layout's definition: per stripe and block, 8 scales (sc bytes each: 2 for
    Q4_0, 1 for MXFP4), then 4 runs x 8 rows."""
    rows, rb = raw.shape
    out = raw.copy()
    block = 18 if qtype == Q4_0 else 17
    sc, nb, full = block - 16, rb // block, rows // 8 * 8
    blocks = raw[:full].reshape(rows // 8, 8, nb, block)
    scales = blocks[..., :sc].transpose(0, 2, 1, 3).reshape(rows // 8, nb, 8 * sc)
    runs = blocks[..., sc:].reshape(rows // 8, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(rows // 8, nb, 128)
    out[:full] = np.concatenate([scales, runs], axis=2).reshape(full, rb)
    return out


def q4_layout(qtype) -> Layout:
    """The interleaved layout of Q4_0 or MXFP4 (native repack where built, else its numpy definition)."""
    native = cpu_q4il._native_cpu is not None
    return Layout(qtype, 8, 18 if qtype == Q4_0 else 17, partial(cpu_q4il.interleave, qtype=qtype) if native else None,
                  partial(cpu_q4il.deinterleave, qtype=qtype) if native else None, partial(layout_np, qtype=qtype))


LAYOUT = q4_layout(Q4_0)


def random_q4_0(rng, rows: int, k: int) -> np.ndarray:
    w = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 2)).astype(np.float32)
    return np.ascontiguousarray(quants.quantize(w, Q4_0)).view(np.uint8)


@pytest.mark.skipif(cpu_q4il._native_cpu is None, reason="native kernels not built")
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 23, 64])
@pytest.mark.parametrize("k", [32, 96, 544])
def test_repack_is_the_layout_and_its_inverse_restores_the_bytes(rows, k, rng):
    check_round_trip(LAYOUT, rng.integers(0, 256, (rows, k // 32 * 18), dtype=np.uint8))


@pytest.mark.skipif(cpu_q4il._native_cpu is None, reason="native kernels not built")
def test_repack_refuses_read_only_and_partial_blocks():
    check_refusals(LAYOUT, 40, "whole Q4_0 blocks", cpu_q4il.MAX_ROW_BYTES[Q4_0])


def test_numpy_twin_deinterleaves_the_layout(rng):
    raw = rng.integers(0, 256, (29, 96 // 32 * 18), dtype=np.uint8)
    np.testing.assert_array_equal(deinterleave_np(layout_np(raw)), raw)


@pytest.mark.parametrize("rows,k", [(5, 64), (8, 32), (13, 96), (69, 512), (200, 544), (41, 1056), (136, 2048),
                                    (29, 29120)])   # the longest rows: one stripe per de-interleaved piece
@pytest.mark.parametrize("m", [1, 3, 17, 64])   # m > 1: the prefill GEMM (on VNNI straight from the stripes)
def test_interleaved_matrix_has_the_row_major_bits(rows, k, m, rng):
    raw = random_q4_0(rng, rows, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_row_major_bits(LAYOUT, raw, k, x)
    mat = LAYOUT.matrix(raw, k)
    w = quants.dequantize(raw, Q4_0).astype(np.float64)
    a = quants.dequantize(quants.quantize(x, Q8_0), Q8_0).astype(np.float64)
    bound = (k // 32 + 16) * 2.0**-24 * (np.abs(a) @ np.abs(w).T)
    assert np.all(np.abs(mat(x) - a @ w.T) <= bound)


@needs_vnni
@pytest.mark.parametrize("k", [96, 1056])   # a short group only; two full groups and a short one
@pytest.mark.parametrize("m", [1, 5])
def test_interleaved_gemv_zero_and_extreme_scales(vnni, k, m, rng):
    raw = random_q4_0(rng, 16, k)
    raw[3, :] = 0
    scales = raw.reshape(16, k // 32, 18)[:, :, :2].view(np.float16)
    scales[5, 1] = np.float16(65504.0)
    scales[9, 2] = np.float16(6e-8)
    scales[14, -1] = np.float16(-65504.0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = cpu.matmul(raw, x, Q4_0)
    np.testing.assert_array_equal(LAYOUT.matrix(raw, k)(x).view(np.uint32), want.view(np.uint32))


def test_rows_slice_keeps_the_stripes(rng):
    raw = random_q4_0(rng, 27, 64)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    check_rows_slice(LAYOUT.matrix(raw, 64), x, ((8, 16), (16, 27), (24, 27)), ((4, 16), (8, 12)), "stripes")


def test_only_the_types_with_a_layout_interleave():
    with pytest.raises(ValueError, match="only Q4_0, MXFP4, Q4_K, Q2_K, Q3_K rows"):
        cpu.Matrix(np.zeros((8, 34), dtype=np.uint8), 32, Q8_0, interleaved=True)
    with pytest.raises(ValueError, match="Q8_0 has no interleaved layout"):
        cpu_q4il.interleave(np.zeros((8, 34), dtype=np.uint8), Q8_0)
