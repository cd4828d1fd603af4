"""Q8_0 KV cache: rows stored as GGML Q8_0 blocks (a half scale and 32 int8 per 32 values), written by one
deterministic rule in numpy (engine/turn/kv_types.py) and in C (the decode step), read by the attention
kernels block by block and widened exactly.

So a Q8_0 cache must give exactly the bits of an F32 cache holding its dequantized values, at every ISA
level and thread count and for every split of a prompt (decode = prefill: the C quantizer must store the
bytes numpy's stores). Tolerance vs the float64 reference on those values: that of
tests/test_attention_prefill.py (1e-5 of max |ref|), since the arithmetic after widening is the F32 kernel's.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35 import cpu_mixers
from engine.gguf.quant import dequantize
from engine.kernels import cpu
from engine.turn.kv_types import Q8_BLOCK, dequantize_q8_0, kv_row_bytes, quantize_q8_0
from engine.turn.state import SequenceState
from tests.test_kv_f16 import assert_cache_gives_f32_bits, native, run  # noqa: F401 (the native model fixture)

native_only = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")


def test_q8_0_rows_are_ggml_blocks_within_half_a_step():
    """The bytes decode as GGML Q8_0 (the GGUF reader's own decoder agrees), and each value is within half a
    quantization step of its input: |x - d q| <= d (1/2 + 127 u) + (amax - 127 d)+, where u = 2^-24 bounds
    the float quotient's rounding and the last term the clamp when the half scale d rounded below amax / 127."""
    from gguf import GGMLQuantizationType
    rng = np.random.default_rng()
    x = (rng.standard_normal((40, 3, 128)) * rng.uniform(1e-3, 50, (40, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0.0                                        # an all-zero block: d = 0, q = 0
    x[1, 1, 5] = -x[1, 1].max() * 3                           # the block's amax is a negative value
    b = quantize_q8_0(x)
    assert b.dtype == np.uint8 and b.shape == (40, 3, 128 // Q8_BLOCK * 34)
    y = dequantize_q8_0(b)
    ggml = dequantize(b.reshape(-1), GGMLQuantizationType.Q8_0, (x.size,)).reshape(x.shape)
    assert np.array_equal(y, ggml)
    blocks, deq = x.reshape(-1, Q8_BLOCK), y.reshape(-1, Q8_BLOCK)
    d = b.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float64)
    amax = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float64)
    bound = d * (0.5 + 127 * 2.0 ** -24) + np.maximum(amax - 127 * d, 0)
    assert (np.abs(blocks.astype(np.float64) - deq) <= bound).all()
    assert np.array_equal(deq[(blocks == 0).all(axis=1)], np.zeros((1, Q8_BLOCK)))
    assert np.array_equal(quantize_q8_0(y), b)                # idempotent: dequantized rows are fixed points


def test_q8_0_rounds_half_away_from_zero_and_is_per_row():
    """A value at exactly half a step rounds away from zero (not to even), and a row quantizes the same
    alone or among others (what split invariance needs)."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -0.5               # d = 1 exactly
    q = quantize_q8_0(x)[0, 2:].view(np.int8)
    assert q[:3].tolist() == [127, 3, -1]
    rows = np.random.default_rng(3).standard_normal((9, 2, 64)).astype(np.float32)
    whole = quantize_q8_0(rows)
    assert all(np.array_equal(quantize_q8_0(rows[i:i + 1]), whole[i:i + 1]) for i in range(9))


def q8_cache(rng, m, n_kv, hd):
    k = rng.standard_normal((m, n_kv, hd)).astype(np.float32)
    v = (rng.uniform(0.1, 2.0, (m, n_kv, hd)) * rng.choice([-1, 1], (m, n_kv, hd))).astype(np.float32)
    return quantize_q8_0(k), quantize_q8_0(v)


@native_only
@pytest.mark.parametrize("m, n, n_head, n_kv, hd", [(37, 37, 8, 2, 64), (531, 259, 8, 8, 32), (300, 1, 16, 2, 256)])
def test_q8_0_cache_gives_the_bits_of_f32_rows_holding_its_values(isa_reset, m, n, n_head, n_kv, hd):
    rng = np.random.default_rng()
    q = rng.standard_normal((n, n_head, hd)).astype(np.float32) * 2.5
    gate = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    k, v = q8_cache(rng, m, n_kv, hd)
    assert_cache_gives_f32_bits(q, gate, k, v, dequantize_q8_0(k), dequantize_q8_0(v))


@native_only
def test_q8_0_caches_of_the_wrong_shape_are_refused():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = np.zeros((8, 2, 17), np.uint8)                       # head_dim 16 is not a multiple of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_mixers.attention_decode(q, q, k, k)
    q = rng.standard_normal((4, 32)).astype(np.float32)
    k = np.zeros((8, 2, 32), np.uint8)                       # 32 bytes where a Q8_0 row of 32 holds 34
    with pytest.raises(ValueError, match="hd / 32 \\* 34"):
        cpu_mixers.attention_decode(q, q, k, k)


def test_a_q8_0_state_needs_a_head_dim_of_32s_and_counts_34_bytes_per_32():
    from tests.test_prefix_cache import HP                   # head_dim 8
    with pytest.raises(ValueError, match="multiple of 32"):
        SequenceState.new(HP, 16, "q8_0")
    assert kv_row_bytes((2, 256), "q8_0") == 2 * 256 // 32 * 34 == 544


def test_q8_0_decode_step_stores_the_bytes_numpy_stores(native):
    """Token-by-token decode (the native step, which quantizes the rows in C) and one-pass prefill (numpy's
    quantizer) store the same Q8_0 bytes and give the same logits; the F32 run differs by the rounding, and
    its rows quantize to the Q8_0 run's (each row is quantized once, from the float32 row)."""
    tokens = np.random.default_rng(7).integers(0, native.hp.n_vocab, 40)
    want, ws = run(native, tokens, [], "q8_0")
    assert native.step is not None and native.step.takes(1, None)
    got, gs = run(native, tokens, list(range(1, 40)), "q8_0")
    assert np.array_equal(got, want)
    for il in ws.k:
        assert gs.k[il].dtype == np.uint8
        assert np.array_equal(gs.k[il], ws.k[il]) and np.array_equal(gs.v[il], ws.v[il])
    f32, fs = run(native, tokens, [], "f32")
    first = next(iter(ws.v))
    for table, ftable in ((ws.k, fs.k), (ws.v, fs.v)):    # the first attention layer sees no earlier KV rounding
        assert np.array_equal(quantize_q8_0(ftable[first][:40]), table[first][:40])
    assert not np.array_equal(f32, want)
