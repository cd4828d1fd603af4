"""Low-bit CPU kernels (Q2_K, Q3_K and the IQ1/IQ2/IQ3 types read as stored: native/cpu/quant/lowbit.h,
iquants.h) at every ISA level.

Weights are random super-blocks drawn byte by byte (every code, grid index, sign pattern, high bit,
scale and min occurs; f16 d and dmin of random sign and size, never zero); the reference
dequantizes them with gguf.quants (gguf-py's port of ggml's decoder, independent of the code under
test) and multiplies in float64 by the Q8_0-quantized activations.

Tolerances, as test_cpu_kquants: the twin's decoding recombined in float64 is within 2^-24 relative
of gguf's float32 values (gguf's d * sc and its products by the small codes are exact in float32; only
Q2_K's final subtraction rounds, by at most half an ulp; the IQ types decode exactly). Products: the summation bound of
test_cpu_kernels; between levels, thread counts, tiles and the twin: the same bits (lowbit.h).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_cpu_kernels import (assert_close, assert_same_bits_everywhere, level, one_step_bound,  # noqa: F401 (fixtures)
                              reference_product, rng, route_margin)

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, lowbit_twins

Q = GGMLQuantizationType
LEVELS = cpu.supported_isas()
ALL = (*LEVELS, "numpy")
LB = (Q.Q2_K, Q.Q3_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)


def random_lowbit(rng: np.random.Generator, rows: int, k: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, k // 256 * block bytes) uint8: random bytes, then f16 d (and dmin) of random sign and size."""
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, k)), dtype=np.uint8)
    b = raw.view(quant.BLOCK_DTYPES[qtype])

    def f16(shape):
        return (rng.choice([-1, 1], shape) * rng.uniform(0.5, 1, shape) * 2.0 ** rng.integers(-14, -6, shape)
                ).astype(np.float16)

    if qtype == Q.IQ1_M:                       # d's 16 bits are the top nibbles of the 4 scale words
        d = f16(b.shape).view("<u2")[..., None]
        b["scales"] = (b["scales"] & 0x0FFF) | ((d >> (4 * np.arange(4))) & 15) << 12
        return raw
    b["d"] = f16(b.shape)
    if qtype == Q.Q2_K:
        b["dmin"] = f16(b.shape)
    return raw


