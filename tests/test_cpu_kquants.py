"""K-quant CPU kernels (Q4_K, Q5_K, Q6_K read as stored: native/cpu/quant/kquants.h) at every ISA level.

Weights are random super-blocks drawn byte by byte (no zero scales, odd row and super-block
counts); the reference dequantizes them with gguf.quants (ggml's reference decoder, independent
of the code under test) and multiplies in float64 by the Q8_0-quantized activations.

Tolerances. Products: the summation bound of test_cpu_kernels (``(k // 32 + 16) 2^-24 sum|w a|``);
the kernels' integer parts are exact and their f32 terms round at most twice, then take 2 k / 256 + 3
f32 additions (kquants.h; test_kquant_within_the_lane_bound checks the tighter bound on the terms
themselves). Between levels, thread counts, tiles and the numpy twin the results must be bit-identical:
all of them perform the same f32 operations in the same order (kquants.h), and f32 rounding shows it.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_cpu_kernels import (assert_close, assert_same_bits_everywhere, gamma, level, one_step_bound,  # noqa: F401
                              reference_product, rng, route_margin)

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, cpu_q4il, cpu_twins

Q = GGMLQuantizationType
LEVELS = cpu.supported_isas()
ALL = (*LEVELS, "numpy")
KQ = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def random_kquant(rng: np.random.Generator, rows: int, k: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, k // 256 * block bytes) uint8: random quant bytes, nonzero 6-bit scales and mins
    (Q4_K/Q5_K) or nonzero int8 scales (Q6_K), f16 d (and dmin) of random sign and size."""
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, k)), dtype=np.uint8)
    b = raw.view(quant.BLOCK_DTYPES[qtype])

    def f16(shape):
        return (rng.choice([-1, 1], shape) * rng.uniform(0.5, 1, shape) * 2.0 ** rng.integers(-14, -6, shape)
                ).astype(np.float16)

    b["d"] = f16(b.shape)
    if qtype == Q.Q6_K:
        s = rng.integers(1, 128, size=b["scales"].shape) * rng.choice([-1, 1], b["scales"].shape)
        b["scales"] = s.astype(np.int8)
    else:
        b["dmin"] = f16(b.shape)
        b["scales"] = quant.pack_k_scales(rng.integers(1, 64, (*b.shape, 8)), rng.integers(1, 64, (*b.shape, 8)))
    return raw


