"""Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS CPU kernels (read as stored: native/cpu/quant/bquants.h) at every
ISA level and in the numpy twin.

Weights are random blocks drawn byte by byte (random quant codes, fifth bits and IQ4_XS 6-bit
scales; f16 d and m of random sign and size, never zero; odd row counts, block counts that are not
a multiple of the 8-block group). gguf.quants cannot write the IQ4 types, so every type is drawn the
same way; the references dequantize with gguf.quants (ggml's reference decoder, independent of the
code under test) and multiply in float64. The type always comes from the quant-type table.

Tolerances.
* Against the Q8_0-quantized activations: the summation bound of test_cpu_kernels,
  ``(k // 32 + 16) 2^-24 sum|w a|`` (integer parts and scale products are exact; only f64 additions,
  the final f32 rounding and gguf's own f32 rounding of ``d q + m`` err).
* Against the float activations x: that bound plus what the Q8_0 rounding of x can move the sum.
  Per activation block of scale d = max|x| / 127 (stored as f16 d'): ``|q d' - x| <= d / 2 + 127
  |d' - d| <= d (1/2 + 127 2^-11)`` (round half away, then the f16 scale's relative error <= 2^-11),
  so ``|y - w.x| <= sum_j |w_j| d_b(j) (1/2 + 127 2^-11)``, plus 1e-6 relative slack for the f32
  division x / d.
* Between levels, thread counts, tiles and the twin: bit-identical (the same f64 operations in the
  same order, bquants.h).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_cpu_kernels import (assert_close, assert_same_bits_everywhere, level, one_step_bound,  # noqa: F401 (fixtures)
                              reference_product, rng, route_margin)

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, cpu_twins

Q = GGMLQuantizationType
LEVELS = cpu.supported_isas()
ALL = (*LEVELS, "numpy")
BQ = (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)


def random_bquant(rng: np.random.Generator, rows: int, k: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, row bytes of k values) uint8 of ``qtype``: random code bytes (nibbles, fifth bits,
    IQ4_XS scales), f16 d (and m) of random sign and size, never zero; MXFP4: an e8m0 exponent e of
    2^(e - 128) in 2^-20 .. 2^-1 (real weights' range; the kernels' scale products are exact there)."""
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, k)), dtype=np.uint8)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    for field in ("d", "m"):
        if field in b.dtype.names:
            b[field] = (rng.choice([-1, 1], b.shape) * rng.uniform(0.5, 1, b.shape)
                        * 2.0 ** rng.integers(-14, -6, b.shape)).astype(np.float16)
    if qtype == Q.MXFP4:
        b["e"] = rng.integers(108, 128, b.shape)
    return raw


def block_count(qtype: GGMLQuantizationType, blocks: int) -> int:
    """k for `blocks` blocks of the type (IQ4_XS: super-blocks)."""
    return blocks * quant.block_size(qtype)


