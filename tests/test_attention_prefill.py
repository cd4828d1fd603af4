"""Tiled causal prefill attention (native/cpu/attention/attn_kernel.h, ``dd_attn_prefill``) vs the float64
reference, and its split invariance: a query's bits must not depend on the call it comes in
(chunking, the prefix cache's resume point), on the thread count or on the ISA level, and must equal
what one-query decode (``dd_attn_decode``) gives at that position.

Tolerance vs :func:`engine.ops.reference.gated_attention` (float64): max |error| <= 1e-5 * max |ref|;
measured ~1e-6 (float32 scores and weighted sums over blocks of 256, a float exp within 1.22 ulp).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.arch.qwen35 import cpu_mixers
from engine.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")

REL_TOL = 1e-5



def inputs(rng, m: int, n: int, n_head: int, n_kv: int, hd: int):
    """Random q, gate (n, n_head, hd) and a cache k, v (m, n_kv, hd), float32, no zeros; scores up to
    ~|10| so the softmax is neither flat nor one-hot."""
    q = rng.standard_normal((n, n_head, hd)).astype(np.float32) * 2.5
    gate = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((m, n_kv, hd)).astype(np.float32)
    v = (rng.uniform(0.1, 2.0, (m, n_kv, hd)) * rng.choice([-1, 1], (m, n_kv, hd))).astype(np.float32)
    return q, gate, k, v


def reference(q, gate, k, v):
    """Each query i (at cache row m - n + i) by the float64 reference over rows 0..m-n+i."""
    n, m = q.shape[0], k.shape[0]
    return np.stack([cpu_mixers.attention_decode_np(q[i], gate[i], k[:m - n + i + 1], v[:m - n + i + 1])
                     for i in range(n)])


@pytest.mark.parametrize("m, n, n_head, n_kv, hd", [
    (1, 1, 4, 2, 16),        # one position
    (37, 37, 8, 2, 64),      # a whole short prompt, GQA 4
    (300, 45, 6, 1, 32),     # crosses a block boundary, GQA 6 (a partial set of rows)
    (531, 259, 8, 8, 48),    # no GQA, odd lengths, three blocks
    (270, 17, 16, 2, 16),    # GQA 8
])
def test_prefill_attention_matches_the_float64_reference(m, n, n_head, n_kv, hd):
    rng = np.random.default_rng(m * 1000 + n)
    q, gate, k, v = inputs(rng, m, n, n_head, n_kv, hd)
    got = cpu_mixers.attention_prefill(q, gate, k, v)
    want = reference(q, gate, k, v)
    assert got.shape == (n, n_head * hd) and got.dtype == np.float32
    assert np.abs(got - want).max() <= REL_TOL * np.abs(want).max()


@pytest.mark.parametrize("m, n_head, n_kv, hd", [
    (300, 8, 2, 32),     # GQA 4: a set of 8 rows holds 2 positions
    (290, 6, 2, 48),     # GQA 3: sets of rows from 3 positions, partial sets, an odd 16 head dims
    (270, 8, 2, 256),    # the minicpmv46 / Qwen3.5-0.8B attention layer
    (150, 4, 4, 32),     # no GQA: a set of 8 rows spans 8 positions
    (150, 8, 1, 32),     # GQA 8: a set is one position's heads
])
def test_prefill_bits_do_not_depend_on_chunks_threads_or_isa(isa_reset, m, n_head, n_kv, hd):
    """Prefill of m positions in one call and in chunks of 7 and 256 (chunks that start mid-block,
    like a prefix-cache resume; jobs of 16 and 64 positions), and decode query by query: the same
    bits at every ISA level (1 and 2 threads at the best one)."""
    rng = np.random.default_rng(5)
    q, gate, k, v = inputs(rng, m, m, n_head, n_kv, hd)
    results = {"decode": np.stack([cpu_mixers.attention_decode(q[i], gate[i], k[:i + 1], v[:i + 1])
                                   for i in range(m)])}
    levels = cpu.supported_isas()
    for level in levels:
        cpu.set_isa(level)
        for threads in (1, 2) if level == levels[-1] else (2,):
            cpu.set_threads(threads)
            results[(level, threads, "one call")] = cpu_mixers.attention_prefill(q, gate, k, v)
            for chunk in (7, 256):
                parts = [cpu_mixers.attention_prefill(q[a:a + chunk], gate[a:a + chunk], k[:a + chunk], v[:a + chunk])
                         for a in range(0, m, chunk)]
                results[(level, threads, chunk)] = np.concatenate(parts)
    for key, got in results.items():
        assert np.array_equal(got, results["decode"]), f"{key}: max gap {np.abs(got - results['decode']).max()}"
    want = reference(q, gate, k, v)
    assert np.abs(results["decode"] - want).max() <= REL_TOL * np.abs(want).max()


def test_sharp_softmax_over_the_whole_exp_range(isa_reset):
    """Scores spread over ~|60| (q 6x larger than :func:`inputs`'), so s - mx runs from 0 past the
    exp's -87 cut-off: every level's prefill equals decode bit for bit and stays within REL_TOL of
    the float64 reference."""
    rng = np.random.default_rng(87)
    q, gate, k, v = inputs(rng, 300, 40, 4, 2, 32)
    q *= 6
    want = reference(q, gate, k, v)
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        got = cpu_mixers.attention_prefill(q, gate, k, v)
        assert np.abs(got - want).max() <= REL_TOL * np.abs(want).max(), level
        last = cpu_mixers.attention_decode(q[-1], gate[-1], k, v)
        assert np.array_equal(got[-1], last), level


def test_prefill_attention_rejects_bad_shapes():
    rng = np.random.default_rng(6)
    q, gate, k, v = inputs(rng, 8, 4, 4, 2, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_mixers.attention_prefill(q, gate, k, v)
    q, gate, k, v = inputs(rng, 8, 9, 4, 2, 16)
    with pytest.raises(ValueError, match="n <= m"):
        cpu_mixers.attention_prefill(q, gate, k, v)
    q, gate, k, v = inputs(rng, 8, 4, 6, 4, 16)
    with pytest.raises(ValueError, match="n_head % n_kv"):
        cpu_mixers.attention_prefill(q, gate, k, v)


DECODE_COPIES = {"scalar": "attn_decode_base", "avx2": "attn_decode_avx2", "avx512vnni": "attn_decode_avx512"}
"""The per-level copies of the decode kernel in the extension (native/cpu/attention/attention*.c)."""


@pytest.mark.parametrize("m, n_head, n_kv, hd", [
    (259, 8, 2, 256),    # the real layer; a last block of 3 keys (AVX2 scores take 4 keys at a time)
    (513, 6, 2, 48),     # GQA 3, hd 48 (AVX2 weighted sums in 16-dim pieces), a last block of 1 key
    (270, 4, 4, 80),     # no GQA, hd 80 (a 64-dim and a 16-dim piece), a last block of 14 keys
])
def test_decode_copies_of_every_level_give_the_same_bits(m, n_head, n_kv, hd):
    """dd_attn_decode runs only the best level's copy, so each supported level's copy is called here
    by its symbol (ctypes, same arguments): the same bits as dd_attn_decode, within REL_TOL of the
    float64 reference."""
    rng = np.random.default_rng(m + hd)
    q, gate, k, v = inputs(rng, m, 1, n_head, n_kv, hd)
    want = cpu_mixers.attention_decode(q[0], gate[0], k, v)
    lib = ctypes.CDLL(cpu._native_cpu.__file__)
    for level in cpu.supported_isas():
        if level not in DECODE_COPIES:
            continue
        fn = getattr(lib, DECODE_COPIES[level])
        fn.argtypes = [ctypes.c_size_t] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_void_p]
        out = np.empty(n_head * hd, np.float32)
        assert fn(n_head, n_kv, hd, *(a.ctypes.data for a in (q, gate, k, v)), m, out.ctypes.data) == 0
        assert np.array_equal(out, want), f"{level}: max gap {np.abs(out - want).max()}"
    ref = reference(q, gate, k, v)[0]
    assert np.abs(want - ref).max() <= REL_TOL * np.abs(ref).max()
