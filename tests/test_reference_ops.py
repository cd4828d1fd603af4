"""Each reference op against an independent, slower form written from the spec's equations.

Inputs are fresh seeded random arrays with no zeros. Tolerances are stated per test; the slow
forms run in float64 and the ops compute in float64 too, so the bound is the float32 rounding of
the op's result (about 6e-8 relative) with margin.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from engine.ops import reference as ops


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Random float32 in +-[0.05, 1.05] * scale: never zero."""
    mag = rng.uniform(0.05, 1.05, shape)
    sign = rng.choice([-1.0, 1.0], shape)
    return (mag * sign * scale).astype(np.float32)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---- elementwise and norms (tolerance: 1e-6 relative) ----------------------------------------

def test_scalar_functions_match_math(rng):
    x = np.concatenate([rand(rng, 200, scale=30.0), np.float32([-100.0, 100.0, 1e-3])])
    sig = [1.0 / (1.0 + math.exp(-v)) if v > -700 else 0.0 for v in x.astype(float)]
    sp = [math.log1p(math.exp(v)) if v < 30 else v + math.log1p(math.exp(-v)) for v in x.astype(float)]
    assert rel_err(ops.sigmoid(x), np.array(sig)) < 1e-6
    assert rel_err(ops.silu(x), x.astype(float) * np.array(sig)) < 1e-6
    assert rel_err(ops.softplus(x), np.array(sp)) < 1e-6
    assert ops.sigmoid(x).dtype == ops.silu(x).dtype == ops.softplus(x).dtype == np.float32


def test_softmax_matches_loop(rng):
    x = rand(rng, 5, 40, scale=20.0)
    for row, got in zip(x.astype(float), ops.softmax(x)):
        e = [math.exp(v - max(row)) for v in row]
        assert rel_err(got, np.array(e) / math.fsum(e)) < 1e-6


def test_rmsnorm_and_l2norm_match_loop(rng):
    x, w = rand(rng, 7, 48), rand(rng, 48)
    eps = 1e-6
    for row, got_rms, got_l2 in zip(x.astype(float), ops.rmsnorm(x, w, eps), ops.l2norm(x, eps)):
        ms = math.fsum(v * v for v in row) / len(row)
        assert rel_err(got_rms, row / math.sqrt(ms + eps) * w) < 1e-6
        assert rel_err(got_l2, row / math.sqrt(ms * len(row) + eps)) < 1e-6
    assert ops.rmsnorm(x, None, eps).shape == x.shape


def test_gated_rmsnorm_matches_formula(rng):
    o, z, w = rand(rng, 3, 4, 16), rand(rng, 3, 4, 16, scale=4.0), rand(rng, 16)
    o64, z64 = o.astype(float), z.astype(float)
    want = o64 / np.sqrt((o64 ** 2).mean(-1, keepdims=True) + 1e-6) * w * z64 / (1 + np.exp(-z64))
    assert rel_err(ops.gated_rmsnorm(o, w, z, 1e-6), want) < 1e-6


# ---- RoPE vs a complex-number form (tolerance 1e-6) -----------------------------------------

def rope_complex(x: np.ndarray, pos: np.ndarray, rope_dims: int, theta: float, which: list[int]) -> np.ndarray:
    """Rotate pair i = (x_i, x_{i+half}) as the complex number x_i + j x_{i+half} by e^{j p angle}."""
    out = x.astype(np.float64)
    half = rope_dims // 2
    for t in range(x.shape[0]):
        for i in range(half):
            ang = pos[which[i], t] * theta ** (-2.0 * i / rope_dims)
            zc = (x[t, :, i] + 1j * x[t, :, i + half].astype(np.float64)) * np.exp(1j * ang)
            out[t, :, i], out[t, :, i + half] = zc.real, zc.imag
    return out


@pytest.mark.parametrize("sections, which", [
    # spec 3.1: with [11,11,10] pair i takes t, h, w for i % 3 == 0, 1, 2 (all 32 pairs)
    ((11, 11, 10, 0), [i % 3 for i in range(32)]),
    ((3, 3, 2, 0), [0, 1, 2, 0, 1, 2, 0, 1]),
    # shorter h/w sections: pairs past 3*s_h (h) or 3*s_w (w) fall back to t (transformers' interleaved M-RoPE)
    ((5, 2, 1, 0), [0, 1, 2, 0, 1, 0, 0, 0]),
])
def test_rope_multi_matches_complex_form(rng, sections, which):
    rope_dims = 2 * len(which)
    n, heads, head_dim = 9, 3, rope_dims + 6
    x = rand(rng, n, heads, head_dim)
    pos = rng.integers(0, 5000, (3, n))
    got = ops.rope_multi(x, pos, rope_dims, 1e7, sections)
    assert got.dtype == np.float32
    assert rel_err(got, rope_complex(x, pos, rope_dims, 1e7, which)) < 1e-6
    np.testing.assert_array_equal(got[..., rope_dims:], x[..., rope_dims:])