@pytest.mark.parametrize("qtype", BQ, ids=lambda t: t.name)
def test_unpack_matches_gguf_dequantization(qtype, rng):
    """The twin's integer decoding, recombined in float64, equals gguf's float32 values to 2^-24 relative."""
    k = block_count(qtype, 9)
    raw = random_bquant(rng, 5, k, qtype)
    v, mult, d, m = cpu_twins.bquant_unpack(raw, qtype)
    w = d[..., None].astype(np.float64) * mult[..., None] * v
    if m is not None:
        w += m[..., None]
    ref = quants.dequantize(raw, qtype).astype(np.float64)
    assert np.all(np.abs(w.reshape(5, k) - ref) <= 2.0**-24 * np.abs(ref))
    assert quant.TYPES[qtype].cpu_kernel is not None and qtype in cpu.KERNEL_TYPES


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", BQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks", [(1, 1), (7, 3), (33, 13), (130, 16)])
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_matches_gguf_reference(level, qtype, rows, blocks, m, rng):
    k = block_count(qtype, blocks)
    raw = random_bquant(rng, rows, k, qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    ref, abs_sum = reference_product(raw, x, qtype)
    y = cpu.matmul(raw, x, qtype)
    assert_close(y, ref, abs_sum, k // 32)


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", BQ, ids=lambda t: t.name)
def test_matmul_is_within_the_q8_0_activation_rounding_of_the_float_product(level, qtype, rng):
    k = block_count(qtype, 11)
    raw = random_bquant(rng, 9, k, qtype)
    x = (rng.standard_normal((2, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    w = quants.dequantize(raw, qtype).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    ref, abs_sum = reference_product(raw, x, qtype)
    d = np.abs(x.reshape(2, -1, 32)).max(axis=2) / 127                    # (m, blocks)
    step = np.repeat(d, 32, axis=1) * (0.5 + 127 * 2.0**-11) * (1 + 1e-6)
    bound = step @ np.abs(w).T + (k // 32 + 16) * 2.0**-24 * abs_sum
    assert np.all(np.abs(cpu.matmul(raw, x, qtype) - exact) <= bound)


@pytest.mark.parametrize("qtype", BQ, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [21, 24])
def test_results_bit_identical_across_levels_threads_and_tiles(qtype, blocks, rng):
    """Every level, 1-3 threads, one column alone or in a batch, and the numpy twin: the same bits. 21 blocks
    leave a short 8-block group; 24 are whole groups, which AVX-512 multiplies by kq_gemm_avx512.h's expanded
    rows from 3 columns on (IQ4_XS: 3 and 4 super-blocks, whole either way)."""
    k = 32 * blocks if quant.block_size(qtype) == 32 else 256 * (blocks // 6)
    raw = random_bquant(rng, 301, k, qtype)                    # several thread chunks, a ragged last one
    assert_same_bits_everywhere(raw, k, qtype, rng)


def test_mxfp4_every_exponent_bit_identical_everywhere(rng):
    """Row r is one MXFP4 group (8 blocks; the AVX-512 level converts a full group's 8 e8m0 bytes at once) whose
    block r % 8 has e = r and random codes, the other 7 random e and zero codes: row r's result is block r's
    alone, for every e in 0 .. 255 (2^-129 .. 2^127, the two subnormal ones included). Every level, 1-3 threads
    and the twin give the same bits; for e <= 200 (products within f32) within the summation bound of gguf's
    reference."""
    k = 256
    raw = random_bquant(rng, 256, k, Q.MXFP4)
    b = raw.view(quant.BLOCK_DTYPES[Q.MXFP4])
    b["e"] = rng.integers(0, 256, b.shape)
    rows = np.arange(256)
    b["e"][rows, rows % 8] = rows
    keep = np.zeros(b.shape, bool)
    keep[rows, rows % 8] = True
    b["qs"][~keep] = 0                                   # code 0 is the value 0 in both nibbles
    with np.errstate(over="ignore", invalid="ignore"):   # the twin's f32 products of e > 200 overflow, as the kernels'
        assert_same_bits_everywhere(raw, k, Q.MXFP4, rng)
    x = rng.standard_normal((2, k)).astype(np.float32)
    ref, abs_sum = reference_product(raw[:201], x, Q.MXFP4)
    assert_close(cpu.matmul(raw[:201], x, Q.MXFP4), ref, abs_sum, k // 32)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_moe_ffn_on_mixed_block_types(level, rng):
    """The fused MoE with IQ4_XS gate/up, Q5_1 down and a Q4_1 / IQ4_NL / Q5_0 shared expert against its
    twin: same routing, outputs within 1e-4 of the max plus one hidden value's Q8_0 step (the SiLU rounding
    argument of test_cpu_kernels.one_step_bound)."""
    d, n_expert, ff, ff_sh = 256, 8, 256, 64
    qtypes = {"gate": Q.IQ4_XS, "up": Q.IQ4_XS, "down": Q.Q5_1, "sh_gate": Q.Q4_1, "sh_up": Q.IQ4_NL,
              "sh_down": Q.Q5_0}
    w = cpu_moe.MoEWeights(router=rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2,
                       gate=random_bquant(rng, n_expert * ff, d, Q.IQ4_XS),
                       up=random_bquant(rng, n_expert * ff, d, Q.IQ4_XS),
                       down=random_bquant(rng, n_expert * d, ff, Q.Q5_1), n_used=3, qtypes=qtypes,
                       sh_gate=random_bquant(rng, ff_sh, d, Q.Q4_1), sh_up=random_bquant(rng, ff_sh, d, Q.IQ4_NL),
                       sh_down=random_bquant(rng, d, ff_sh, Q.Q5_0),
                       sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1)
    x = rng.standard_normal(d).astype(np.float32)
    while route_margin(x, w) < 1e-3:
        x = rng.standard_normal(d).astype(np.float32)
    got, ref = cpu_moe.moe_ffn(x, w), cpu_moe.moe_ffn_np(x, w)
    assert np.array_equal(got.experts, ref.experts)
    assert (np.abs(got.out - ref.out) <= 1e-4 * np.abs(ref.out).max() + one_step_bound(x, w, ref)).all()


def test_the_type_is_passed_in_not_read_from_the_row_length(rng):
    """IQ4_NL and Q4_0 rows have the same length (18 bytes a block): the table's type decides."""
    raw = random_bquant(rng, 3, 64, Q.IQ4_NL)
    x = rng.standard_normal(64).astype(np.float32)
    as_iq4 = cpu.Matrix(raw, 64, Q.IQ4_NL)(x[None])[0]
    as_q4_0 = cpu.Matrix(raw, 64, Q.Q4_0)(x[None])[0]
    assert np.array_equal(as_iq4, cpu.matmul_np(raw, x, Q.IQ4_NL)) and not np.array_equal(as_iq4, as_q4_0)
    with pytest.raises(ValueError, match="IQ4_XS blocks"):
        cpu.Matrix(random_bquant(rng, 2, 256, Q.Q4_1), 256, Q.IQ4_XS)
