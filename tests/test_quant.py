"""engine.gguf.quant against gguf.quants and against hand-written decoders of the ggml-common.h block structs.

Inputs are fresh random draws each run (the seed is printed, so a failure can be replayed).
Tolerances: equality is exact (bitwise) where both sides do the same float32 operations; the
K-quant hand decoders, which group the multiplications differently, are held to 1e-6 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

from engine.gguf import quant
from engine.errors import UnsupportedModelError

K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def random_raw(rng, qtype, rows, ne0):
    """Random stored bytes of a (rows, ne0) tensor with finite, moderate f16 scale fields."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return quant.quantize(rng.standard_normal((rows, ne0)).astype(np.float32), qtype)
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, ne0)), dtype=np.uint8)
    blocks = raw.view(quant.BLOCK_DTYPES[qtype])
    for field in ("d", "m", "dmin"):
        if field in blocks.dtype.names:
            blocks[field] = rng.uniform(-0.1, 0.1, blocks.shape).astype(np.float16)
    return raw


def test_block_dtypes_have_ggml_sizes():
    for qtype, dtype in quant.BLOCK_DTYPES.items():
        assert dtype.itemsize == GGML_QUANT_SIZES[qtype][1], qtype.name
    # byte offsets of the scale fields as declared in ggml-common.h
    assert quant.BLOCK_DTYPES[Q.Q6_K].fields["d"][1] == 208
    assert quant.BLOCK_DTYPES[Q.Q2_K].fields["dmin"][1] == 82
    assert quant.BLOCK_DTYPES[Q.Q3_K].fields["d"][1] == 108
    assert quant.BLOCK_DTYPES[Q.Q5_K].fields["qs"][1] == 48


def test_quant_type_table_rows_agree_with_gguf():
    for qtype, row in quant.TYPES.items():
        assert (row.qtype, row.name) == (qtype, qtype.name)
        assert (row.block_values, row.block_bytes) == GGML_QUANT_SIZES[qtype]
        assert row.block_dtype.itemsize == row.block_bytes
    assert quant.traits(int(Q.Q4_0), "t") is quant.TYPES[Q.Q4_0]
    assert quant.WRITABLE_TYPES == {t for t, row in quant.TYPES.items() if row.writable}
    with pytest.raises(UnsupportedModelError, match="tensor x: quant type TQ1_0 is not supported"):
        quant.traits(Q.TQ1_0, "tensor x")
    with pytest.raises(UnsupportedModelError, match="type 99"):
        quant.traits(99, "tensor x")


@pytest.mark.parametrize("qtype", sorted(quant.WRITABLE_TYPES, key=int), ids=lambda t: t.name)
def test_quantize_matches_gguf_and_bounds_error(rng, qtype):
    x = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 10)).astype(np.float32)
    raw = quant.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (5, quant.row_bytes(qtype, 96))
    ref = np.ascontiguousarray(gq.quantize(x, qtype)).view(np.uint8).reshape(raw.shape)
    np.testing.assert_array_equal(raw, ref)
    y = quant.dequantize(raw, qtype, x.shape)
    np.testing.assert_array_equal(y, gq.dequantize(ref, qtype).reshape(x.shape))
    # per-block error bound of each format (block = 32 values; float types: relative rounding)
    bs = quant.block_size(qtype)
    xb, eb = x.reshape(-1, max(bs, 1)), np.abs(y - x).reshape(-1, max(bs, 1))
    amax = np.abs(xb).max(axis=1, keepdims=True)
    span = xb.max(axis=1, keepdims=True) - xb.min(axis=1, keepdims=True)
    bound = {
        Q.F32: 0 * amax, Q.F16: np.abs(xb) * 2.0 ** -11, Q.BF16: np.abs(xb) * 2.0 ** -8,
        Q.Q8_0: amax * (1 / 254 + 1e-3), Q.Q4_0: amax * (1 / 8 + 1e-3), Q.Q5_0: amax * (1 / 16 + 1e-3),
        Q.Q4_1: span * (1 / 30 + 1e-3) + amax * 1e-3, Q.Q5_1: span * (1 / 62 + 1e-3) + amax * 1e-3,
        # d = 2^(floor(log2 amax) - 3), codes d * (0, 1, 2, 3, 4, 6, 8, 12): amax < 16 d clips to 12 d,
        # at most 4 d <= amax / 2
        Q.MXFP4: amax * (1 / 2 + 1e-3),
    }[qtype]
    assert np.all(eb <= bound + 1e-7)


@pytest.mark.parametrize("qtype", sorted(quant.SUPPORTED_TYPES, key=int), ids=lambda t: t.name)
def test_dequantize_matches_gguf_in_math_shape(rng, qtype):
    ne0 = 2 * quant.block_size(qtype) if quant.block_size(qtype) > 1 else 48
    raw = random_raw(rng, qtype, 6, ne0)
    out = quant.dequantize(raw.reshape(2, 3, -1), qtype, (2, 3, ne0))
    assert out.dtype == np.float32 and out.shape == (2, 3, ne0)
    np.testing.assert_array_equal(out.reshape(6, ne0), gq.dequantize(raw, qtype))
    assert not np.shares_memory(out, raw)


