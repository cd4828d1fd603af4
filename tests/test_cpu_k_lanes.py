"""The 4-row rows-as-lanes layouts of Q2_K and Q3_K (engine.kernels.cpu_rl, native/cpu/quant/q2k_lanes.c,
q3k_lanes.c, q2k_rl_avx512.h), every test run for both types.

Each layout is checked against a construction of its definition (deltadesk_cpu.h, byte by byte), the repack's
inverse against the original bytes, the numpy twin's unpacking against the definition, and the products of the
DD_Q2_K_RL and DD_Q3_K_RL kernel types (through cpu.Matrix) against the row-major kernel of each level bit for bit:
the AVX-512 VNNI kernel (a GEMV, column by column) by its own contract (the same integers and f64 operations per
(row, block) lane), the other levels by construction (the groups unpacked for the row-major kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from layout_cases import Layout, assert_row_major_bits, check_refusals, check_round_trip, check_rows_slice
from test_cpu_kernels import rng  # noqa: F401 (fixture)
from test_cpu_lowbit import random_lowbit

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, cpu_rl
from engine.kernels.cpu_twins import RL_TRAITS, q2_k_rl_unpack_np, q3_k_rl_unpack_np

Q2_K, Q3_K = GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K
NATIVE = cpu_rl._native_cpu is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="native kernels not built")
PAIR_BLOCK = ((0, 4, 1, 5), (2, 6, 3, 7))
BYTES = {Q2_K: 84, Q3_K: 110}
LONGEST_K = {Q2_K: 49920, Q3_K: 37888}   # the longest rows the layouts take (k = 0 in a case below)
TYPES = pytest.mark.parametrize("qtype", [Q2_K, Q3_K], ids=lambda t: t.name)


def by_definition(raw: np.ndarray, nbytes: int, fill) -> np.ndarray:
    """A rows-as-lanes matrix by its definition: fill(sb, blk) writes one 4-row super-block sb (4 * nbytes bytes, a
    view) from the rows' stored super-blocks blk[r]; rows past the last multiple of 4 stay as they are."""
    rows, rb = raw.shape
    out = raw.copy()
    for s in range(rows // 4):
        for j in range(rb // nbytes):
            fill(out[4 * s:4 * s + 4].reshape(-1)[4 * nbytes * j:4 * nbytes * (j + 1)],
                 [raw[4 * s + r, nbytes * j:nbytes * (j + 1)] for r in range(4)])
    return out


def q2_layout_np(raw: np.ndarray) -> np.ndarray:
    """Q2_K's packed bytes by the layout's definition, one byte at a time (deltadesk_cpu.h, dd_q2_k_rl_pack)."""
    def fill(sb, blk):
        for r in range(4):
            for c in range(4):
                for g in range(4):
                    sb[64 * c + 4 * (4 * g + r):][:4] = blk[r][16 + 16 * g + 4 * c:][:4]
            for p in range(2):
                for q in range(4):
                    sb[256 + 32 * p + 2 * (4 * q + r):][:2] = blk[r][2 * (2 * p + PAIR_BLOCK[0][q]):][:2]
            sb[320 + 2 * r:][:2], sb[328 + 2 * r:][:2] = blk[r][80:82], blk[r][82:84]

    return by_definition(raw, 84, fill)


def q3_scale(blk: np.ndarray, i: int) -> int:
    """The 6-bit scale i of a stored Q3_K super-block (lowbit.h)."""
    return int((blk[96 + i % 8] >> (4 * (i // 8))) & 15 | ((blk[104 + i % 4] >> (2 * (i // 4))) & 3) << 4)


def q3_layout_np(raw: np.ndarray) -> np.ndarray:
    """Q3_K's packed bytes by the layout's definition, one byte at a time (deltadesk_cpu.h, dd_q3_k_rl_pack)."""
    def fill(sb, blk):
        for r in range(4):
            sc = [q3_scale(blk[r], i) for i in range(16)]
            for c in range(4):
                for g in range(4):
                    sb[64 * c + 4 * (4 * g + r):][:4] = blk[r][32 + 16 * g + 4 * c:][:4]
                for t in range(2):
                    sb[256 + 32 * c + 4 * (4 * t + r):][:4] = blk[r][16 * t + 4 * c:][:4]
            for q in range(4):
                for t in range(2):
                    i = 2 * PAIR_BLOCK[0][q] + t
                    sb[384 + 8 * q + 2 * r + t] = sc[i] & 15 | (sc[i + 4] & 15) << 4
            for u in range(2):
                for t in range(2):
                    sb[416 + 8 * u + 2 * r + t] = sum((sc[8 * u + 2 * f + t] >> 4) << (2 * f) for f in range(4))
            sb[432 + 2 * r:][:2] = blk[r][108:110]

    return by_definition(raw, 110, fill)


LAYOUTS = {t: Layout(t, 4, BYTES[t], (lambda raw, t=t: cpu_rl.pack(raw, t)) if NATIVE else None,
                     (lambda raw, t=t: cpu_rl.unpack(raw, t)) if NATIVE else None, layout_np)
           for t, layout_np in ((Q2_K, q2_layout_np), (Q3_K, q3_layout_np))}
UNPACK_NP = {Q2_K: q2_k_rl_unpack_np, Q3_K: q3_k_rl_unpack_np}


@needs_native
@TYPES
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11, 16])
@pytest.mark.parametrize("k", [256, 768])
def test_repack_is_the_layout_and_its_inverse_restores_the_bytes(qtype, rows, k, rng):
    check_round_trip(LAYOUTS[qtype], rng.integers(0, 256, (rows, k // 256 * BYTES[qtype]), dtype=np.uint8))


@needs_native
@TYPES
def test_repack_refuses_read_only_partial_blocks_and_long_rows(qtype):
    check_refusals(LAYOUTS[qtype], 100, f"whole {qtype.name} blocks", cpu_rl.MAX_ROW_BYTES[qtype])


@needs_native
def test_repack_refuses_other_types():
    with pytest.raises(ValueError, match="no rows-as-lanes layout"):
        cpu_rl.pack(np.zeros((4, 144), np.uint8), GGMLQuantizationType.Q4_K)


@TYPES
def test_numpy_twin_unpacks_the_layout(qtype, rng):
    raw = rng.integers(0, 256, (13, 3 * BYTES[qtype]), dtype=np.uint8)
    np.testing.assert_array_equal(UNPACK_NP[qtype](LAYOUTS[qtype].layout_np(raw)), raw)


def assert_packed_row_major_bits(qtype, raw: np.ndarray, k: int, x: np.ndarray, levels=None) -> None:
    """The packed Matrix has the layout's traits and the row-major Matrix's bits at every level and 1-3 threads."""
    assert LAYOUTS[qtype].matrix(raw, k).traits == RL_TRAITS[qtype]
    assert_row_major_bits(LAYOUTS[qtype], raw, k, x, levels)


@TYPES
@pytest.mark.parametrize("rows,k", [(4, 256), (5, 512), (13, 768), (70, 2048), (129, 2304), (9, 0)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])
def test_packed_matrix_has_the_row_major_bits(qtype, rows, k, m, rng):
    k = k or LONGEST_K[qtype]
    raw = random_lowbit(rng, rows, k, qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_packed_row_major_bits(qtype, raw, k, x, None if rows * k < 10**5 or m < 8 else cpu.supported_isas())


@needs_native
@TYPES
@pytest.mark.parametrize("k", [256, 1024])
def test_random_bytes_nan_and_inf_scales_included(qtype, k, rng):
    """Every byte random: d (and dmin) include infinities and NaNs (one f16 in 32), whose propagation must match."""
    raw = rng.integers(0, 256, (24, k // 256 * BYTES[qtype]), dtype=np.uint8)
    x = rng.standard_normal((2, k)).astype(np.float32)
    assert_packed_row_major_bits(qtype, raw, k, x[:1], cpu.supported_isas())
    assert_packed_row_major_bits(qtype, raw, k, x, cpu.supported_isas())


@needs_native
@TYPES
def test_extreme_codes_and_full_scale_activations(qtype, rng):
    """The largest code everywhere (Q2_K 3, Q3_K 7: its high bit set), the largest and smallest scales (Q2_K: scale
    and min 15, or min 0; Q3_K: 31 or -32), activations +-127 in every value: the largest factor's field and the
    int16 half sums at their bounds."""
    k = 1024
    raw = random_lowbit(rng, 12, k, qtype)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    b["qs"] = 0xFF
    if qtype == Q2_K:
        b[:6]["scales"], b[6:]["scales"] = 0xFF, 0x0F
    else:
        b["hmask"] = 0xFF
        b[:6]["scales"], b[6:]["scales"] = 0xFF, 0x00
    signs = rng.choice([-1.0, 1.0], (3, k // 32))
    x = (np.repeat(signs, 32, axis=1) * rng.uniform(0.5, 2, (3, 1))).astype(np.float32)
    x[2] = -x[1]
    assert_packed_row_major_bits(qtype, raw, k, x[:1])
    assert_packed_row_major_bits(qtype, raw, k, x)


def cancelling_blocks(rng, qtype, rows: int, j0: int, j1: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of one super-block whose 8 blocks hold the same codes and scales, and a column whose block j1 is
    block j0 negated (values up to 6e4) and whose other blocks are ~1e-5: the terms of lanes j0 and j1 cancel
    exactly and are ~2^32 times the others, so any other order of the f64 sums than the row-major tree's
    (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) leaves rounding errors of ~2^-20 of the result in f32."""
    raw = np.zeros((rows, BYTES[qtype]), dtype=np.uint8)
    codes = rng.integers(0, 4, (rows, 32)).astype(np.uint8)
    if qtype == Q2_K:
        raw[:, 16:48] = raw[:, 48:80] = codes * 0x55   # every field of a byte the same code: blocks repeat
        raw[:, 0:16] = np.tile(rng.integers(0x11, 0x100, (rows, 2)).astype(np.uint8), 8)
        raw[:, 80:84] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    else:
        raw[:, 32:64] = raw[:, 64:96] = codes * 0x55
        raw[:, 0:32] = rng.choice([0, 0xFF], (rows, 32))   # every block the same high bits
        low, top = rng.integers(0, 16, (rows, 2)), rng.integers(0, 4, (rows, 2))   # scales of even and odd halves
        raw[:, 96:104] = np.tile(low * 0x11, 4)
        raw[:, 104:108] = np.tile(top * 0x55, 2)
        raw[:, 108:110] = np.array([0.01], dtype=np.float16).view(np.uint8)
    x = rng.uniform(-1e-5, 1e-5, (1, 256)).astype(np.float32)
    big = rng.uniform(-6e4, 6e4, 32).astype(np.float32)
    x[0, 32 * j0:32 * j0 + 32], x[0, 32 * j1:32 * j1 + 32] = big, -big
    return raw, x


@TYPES
@pytest.mark.parametrize("j0,j1", [(0, 1), (0, 2), (1, 3), (2, 3), (0, 4), (1, 5), (3, 7), (4, 6), (5, 6)])
def test_lane_sums_follow_the_row_major_tree(qtype, j0, j1, rng):
    raw, x = cancelling_blocks(rng, qtype, 8, j0, j1)
    assert_packed_row_major_bits(qtype, raw, 256, x)


@needs_native
@TYPES
def test_rows_slice_keeps_the_groups(qtype, rng):
    raw = random_lowbit(rng, 14, 512, qtype)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    check_rows_slice(LAYOUTS[qtype].matrix(raw, 512), x, ((4, 8), (8, 14), (12, 14)), ((2, 8), (4, 6)), "4-row")


@needs_native
@TYPES
@pytest.mark.parametrize("level", ["avx512vnni", "avx2", "scalar"])
def test_moe_on_packed_experts_has_the_row_major_bits(qtype, level, rng):
    """The fused MoE (gate, up and down experts packed) against the same experts row-major, one token."""
    if level not in cpu.supported_isas():
        pytest.skip(f"needs {level}")
    d, ff, n_expert = 512, 256, 6
    raw = {n: random_lowbit(rng, rows, k, qtype) for n, rows, k in
           (("gate", n_expert * ff, d), ("up", n_expert * ff, d), ("down", n_expert * d, ff))}
    packed = {n: LAYOUTS[qtype].repacked(r) for n, r in raw.items()}
    router = rng.standard_normal((n_expert, d)).astype(np.float32)
    x = rng.standard_normal(d).astype(np.float32)
    row_major = cpu_moe.MoEWeights(router, **raw, n_used=2, qtypes=qtype)
    lanes = cpu_moe.MoEWeights(router, **packed, n_used=2, qtypes=RL_TRAITS[qtype])
    try:
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            want = cpu_moe.moe_ffn(x, row_major).out
            np.testing.assert_array_equal(cpu_moe.moe_ffn(x, lanes).out.view(np.uint32), want.view(np.uint32))
    finally:
        cpu.set_isa(None)
        cpu.set_threads()


@TYPES
def test_moe_refuses_experts_that_split_groups(qtype, rng):
    d, ff, n_expert = 256, 2, 2
    gate = random_lowbit(rng, n_expert * ff, d, qtype)
    down = np.zeros((n_expert * d, BYTES[qtype]), dtype=np.uint8)
    w = cpu_moe.MoEWeights(np.zeros((n_expert, d), np.float32), gate, gate.copy(), down, 1,
                           {"gate": RL_TRAITS[qtype], "up": RL_TRAITS[qtype], "down": qtype})
    with pytest.raises(ValueError, match="share 4-row"):
        cpu_moe.moe_ffn(np.zeros(d, np.float32), w)