@pytest.mark.parametrize("qtype", LB, ids=lambda t: t.name)
def test_unpack_matches_gguf_dequantization(qtype, rng):
    raw = random_lowbit(rng, 7, 768, qtype)
    u, sc, mn, d, dmin = lowbit_twins.lowbit_unpack(raw, qtype)
    u = u.reshape(7, 3, 16, 16).astype(np.float64) - lowbit_twins.OFFSETS[qtype]
    w = d[..., None, None].astype(np.float64) * sc[..., None] * u - (dmin[..., None].astype(np.float64) * mn)[..., None]
    ref = quants.dequantize(raw, qtype).astype(np.float64)
    assert np.all(np.abs(w.reshape(7, 768) - ref) <= 2.0**-24 * np.abs(ref))


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", LB, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(1, 256), (7, 768), (33, 2304), (130, 2048)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_lowbit_matmul_matches_gguf_reference(level, qtype, rows, k, m, rng):
    raw = random_lowbit(rng, rows, k, qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    ref, abs_sum = reference_product(raw, x, qtype)
    assert_close(cpu.matmul(raw, x, qtype), ref, abs_sum, k // 32)


@pytest.mark.parametrize("qtype", LB, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(301, 2304), (7, 8448), (6, 256)])
def test_lowbit_results_bit_identical_across_levels_threads_and_tiles(qtype, rows, k, rng):
    """Every level, 1-3 threads, one column alone or in a batch (the m > 1 path unpacks a row range
    once), and the numpy twin: the same bits."""
    assert_same_bits_everywhere(random_lowbit(rng, rows, k, qtype), k, qtype, rng)


EXTREMES = {Q.Q2_K: ({"qs": 0xFF, "scales": 0xFF}, {"qs": 0xFF, "scales": 0x0F}),
            Q.Q3_K: ({"qs": 0xFF, "hmask": 0xFF, "scales": 0x00}, {"qs": 0x00, "hmask": 0x00, "scales": 0xFF},
                     {"qs": 0xFF, "hmask": 0xFF, "scales": 0xFF})}
"""Fields set to the bytes that give a Q2_K / Q3_K row its largest codes and scales (Q2_K: code 3, scale 15,
min 15 or 0; Q3_K: value 3 or -4, scale -32 or 31)."""


@pytest.mark.parametrize("qtype", list(EXTREMES), ids=lambda t: t.name)
def test_lowbit_extreme_codes_and_full_scale_activations(qtype, rng):
    """The largest codes and scales against activations of +-127 in every value (each 32-value block of one
    sign): the integer sums at their bounds (lowbit.h; the AVX-512 level narrows 16-value sums to int16)
    match gguf's reference within the summation bound and the twin's bits, at every level and 1-3 threads."""
    k = 512
    raw = random_lowbit(rng, 2 * len(EXTREMES[qtype]), k, qtype)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    for i, fields in enumerate(EXTREMES[qtype]):
        for name, byte in fields.items():
            b[2 * i:2 * i + 2][name] = byte
    signs = rng.choice([-1.0, 1.0], (3, k // 32))
    x = (np.repeat(signs, 32, axis=1) * rng.uniform(0.5, 2, (3, 1))).astype(np.float32)
    x[2] = -x[1]
    ref, abs_sum = reference_product(raw, x, qtype)
    want = cpu.matmul_np(raw, x, qtype)
    assert_close(want, ref, abs_sum, k // 32)
    try:
        for name in LEVELS:
            cpu.set_isa(name)
            for n in (1, 2, 3):
                cpu.set_threads(n)
                assert np.array_equal(cpu.matmul(raw, x, qtype), want), (name, n)
                assert np.array_equal(cpu.matmul(raw, x[1], qtype), want[1]), (name, n)
    finally:
        cpu.set_isa(None)
        cpu.set_threads()


IQ = [t for t in LB if t.name.startswith("IQ")]


@pytest.mark.skipif("avx512vnni" not in LEVELS, reason="no AVX-512 VNNI level on this CPU")
@pytest.mark.parametrize("qtype", IQ, ids=lambda t: t.name)
def test_iq_gemv_same_bits_on_and_off_the_vbmi_path(qtype, rng):
    """The AVX-512 level's IQ GEMV on its VBMI + BITALG path (dd_set_iq_vbmi, where the CPU has them) and on
    its base code: the twin's bits for every row count (4-row tiles and the rows left over) and 1-3 threads (131
    rows: several chunks of rows at every type's row size), random columns and ones of +-127 in every value."""
    from engine import _native_cpu
    lib = _native_cpu.lib
    if lib.dd_set_iq_vbmi(1) != 0:
        pytest.skip("no AVX-512 VBMI + BITALG on this CPU")
    k = 2304
    raw = random_lowbit(rng, 131, k, qtype)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1] = np.repeat(rng.choice([-1.0, 1.0], k // 32), 32)
    x[2] = -x[1]
    want = cpu.matmul_np(raw, x, qtype)
    try:
        cpu.set_isa("avx512vnni")
        for on in (1, 0):
            assert lib.dd_set_iq_vbmi(on) == 0
            for n in (1, 2, 3):
                cpu.set_threads(n)
                for c in range(3):
                    for rows in (131, 130, 129, 128):
                        assert np.array_equal(cpu.matmul(raw[:rows], x[c], qtype), want[c, :rows]), (on, n, c, rows)
    finally:
        lib.dd_set_iq_vbmi(1)
        cpu.set_isa(None)
        cpu.set_threads()


MIXES = [("Q2_K", "Q2_K", "Q3_K", "Q3_K", "Q2_K", "Q3_K"), ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ3_S"),
         ("IQ1_M", "IQ1_M", "IQ2_S", "IQ3_S", "IQ1_S", "IQ2_XXS")]


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("mix", MIXES, ids="-".join)
def test_moe_ffn_on_lowbit_experts(level, mix, rng):
    """The fused MoE with low-bit gate, up, down and shared expert (mix: their types in that order)
    against its twin: the same routing, outputs within 1e-4 of the max plus one hidden value's Q8_0 step
    (test_cpu_kernels.one_step_bound; CI seed 214455685120582250327648607447992228155 put one there: 1.4e-3 of
    the max, the bound to 6 digits)."""
    d, n_expert, ff, ff_sh = 512, 8, 256, 256
    qtypes = dict(zip(("gate", "up", "down", "sh_gate", "sh_up", "sh_down"), (Q[t] for t in mix)))
    shapes = {"gate": (n_expert * ff, d), "up": (n_expert * ff, d), "down": (n_expert * d, ff), "sh_gate": (ff_sh, d),
              "sh_up": (ff_sh, d), "sh_down": (d, ff_sh)}
    w = cpu_moe.MoEWeights(router=rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2, n_used=3, qtypes=qtypes,
                           **{k: random_lowbit(rng, *shapes[k], qtypes[k]) for k in shapes},
                           sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1)
    x = rng.standard_normal(d).astype(np.float32)
    while route_margin(x, w) < 1e-3:
        x = rng.standard_normal(d).astype(np.float32)
    got, ref = cpu_moe.moe_ffn(x, w), cpu_moe.moe_ffn_np(x, w)
    assert np.array_equal(got.experts, ref.experts)
    assert (np.abs(got.out - ref.out) <= 1e-4 * np.abs(ref.out).max() + one_step_bound(x, w, ref)).all()


def test_lowbit_rows_must_be_whole_super_blocks(rng):
    raw = random_lowbit(rng, 2, 256, Q.Q2_K)
    with pytest.raises(ValueError, match="Q2_K blocks"):
        cpu.matmul(raw, np.ones(288, np.float32), Q.Q2_K)
    with pytest.raises(ValueError, match="Q3_K blocks"):
        cpu.Matrix(raw, 256, Q.Q3_K)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_iq_codebooks_are_checked_when_registered():
    from engine import _native_cpu
    lib, ffi = _native_cpu.lib, _native_cpu.ffi
    grid = np.zeros(100, np.int8)
    assert lib.dd_set_iq_grid(lib.DD_IQ2_XXS, ffi.cast("int8_t *", ffi.from_buffer(grid)), grid.size) == lib.DD_ERR_ARG
    assert lib.dd_set_iq_grid(lib.DD_Q4_K, ffi.cast("int8_t *", ffi.from_buffer(grid)), grid.size) == lib.DD_ERR_ARG


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("qtype, n_values", [(Q.IQ2_XXS, 4), (Q.IQ2_XS, 4), (Q.IQ2_S, 4), (Q.IQ3_XXS, 8), (Q.IQ3_S, 8),
                                              (Q.IQ1_S, 4)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_iq_codebook_with_more_values_than_its_codes_is_refused(qtype, n_values, rng):
    """The AVX-512 level looks IQ2_XXS .. IQ3_S grids up as 2-bit (IQ2) or 3-bit (IQ3) codes of their distinct
    values, and every grid is held to the same bound: a grid of the right size with n_values + 1 distinct values is
    refused, and leaves the registered one as it was:
    row 0 reads only grid entry 0 (the one the bad grid rewrites; index bytes and bits zero), and every level
    gives the twin's bits (the twin decodes with gguf-py's grids, not the registered ones)."""
    from engine import _native_cpu
    from engine.kernels.iq_twins import grids
    lib, ffi = _native_cpu.lib, _native_cpu.ffi
    bad = grids()[qtype].copy()
    extra = np.setdiff1d(np.arange(-8, 9), bad)[: n_values + 1 - len(np.unique(bad))]
    bad[: len(extra)] = extra
    assert len(np.unique(bad)) == n_values + 1
    kernel = quant.TYPES[qtype].cpu_kernel
    assert lib.dd_set_iq_grid(kernel, ffi.cast("int8_t *", ffi.from_buffer(bad)), bad.size) == lib.DD_ERR_ARG
    raw = random_lowbit(rng, 5, 512, qtype)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    b["qs"][0] = 0
    if qtype in (Q.IQ3_S, Q.IQ2_S, Q.IQ1_S):
        b["qh"][0] = 0
    x = rng.standard_normal((2, 512)).astype(np.float32)
    ref, abs_sum = reference_product(raw, x, qtype)
    want = cpu.matmul_np(raw, x, qtype)
    assert_close(want, ref, abs_sum, 512 // 32)
    try:
        for name in LEVELS:
            cpu.set_isa(name)
            assert np.array_equal(cpu.matmul(raw, x, qtype), want), name
            assert np.array_equal(cpu.matmul(raw, x[1], qtype), want[1]), name
    finally:
        cpu.set_isa(None)