def hand_q4_0(raw):
    """block_q4_0 {f16 d; u8 qs[16]}: x[j] = d*((qs[j] & 15) - 8), x[j+16] = d*((qs[j] >> 4) - 8)."""
    b = raw.reshape(-1, 18)
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)
    qs = b[:, 2:18]
    q = np.concatenate([(qs & 15).astype(np.int8) - 8, (qs >> 4).astype(np.int8) - 8], axis=1)
    return (d * q.astype(np.float32)).reshape(raw.shape[0], -1)


def hand_q8_0(raw):
    """block_q8_0 {f16 d; i8 qs[32]}: x[j] = d*qs[j]."""
    b = raw.reshape(-1, 34)
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)
    return (b[:, 2:34].view(np.int8).astype(np.float32) * d).reshape(raw.shape[0], -1)


def hand_q4_k(raw):
    """block_q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]} (ggml-quants.c dequantize_row_q4_K)."""
    out = []
    for b in raw.reshape(-1, 144):
        d = np.float32(b[0:2].view("<f2")[0])
        dmin = np.float32(b[2:4].view("<f2")[0])
        sc, qs = b[4:16].astype(np.int32), b[16:144].astype(np.int32)
        for j in range(8):
            if j < 4:
                s, m = sc[j] & 63, sc[j + 4] & 63
            else:
                s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4)
                m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
            q = qs[32 * (j // 2):32 * (j // 2) + 32]
            q = q & 15 if j % 2 == 0 else q >> 4
            out.append(d * np.float32(s) * q.astype(np.float32) - dmin * np.float32(m))
    return np.concatenate(out).reshape(raw.shape[0], -1)


def hand_q6_k(raw):
    """block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} (ggml-quants.c dequantize_row_q6_K)."""
    out = []
    for b in raw.reshape(-1, 210):
        ql, qh = b[0:128].astype(np.int32), b[128:192].astype(np.int32)
        sc, d = b[192:208].view(np.int8).astype(np.float32), np.float32(b[208:210].view("<f2")[0])
        y = np.zeros(256, np.float32)
        lane = np.arange(32)
        for n in range(2):
            lo, hi = ql[64 * n:64 * n + 32], ql[64 * n + 32:64 * n + 64]
            h, s = qh[32 * n:32 * n + 32], sc[8 * n:8 * n + 8]
            parts = [(lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4),
                     (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)]
            for k, q in enumerate(parts):
                y[128 * n + 32 * k + lane] = d * s[lane // 16 + 2 * k] * (q - 32).astype(np.float32)
        out.append(y)
    return np.concatenate(out).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype,hand,exact", [(Q.Q4_0, hand_q4_0, True), (Q.Q8_0, hand_q8_0, True),
                                              (Q.Q4_K, hand_q4_k, False), (Q.Q6_K, hand_q6_k, False)],
                         ids=["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_hand_decoder(rng, qtype, hand, exact):
    ne0 = 2 * quant.block_size(qtype)
    raw = random_raw(rng, qtype, 3, ne0)
    got = quant.dequantize(raw, qtype, (3, ne0))
    want = hand(raw)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_block_view_exposes_fields(rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    raw = quant.quantize(x, Q.Q8_0)
    v = quant.block_view(raw, Q.Q8_0)
    assert v.shape == (2, 2)
    np.testing.assert_array_equal(v["qs"].astype(np.float32) * v["d"].astype(np.float32)[..., None],
                                  quant.dequantize(raw, Q.Q8_0, (2, 64)).reshape(2, 2, 32))


def test_unsupported_types_raise_named_errors():
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up_exps\.weight.*TQ2_0"):
        quant.check_supported(Q.TQ2_0, "model.gguf: tensor blk.0.ffn_up_exps.weight")
    with pytest.raises(UnsupportedModelError, match="type 250"):
        quant.check_supported(250, "t")
    with pytest.raises(UnsupportedModelError, match="NVFP4"):
        quant.dequantize(np.zeros((1, 36), np.uint8), Q.NVFP4, (1, 64))
    with pytest.raises(UnsupportedModelError, match="Q4_K"):
        quant.quantize(np.zeros((1, 256), np.float32), Q.Q4_K)


def test_sizes_and_names():
    assert quant.row_bytes(Q.Q4_0, 64) == 36 and quant.row_bytes(Q.Q6_K, 512) == 420
    assert quant.row_bytes(Q.F32, 3) == 12
    with pytest.raises(ValueError, match="Q4_0"):
        quant.row_bytes(Q.Q4_0, 48)
    with pytest.raises(ValueError, match="shape"):
        quant.dequantize(np.zeros(35, np.uint8), Q.Q4_0, (2, 32))
    assert quant.type_name(Q.Q5_K) == "Q5_K" and quant.type_name(999) == "type 999"
    assert quant.parse_type("q8_0") is Q.Q8_0
    with pytest.raises(ValueError):
        quant.parse_type("q9_9")