def test_rope_text_positions_broadcast(rng):
    x, p = rand(rng, 6, 2, 32), np.arange(10, 16)
    np.testing.assert_array_equal(ops.rope_multi(x, p, 8, 1e4, (2, 1, 1, 0)),
                                  ops.rope_multi(x, np.stack([p, p, p]), 8, 1e4, (2, 1, 1, 0)))


# ---- attention vs a naive loop (tolerance 1e-6) ---------------------------------------------

def test_gated_attention_matches_loop(rng):
    n_past, n, n_head, n_kv, hd = 5, 4, 6, 2, 8
    m = n_past + n
    q, gate = rand(rng, n, n_head, hd), rand(rng, n, n_head, hd, scale=3.0)
    k, v = rand(rng, m, n_kv, hd), rand(rng, m, n_kv, hd)
    want = np.zeros((n, n_head, hd))
    for i in range(n):
        for h in range(n_head):
            kv = h // (n_head // n_kv)
            s = [float(q[i, h].astype(float) @ k[j, kv]) / math.sqrt(hd) for j in range(n_past + i + 1)]
            e = np.exp(np.array(s) - max(s))
            o = (e / e.sum()) @ v[:n_past + i + 1, kv].astype(float)
            want[i, h] = o / (1 + np.exp(-gate[i, h].astype(float)))
    got = ops.gated_attention(q, gate, k, v)
    assert got.shape == (n, n_head * hd) and got.dtype == np.float32
    assert rel_err(got, want.reshape(n, -1)) < 1e-6


# ---- causal conv ------------------------------------------------------------------------------

def test_causal_conv1d_matches_loop_and_chains(rng):
    n, c, k = 11, 6, 4
    x, w, state = rand(rng, n, c), rand(rng, c, k), rand(rng, k - 1, c)
    hist = np.concatenate([state, x]).astype(float)
    want = np.array([[sum(w[ch, j] * hist[t + j, ch] for j in range(k)) for ch in range(c)] for t in range(n)])
    y, new_state = ops.causal_conv1d(x, w, state)
    assert rel_err(y, want) < 1e-6
    np.testing.assert_array_equal(new_state, x[-(k - 1):])
    y1, s1 = ops.causal_conv1d(x[:1], w, state)
    y2, s2 = ops.causal_conv1d(x[1:], w, s1)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(s2, new_state)


# ---- Gated DeltaNet ---------------------------------------------------------------------------

def gdn_inputs(rng: np.random.Generator, n: int, n_k: int = 2, n_v: int = 4, dk: int = 8, dv: int = 6,
               g_scale: float = 0.5):
    q = ops.l2norm(rand(rng, n, n_k, dk), 1e-6) / np.float32(math.sqrt(dk))
    k = ops.l2norm(rand(rng, n, n_k, dk), 1e-6)
    v = rand(rng, n, n_v, dv)
    g = -rng.uniform(0.01, 1.0, (n, n_v)).astype(np.float32) * g_scale
    beta = rng.uniform(0.05, 0.95, (n, n_v)).astype(np.float32)
    s0 = rand(rng, n_v, dk, dv)
    return q, k, v, g, beta, s0


