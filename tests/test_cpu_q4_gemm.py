"""The Q4_0 prefill GEMM (m > 1 columns) against the float64 reference, the GEMV and the numpy twin.

At the AVX-512 VNNI level the GEMM runs its own tiles (native/cpu/quant/q4_gemm_avx512.h: one row, up to 8
columns, on the lane layout of the activations) while m == 1 keeps the GEMV's tiles, so every column
count below exercises a different mix of 8-column tiles and the 1-7 columns left over, and every k a
different mix of full 16-block groups and the short last group. The tolerance is the summation bound
of test_cpu_kernels (derived there); the bits must be the GEMV's for every column, the twin's, and the
same at 1-3 threads (chunked rows) and at every ISA level.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_cpu_kernels import (  # noqa: F401 (fixtures)
    LEVELS,
    assert_close,
    level,
    random_weights,
    reference_product,
    rng,
)

from engine.kernels import cpu

Q4_0 = GGMLQuantizationType.Q4_0
COLUMNS = (2, 7, 8, 9, 15, 16, 17, 40)
KS = (32 * 16, 32 * 47, 2048 + 32)   # one full group; 2 full and a 15-block tail; 4 full and a 1-block tail


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("k", KS)
def test_q4_0_gemm_matches_reference_and_gemv_bits(level, k, rng):
    raw = random_weights(rng, 37, k, Q4_0)
    for m in COLUMNS:
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        ref, abs_sum = reference_product(raw, x, Q4_0)
        batch = cpu.matmul_q4_0(raw, x)
        assert_close(batch, ref, abs_sum, k // 32)
        single = np.stack([cpu.matmul_q4_0(raw, v) for v in x])
        assert np.array_equal(batch.view(np.uint32), single.view(np.uint32)), (m, k)
        assert np.array_equal(batch.view(np.uint32), cpu.matmul_q4_0_np(raw, x).view(np.uint32)), (m, k)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_q4_0_gemm_same_bits_for_any_thread_count(level, rng):
    """301 rows of k = 2048 split into several row chunks (a ragged last one) at 2 and 3 threads."""
    raw = random_weights(rng, 301, 2048, Q4_0)
    x = rng.standard_normal((19, 2048)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        cpu.set_threads(n)
        results.append(cpu.matmul_q4_0(raw, x))
    for got in results[1:]:
        assert np.array_equal(got.view(np.uint32), results[0].view(np.uint32))


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("k", (32 * (16 * 102 + 5), 32 * 16 * 342))
def test_q4_0_gemm_long_rows_keep_gemv_bits(level, k, rng):
    """Long rows: at k = 52,384 (103 groups) the 192 KiB of unpacked groups (341) hold 3 rows, so each
    4-row chunk of the call is unpacked in two ranges; at k = 175,104 (342 groups) one row does not fit
    and the tiles unpack each group per 8 columns instead. Same checks as above."""
    raw = random_weights(rng, 23, k, Q4_0)
    x = rng.standard_normal((9, k)).astype(np.float32)
    ref, abs_sum = reference_product(raw, x, Q4_0)
    batch = cpu.matmul_q4_0(raw, x)
    assert_close(batch, ref, abs_sum, k // 32)
    single = np.stack([cpu.matmul_q4_0(raw, v) for v in x])
    assert np.array_equal(batch.view(np.uint32), single.view(np.uint32))
    assert np.array_equal(batch.view(np.uint32), cpu.matmul_q4_0_np(raw, x).view(np.uint32))
