"""The 8-row interleaved MXFP4 layout (engine.kernels.cpu_q4il, native/cpu/quant/q4_interleave.c, q4_il_avx512.h).

As tests/test_cpu_q4_interleave.py for Q4_0: the layout against a numpy construction of its definition
(deltadesk_cpu.h), the repack's inverse against the original bytes, the numpy twin's de-interleave, and the
interleaved products (DD_MXFP4_IL through cpu.Matrix) against the row-major kernel of each level bit for bit (the
AVX-512 VNNI GEMV's contract: bquants.h's f64 terms in the same lanes and order, docs/design/mxfp4-interleave.md),
with every e8m0 exponent 0 .. 255 and the infinities and NaNs of overflowing scale products, and against gguf's
reference within the summation bound of tests/test_cpu_bquants.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_cpu_bquants import random_bquant
from layout_cases import assert_row_major_bits, check_refusals, check_round_trip, check_rows_slice
from test_cpu_kernels import assert_close, reference_product, rng  # noqa: F401 (fixture)
from test_cpu_q4_interleave import layout_np, q4_layout

from engine.gguf import quant
from engine.kernels import cpu, cpu_q4il
from engine.kernels.cpu_twins import deinterleave_np

MXFP4 = GGMLQuantizationType.MXFP4
LAYOUT = q4_layout(MXFP4)
native = pytest.mark.skipif(cpu_q4il._native_cpu is None, reason="native kernels not built")


@native
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 23, 64])
@pytest.mark.parametrize("k", [32, 96, 544])
def test_repack_is_the_layout_and_its_inverse_restores_the_bytes(rows, k, rng):
    check_round_trip(LAYOUT, rng.integers(0, 256, (rows, k // 32 * 17), dtype=np.uint8))


@native
def test_repack_refuses_partial_blocks_and_long_rows():
    check_refusals(LAYOUT, 36, "whole MXFP4 blocks of 17 bytes", cpu_q4il.MAX_ROW_BYTES[MXFP4])


def test_numpy_twin_deinterleaves_the_layout(rng):
    raw = rng.integers(0, 256, (29, 96 // 32 * 17), dtype=np.uint8)
    np.testing.assert_array_equal(deinterleave_np(layout_np(raw, MXFP4), MXFP4), raw)


@pytest.mark.parametrize("rows,k", [(5, 64), (8, 32), (13, 96), (69, 544), (41, 1056), (136, 2048), (13, 2048),
                                    (29, 29120)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])   # VNNI: up to 8 the GEMV per column; the rest de-interleaved
def test_interleaved_matrix_has_the_row_major_bits(rows, k, m, rng):
    raw = random_bquant(rng, rows, k, MXFP4)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_row_major_bits(LAYOUT, raw, k, x, None if rows * k * m <= 2**20 else cpu.supported_isas())
    ref, abs_sum = reference_product(raw, x, MXFP4)
    assert_close(LAYOUT.matrix(raw, k)(x), ref, abs_sum, k // 32)


@pytest.mark.parametrize("k", [256, 288])   # one full group; and a short second group of one block
def test_every_exponent_and_overflowing_scales(k, rng):
    """Row r has e = r in block r % 8 (random codes there, every other block's codes zero, their e random): every
    e8m0 value 0 .. 255 (2^-129 .. 2^127) meets the kernels alone. With activations of up to 10^4 the f32 scale
    products of the top exponents overflow: inf times a zero block dot is NaN, and two infinite products of
    opposite sign in rows 248-255 (block 0 at e = 255 too) give inf - inf. Same bits as row-major (NaNs' too)."""
    raw = random_bquant(rng, 256, k, MXFP4)
    b = raw.view(quant.BLOCK_DTYPES[MXFP4])
    b["e"] = rng.integers(0, 256, b.shape)
    rows = np.arange(256)
    b["e"][rows, rows % 8] = rows
    keep = np.zeros(b.shape, bool)
    keep[rows, rows % 8] = True
    keep[248:, 0] = True
    b["e"][248:, 0] = 255
    b["qs"][~keep] = 0
    for scale in (1.0, 1e4):
        x = (rng.standard_normal((5, k)) * scale).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):   # the twin's f32 products overflow, as the kernels'
            assert_row_major_bits(LAYOUT, raw, k, x)
            assert_row_major_bits(LAYOUT, raw, k, x[:1])
    y = LAYOUT.matrix(raw, k)(x)
    assert np.isnan(y).any() and np.isinf(y).any()


def test_rows_slice_keeps_the_stripes(rng):
    raw = random_bquant(rng, 27, 64, MXFP4)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    check_rows_slice(LAYOUT.matrix(raw, 64), x, ((8, 16), (16, 27), (24, 27)), ((4, 16),), "stripes", cpu.MXFP4_IL)