def test_gdn_step_matches_matrix_form(rng):
    """S' = exp(g) (I - beta k k^T) S + beta k v^T, o = S'^T q, v-head h on q/k head h mod n_k."""
    q, k, v, g, beta, s0 = gdn_inputs(rng, 1)
    o, s = ops.gdn_step(q[0], k[0], v[0], g[0], beta[0], s0)
    n_k, dk = q.shape[1:]
    for h in range(v.shape[1]):
        kk, qq = k[0, h % n_k].astype(float), q[0, h % n_k].astype(float)
        b = float(beta[0, h])
        s_want = math.exp(g[0, h]) * (np.eye(dk) - b * np.outer(kk, kk)) @ s0[h] + b * np.outer(kk, v[0, h])
        assert rel_err(s[h], s_want) < 1e-6
        assert rel_err(o[h], s_want.T @ qq) < 1e-6


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130])
def test_gdn_chunked_matches_recurrent(rng, n):
    """Tolerance 1e-6 relative on outputs and final state, non-zero S0 (measured: at most 1 ulp of
    float32 apart; the float64 internals of the two forms agree to about 5e-16)."""
    q, k, v, g, beta, s0 = gdn_inputs(rng, n)
    o_rec, s_rec = ops.gdn_recurrent(q, k, v, g, beta, s0)
    o_chk, s_chk = ops.gdn_chunked(q, k, v, g, beta, s0)
    assert o_chk.shape == o_rec.shape and o_chk.dtype == s_chk.dtype == np.float32
    assert rel_err(o_chk, o_rec) < 1e-6
    assert rel_err(s_chk, s_rec) < 1e-6


def test_gdn_chunked_strong_decay_has_no_overflow(rng):
    """Cumulative decay of -1e3 inside a chunk: masking before exp keeps every value finite."""
    q, k, v, g, beta, s0 = gdn_inputs(rng, 70, g_scale=30.0)
    with np.errstate(over="raise", invalid="raise"):
        o_chk, s_chk = ops.gdn_chunked(q, k, v, g, beta, s0)
    o_rec, s_rec = ops.gdn_recurrent(q, k, v, g, beta, s0)
    assert rel_err(o_chk, o_rec) < 1e-6 and rel_err(s_chk, s_rec) < 1e-6


def test_gdn_chunked_split_equals_whole(rng):
    """Prefill in pieces (state carried) == one pass: the initial state is used exactly once."""
    q, k, v, g, beta, s0 = gdn_inputs(rng, 100)
    o_all, s_all = ops.gdn_chunked(q, k, v, g, beta, s0)
    o1, s1 = ops.gdn_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], s0)
    o2, s2 = ops.gdn_chunked(q[37:], k[37:], v[37:], g[37:], beta[37:], s1)
    assert rel_err(np.concatenate([o1, o2]), o_all) < 1e-6 and rel_err(s2, s_all) < 1e-6


def test_gdn_does_not_modify_input_state(rng):
    q, k, v, g, beta, s0 = gdn_inputs(rng, 5)
    keep = s0.copy()
    ops.gdn_chunked(q, k, v, g, beta, s0)
    ops.gdn_recurrent(q, k, v, g, beta, s0)
    np.testing.assert_array_equal(s0, keep)


# ---- routing and FFNs (tolerance 1e-6) --------------------------------------------------------

def test_topk_route_equals_softmax_over_selected(rng):
    logits = rand(rng, 20, 16, scale=3.0)
    idx, w = ops.topk_route(logits, 4)
    for row, sel, ws in zip(logits.astype(float), idx, w):
        assert list(sel) == sorted(range(16), key=lambda e: -row[e])[:4]
        e = np.exp(row[sel] - row[sel].max())
        assert rel_err(ws, e / e.sum()) < 1e-6


def test_swiglu_and_shared_expert_match_loops(rng):
    n, d, ff = 3, 10, 7
    x, wg, wu, wd, wsh = rand(rng, n, d), rand(rng, ff, d), rand(rng, ff, d), rand(rng, d, ff), rand(rng, d)
    for t in range(n):
        xt = x[t].astype(float)
        a = [float(wg[i] @ xt) for i in range(ff)]
        hidden = np.array([a[i] / (1 + math.exp(-a[i])) * float(wu[i] @ xt) for i in range(ff)])
        want = np.array([float(wd[j] @ hidden) for j in range(d)])
        assert rel_err(ops.swiglu(x[t:t + 1], wg, wu, wd)[0], want) < 1e-6
        gate = 1 / (1 + math.exp(-float(wsh @ xt)))
        assert rel_err(ops.shared_expert(x[t:t + 1], wg, wu, wd, wsh)[0], want * gate) < 1e-6


def test_linear_matches_loop(rng):
    x, w = rand(rng, 4, 9), rand(rng, 5, 9)
    want = np.array([[math.fsum(float(x[t, i]) * float(w[o, i]) for i in range(9)) for o in range(5)]
                     for t in range(4)])
    got = ops.linear(x, w)
    assert got.dtype == np.float32 and rel_err(got, want) < 1e-6
    # float32 BLAS: a one-row product may sum in another order than the batched one
    assert rel_err(ops.linear(x[2:3], w), got[2:3]) < 1e-6