def kquant_terms(raw: np.ndarray, x: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """The exact terms of kquants.h's contract in float64, (m, rows, nsb, 8) each: t = d sc_i da_i S_i (Q6_K:
    d da_i I_i) and u = dmin m_i da_i bs_i (Q6_K: 0), every one a product of at most 46 significant bits."""
    q, sc, mn, d, dmin = cpu_twins.kquant_unpack(raw, qtype)
    rows, nsb = d.shape
    da, aq, s16 = cpu_twins.superblock_acts(x, nsb)
    halves = np.einsum("rsihj,csihj->crsih", q.reshape(rows, nsb, 8, 2, 16), aq).astype(np.float64)
    sc2 = sc.reshape(rows, nsb, 8, 2).astype(np.float64)
    scale = d[None, :, :, None].astype(np.float64) * da[:, None].astype(np.float64)
    if qtype == Q.Q6_K:
        terms = scale * ((halves - 32 * s16[:, None]) * sc2[None]).sum(-1)
        return terms, np.zeros_like(terms)
    mins = dmin[None, :, :, None].astype(np.float64) * da[:, None] * mn[None] * s16.sum(-1)[:, None]
    return scale * sc2[None, ..., 0] * halves.sum(-1), mins


def kquant_parts_size(raw: np.ndarray, x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(m, rows) float64: sum over values j of (|d sc q_j| + |dmin m|) |a_j| (Q6_K: |d sc (q_j - 32)| |a_j|), a_j
    the Q8_0-quantized activations; it bounds both sum(|t| + |u|) and sum |w a|."""
    q, sc, mn, d, dmin = cpu_twins.kquant_unpack(raw, qtype)
    rows, nsb = d.shape
    da, aq, _ = cpu_twins.superblock_acts(x, nsb)
    a = np.abs(aq.reshape(len(x), nsb, 256) * np.repeat(da, 32, axis=-1).astype(np.float64))
    lo = -32 if qtype == Q.Q6_K else 0
    parts = np.abs(d[..., None].astype(np.float64) * np.repeat(sc, 16, axis=-1) * (q + lo))
    parts += np.abs(dmin[..., None].astype(np.float64) * np.repeat(mn, 32, axis=-1))
    return np.einsum("rsv,csv->cr", parts, a)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_unpack_matches_gguf_dequantization(qtype, rng):
    """The twin's integer decoding, recombined in float64, equals gguf's float32 values to 2^-24 relative."""
    raw = random_kquant(rng, 7, 768, qtype)
    q, sc, mn, d, dmin = cpu_twins.kquant_unpack(raw, qtype)
    q = q.reshape(7, 3, 16, 16).astype(np.float64)
    w = d[..., None, None].astype(np.float64) * sc[..., None] * (q - 32 * (qtype == Q.Q6_K))
    w -= (dmin[..., None].astype(np.float64) * mn).repeat(2, axis=-1)[..., None]
    ref = quants.dequantize(raw, qtype).astype(np.float64)
    assert np.all(np.abs(w.reshape(7, 768) - ref) <= 2.0**-24 * np.abs(ref))


def test_pack_k_scales_round_trips_through_gguf(rng):
    sc, mn = rng.integers(0, 64, (5, 8)), rng.integers(0, 64, (5, 8))
    raw = np.zeros((5, 144), np.uint8)
    b = raw.view(quant.BLOCK_DTYPES[Q.Q4_K])
    b["d"], b["dmin"], b["scales"] = 1.0, 1.0, quant.pack_k_scales(sc, mn)[:, None]
    b["qs"] = 0x11                                            # q = 1 everywhere: x = sc - m
    x = quants.dequantize(raw, Q.Q4_K).reshape(5, 8, 32)
    assert np.array_equal(x, np.broadcast_to((sc - mn)[..., None], x.shape).astype(np.float32))
    with pytest.raises(ValueError, match="0..63"):
        quant.pack_k_scales(np.full(8, 64), np.zeros(8))


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(1, 256), (7, 768), (33, 2304), (130, 2048)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_kquant_matmul_matches_gguf_reference(level, qtype, rows, k, m, rng):
    """Against gguf's dequantized weights in float64, within assert_close's bound on the size of the weights'
    parts, sum_j (|d sc q_j| + |dmin m|) |a_j| (Q6_K: |d sc (q_j - 32)| |a_j|): the kernels' error is within
    gamma(2 nsb + 5) of it (each term's size is at most its values' parts) and gguf's float32 weights (d sc q less
    dmin m, two roundings) within about 2 2^-24, together below (k / 32 + 16) 2^-24 as k / 32 = 8 nsb. (The
    size of w a itself is smaller where d sc q and dmin m cancel.)"""
    raw = random_kquant(rng, rows, k, qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    ref, _ = reference_product(raw, x, qtype)
    y = cpu.matmul(raw, x, qtype)
    assert_close(y, ref, kquant_parts_size(raw, x, qtype), k // 32)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_kquant_results_bit_identical_across_levels_threads_and_tiles(qtype, rng):
    """Every level, 1-3 threads, one column alone or in a batch, and the numpy twin: the same bits."""
    raw = random_kquant(rng, 301, 2304, qtype)                # many thread chunks, a ragged last one
    assert_same_bits_everywhere(raw, 2304, qtype, rng)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(7, 8448), (6, 256)])
def test_kquant_gemv_shapes_bit_identical(qtype, rows, k, rng):
    """The AVX-512 GEMV prepares the column once per call for rows of up to 32 super-blocks
    (kq_tile_avx512.h, KQ_GEMV_SB) and per tile beyond; 4-row tiles then single rows. A row of 33
    super-blocks (the per-tile path), one of 1, and 4n + 2 / 4n + 3 rows: the same bits everywhere."""
    assert_same_bits_everywhere(random_kquant(rng, rows, k, qtype), k, qtype, rng)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("k, m", [(2304, 1), (2304, 3), (2304, 9), (2304, 64), (18944, 3), (18944, 9)])
def test_kquant_same_bits_at_every_level_as_the_twin(qtype, k, m, rng):
    """The f32 contract (kquants.h) at every level, 1-3 threads, for one column (the GEMV), a few (a batched
    decode), 9 and 64 (the prompt GEMM), and rows longer than the prompt GEMM's and the GEMV's buffers hold
    (74 super-blocks: the per-tile walk at several columns), against the numpy twin bit for bit; the rows include
    the largest and smallest f16 scales (+-65504, the subnormal 6e-8) and a zero row, and 21 rows leave an odd
    last pair."""
    raw = random_kquant(rng, 21, k, qtype)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    b["d"][3, 0], b["d"][7, -1], b["d"][11, 4] = 65504.0, -6e-8, -65504.0
    if qtype != Q.Q6_K:
        b["dmin"][5, 2], b["dmin"][9, 0] = -65504.0, 6e-8
    raw[13] = 0
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert np.isfinite(cpu_twins.kquant_product_np(raw, x, qtype)).all()
    assert_same_bits_everywhere(raw, k, qtype, rng, x)


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("k, m", [(256, 1), (2048, 3), (2304, 16), (8192, 1)])
def test_kquant_within_the_lane_bound(level, qtype, k, m, rng):
    """|y - sum(t - u)| <= gamma(2 nsb + 5) sum(|t| + |u|) for the exact terms t, u of kquants.h (each rounded
    at most twice, 2 nsb additions in its lane, 3 in the tree): a check of the documented bound (the order
    itself is pinned by the same-bits test). The terms are exact in float64 (at most 46 bits each), their sum
    within nsb 16 2^-53 of its size."""
    raw = random_kquant(rng, 19, k, qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    terms, mins = kquant_terms(raw, x, qtype)
    nsb = k // 256
    exact = (terms - mins).sum(axis=(2, 3))
    size = (np.abs(terms) + np.abs(mins)).sum(axis=(2, 3))
    y = cpu.matmul(raw, x, qtype).astype(np.float64)
    bound = gamma(2 * nsb + 5) * size + nsb * 16 * 2.0**-53 * size
    assert (np.abs(y - exact) <= bound).all(), np.max(np.abs(y - exact) / size)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_moe_ffn_on_kquant_experts(level, rng):
    """The fused MoE with a Q4_K_M-like mix (Q4_K gate/up, Q6_K down, Q5_K / Q8_0 shared expert)
    against its twin: same routing, outputs within 1e-4 of the max plus one hidden value's Q8_0 step (the SiLU
    rounding argument of test_cpu_kernels.one_step_bound)."""
    d, n_expert, ff, ff_sh = 512, 8, 256, 256
    qtypes = {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K, "sh_gate": Q.Q5_K, "sh_up": Q.Q5_K, "sh_down": Q.Q8_0}
    sh_down = quants.quantize(rng.standard_normal((d, ff_sh)).astype(np.float32) * 0.05, Q.Q8_0)
    w = cpu_moe.MoEWeights(router=rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2,
                       gate=random_kquant(rng, n_expert * ff, d, Q.Q4_K),
                       up=random_kquant(rng, n_expert * ff, d, Q.Q4_K),
                       down=random_kquant(rng, n_expert * d, ff, Q.Q6_K), n_used=3, qtypes=qtypes,
                       sh_gate=random_kquant(rng, ff_sh, d, Q.Q5_K), sh_up=random_kquant(rng, ff_sh, d, Q.Q5_K),
                       sh_down=sh_down, sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1)
    x = rng.standard_normal(d).astype(np.float32)
    while route_margin(x, w) < 1e-3:
        x = rng.standard_normal(d).astype(np.float32)
    got, ref = cpu_moe.moe_ffn(x, w), cpu_moe.moe_ffn_np(x, w)
    assert np.array_equal(got.experts, ref.experts)
    assert (np.abs(got.out - ref.out) <= 1e-4 * np.abs(ref.out).max() + one_step_bound(x, w, ref)).all()


def test_kquant_rows_must_be_whole_super_blocks(rng):
    raw = random_kquant(rng, 2, 256, Q.Q4_K)
    with pytest.raises(ValueError, match="Q4_K blocks"):
        cpu.matmul(raw, np.ones(288, np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="Q6_K blocks"):
        cpu.Matrix(raw, 256, Q.Q6_K)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(70, 2048), (69, 2304)])
def test_kquant_few_columns_are_each_column_alone(level, qtype, rows, k, rng):
    """2 to 8 columns (a batched decode's rows: kqh_few_avx512.h at AVX-512, columns arranged once per
    thread, each row pair's super-blocks expanded once for all of them) and 9 (the unpack-once GEMM), at 1
    to 3 threads (chunks of odd and even row counts), an odd row count (a row without a partner) and an odd
    super-block count: every column has the bits of its own one-column product, and of the one-column
    product at 1 thread."""
    raw = random_kquant(rng, rows, k, qtype)
    mat = cpu.Matrix(raw, k, qtype)
    x = rng.standard_normal((9, k)).astype(np.float32)
    cpu.set_threads(1)
    alone = np.concatenate([mat(x[i:i + 1]) for i in range(9)])
    for n in (1, 2, 3):
        cpu.set_threads(n)
        for m in range(2, 10):
            assert np.array_equal(mat(x[:m]), alone[:m]), (n, m)
            assert np.array_equal(mat(x[9 - m:]), alone[9 - m:]), (n, m)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(1, 256), (7, 2304), (70, 2048), (9, 8192)])
def test_kquant_few_columns_match_numpy_twin(level, qtype, rows, k, rng):
    """1 to 8 columns (at AVX-512 from 2 columns kqh_few_avx512.h's lane layout, the columns arranged
    once per thread and activations): every column has the numpy twin's bits, for one row, odd and even
    row counts, 1 to 32 super-blocks a row (the scratch's limit), and for a second set of activations of
    the same shape (arranged again, not read from the thread's scratch)."""
    raw = random_kquant(rng, rows, k, qtype)
    mat = cpu.Matrix(raw, k, qtype)
    for x in (rng.standard_normal((8, k)).astype(np.float32), (rng.standard_normal((8, k)) * 50).astype(np.float32)):
        want = cpu.matmul_np(raw, x, qtype)
        for m in range(1, 9):
            assert np.array_equal(mat(x[:m]), want[:m]), m
            assert np.array_equal(mat(x[8 - m:]), want[8 - m:]), m


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("m", [1, 3, 37])
def test_matmul_many_gives_each_product_its_own_bits(level, m, rng):
    """cpu.matmul_many (dd_matmul_many: x prepared once, one pool job) against each Matrix called alone, bit for
    bit: a layer's mix of projections (interleaved Q4_K and Q4_0, row-major Q4_K, Q6_K, Q8_0; a 16-row matrix
    of one chunk, ragged row counts) at m = 1 (decode's call), a few and many columns, 1-3 threads."""
    k = 512
    mats = []
    for qtype, rows, layout in ((Q.Q4_K, 72, True), (Q.Q4_0, 40, True), (Q.Q4_K, 33, False), (Q.Q6_K, 16, False),
                                (Q.Q8_0, 45, False)):
        raw = (random_kquant(rng, rows, k, qtype) if qtype in KQ
               else np.ascontiguousarray(quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype))
               .view(np.uint8))
        if layout:
            cpu_q4il.interleave(raw, qtype)
        mats.append(cpu.Matrix(raw, k, qtype, interleaved=layout))
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = [mat(x) for mat in mats]
    for threads in (1, 2, 3):
        cpu.set_threads(threads)
        got = cpu.matmul_many(mats, x)
        assert len(got) == len(mats)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.array_equal(g, w), threads
    other = cpu.Matrix(random_kquant(rng, 4, 256, Q.Q4_K), 256, Q.Q4_K)
    with pytest.raises(ValueError, match="one k"):
        cpu.matmul_many([mats[0], other], x)
    with pytest.raises(ValueError, match="expected x"):
        cpu.matmul_many(mats, x[:, :256])
