"""The native float32 GEMM with packed weights (engine.kernels.sgemm, native/cpu/vit/sgemm_avx512.c) against a float64
numpy reference on fresh random inputs (no zeros) and odd shapes, its epilogue activations, and the invariances the
vision towers rely on: the same bits at every thread count and for any subset of rows."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.kernels import cpu, sgemm
from engine.ops import vision_reference as ops

pytestmark = pytest.mark.skipif(not sgemm.available(), reason="needs the native extension on an AVX-512 CPU")

U = 2.0 ** -24
"""Unit roundoff of float32."""

SHAPES = [(1, 1, 1), (13, 37, 33), (97, 300, 65), (12, 256, 32), (200, 1031, 95), (25, 513, 161)]
"""(m, k, n): none a multiple of the 12 x 32 micro-tile or of the 96-row task or the 256-wide k block, except the
exact-tile case (12, 256, 32); k = 300, 513 and 1031 span two to five k blocks."""


def _data(rng, m, k, n):
    """x, w, b, add with entries in +-[0.5, 1.5] (no zeros, both signs)."""
    def draw(*shape):
        return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    return draw(m, k), draw(n, k), draw(n), draw(m, n)


def _bound(x, w, b, add, k):
    """Forward error bound of a float32 FMA chain of length k plus the bias and add roundings: gamma_{k+2}
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1) times the sum of the magnitudes
    that enter the result."""
    gamma = (k + 2) * U / (1 - (k + 2) * U)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T + np.abs(b)
    return gamma * (mag + (0 if add is None else np.abs(add)))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_matches_float64(m, k, n):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x, w, b, add = _data(rng, m, k, n)
    pw = sgemm.PackedWeight(w, b)
    for extra in (None, add):
        y = pw(x, add=extra)
        ref = sgemm.linear_np(x, w, b, add=extra)
        assert (np.abs(y - ref) <= _bound(x, w, b, extra, k)).all()


def test_strided_rows_and_in_place_residual():
    """x and out may be column slices of wider arrays; out may be add (h += x @ w.T + b)."""
    rng = np.random.default_rng(11)
    x_wide, w, b, _ = _data(rng, 41, 150, 70)
    h = rng.standard_normal((41, 90)).astype(np.float32) + 3
    x, res = x_wide[:, 20:120], h[:, 10:80]
    before, h0 = res.astype(np.float64), h.copy()
    pw = sgemm.PackedWeight(w[:, 20:120], b)
    pw(x, out=res, add=res)
    ref = sgemm.linear_np(x, w[:, 20:120], b, add=before)
    assert (np.abs(res - ref) <= _bound(x, w[:, 20:120], b, before, 100)).all()
    np.testing.assert_array_equal(h[:, :10], h0[:, :10])
    np.testing.assert_array_equal(h[:, 80:], h0[:, 80:])


def test_one_row_of_any_row_stride():
    """A single row's stride is never used: a broadcast row (stride 0) as x, add or out gives the plain row's bits."""
    rng = np.random.default_rng(19)
    x, w, b, add = _data(rng, 1, 40, 24)
    pw = sgemm.PackedWeight(w, b)
    ref = pw(x, add=add)
    out = np.lib.stride_tricks.as_strided(np.zeros(24, np.float32), (1, 24), (0, 4))
    y = pw(np.broadcast_to(x[0], (1, 40)), out=out, add=np.broadcast_to(add[0], (1, 24)))
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("shape", [1, 7, (3, 5), (13, 1152), (2, 3, 4)])
def test_empty_aligned_starts_on_a_cache_line(shape):
    a = sgemm.empty_aligned(shape)
    assert a.shape == np.empty(shape).shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % sgemm.ALIGN == 0


def test_packed_panels_are_aligned_and_placement_keeps_the_bits():
    """PackedWeight's panels start on a cache line; the same panels 16 bytes past one (numpy's usual placement, what
    the kernel read before) give the same bits, the placement changing only which loads span two lines."""
    rng = np.random.default_rng(23)
    x, w, b, add = _data(rng, 50, 300, 70)
    pw = sgemm.PackedWeight(w, b)
    assert pw.packed.ctypes.data % sgemm.ALIGN == 0
    ref = pw(x, add=add, act="gelu_tanh")
    assert ref.ctypes.data % sgemm.ALIGN == 0
    moved = sgemm.empty_aligned(pw.packed.size + 4)[4:]
    moved[:] = pw.packed
    pw.packed = moved
    np.testing.assert_array_equal(pw(x, add=add, act="gelu_tanh"), ref)


KEYS_EXHAUSTED = """
import ctypes
import numpy as np
from engine.errors import EngineError
from engine.kernels import sgemm
pw = sgemm.PackedWeight(np.ones((8, 16), np.float32))
libc, key = ctypes.CDLL(None), ctypes.c_uint()
while libc.pthread_key_create(ctypes.byref(key), None) == 0:
    pass
try:
    pw(np.ones((4, 16), np.float32))
except EngineError as err:
    print(err)
"""


def test_no_thread_key_is_an_error_not_a_crash():
    """With the process's pthread keys used up before the first GEMM, the scratch key cannot be created: the call
    fails with DD_ERR_NOMEM (a fresh process, as the key is made once per process)."""
    run = subprocess.run([sys.executable, "-c", KEYS_EXHAUSTED], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "sgemm failed in the native CPU kernels: out of memory" in run.stdout


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu_erf"])
def test_activation_matches_float64(act):
    """The epilogue's exp-based GELUs against float64. Bound: the exp argument a (-2u for the tanh form, -z^2 + P(t)
    for erfc) carries a few roundings of its own size, which exp turns into a relative error of about |a| u; the
    rest is a few ulp: |err| <= 16 u (1 + |a|) |gelu(x)|, with |a| <= 2 |x| (1 + 0.045 x^2) or x^2 / 2 + 2, plus
    1e-37 absolute where the result is below float32's normal range. Measured: at most 48 ulp (tanh form) and 228
    ulp (erf form, at x < -6, where the result is below 1e-9)."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(20000) * s for s in (0.1, 1.0, 4.0)] + [np.linspace(-12, 12, 4001)])
    x = x.astype(np.float32)
    y = sgemm.activation(x, act).astype(np.float64)
    x64 = x.astype(np.float64)
    ref = sgemm.linear_np(x64[:, None], np.ones((1, 1)), act=act)[:, 0]
    arg = 2 * np.abs(x64) * (1 + 0.045 * x64 ** 2) if act == "gelu_tanh" else x64 ** 2 / 2 + 2
    assert (np.abs(y - ref) <= 16 * U * (1 + arg) * np.abs(ref) + 1e-37).all()


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu_erf"])
def test_fused_activation_is_the_activation_of_the_product(act):
    """act is applied to the rounded sum + bias: bit-equal to the plain GEMM followed by the activation alone."""
    rng = np.random.default_rng(9)
    x, w, b, add = _data(rng, 30, 77, 45)
    pw = sgemm.PackedWeight(w, b)
    np.testing.assert_array_equal(pw(x, act=act), sgemm.activation(pw(x), act))
    np.testing.assert_array_equal(pw(x, act=act, add=add), sgemm.activation(pw(x), act) + add)


def test_same_bits_at_every_thread_count_and_row_subset():
    """Each element is one FMA chain over k in order: 1, 2 and 3 threads (different task shapes) give the same bits,
    and so do any rows computed alone (a stack of pieces = the pieces one by one)."""
    rng = np.random.default_rng(13)
    x, w, b, add = _data(rng, 333, 600, 1100)
    pw = sgemm.PackedWeight(w, b)
    prev = cpu.threads()
    try:
        cpu.set_threads(3)
        ref = pw(x, act="gelu_tanh", add=add, threads=1)
        for t in (2, 3):
            np.testing.assert_array_equal(pw(x, act="gelu_tanh", add=add, threads=t), ref)
    finally:
        cpu.set_threads(prev)
    for rows in (slice(0, 1), slice(5, 18), slice(100, 333)):
        np.testing.assert_array_equal(pw(x[rows], act="gelu_tanh", add=add[rows], threads=2), ref[rows])


def test_stacked_weights_are_side_by_side():
    rng = np.random.default_rng(17)
    x, w, b, _ = _data(rng, 20, 64, 90)
    both = sgemm.PackedWeight.stacked([w[:40], w[40:]], [b[:40], b[40:]])
    np.testing.assert_array_equal(both(x), np.concatenate([sgemm.PackedWeight(w[:40], b[:40])(x),
                                                           sgemm.PackedWeight(w[40:], b[40:])(x)], axis=1))


def _bf16(w):
    """w rounded to BF16 (truncated: any BF16 value will do): the bits as sgemm.BF16 and the value as float32."""
    bits = (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits.view(sgemm.BF16), (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("m,k,n", [(13, 37, 33), (25, 513, 161), (7, 1, 95)])
def test_packs_f16_and_bf16_as_stored(m, k, n):
    """A float16 or BF16 weight packs to the same panels as its exact float32 value (the conversion in C is
    exact), so the product has the same bits; and it is within the FMA chain's bound of the float64 product."""
    rng = np.random.default_rng(m + 3 * k + 5 * n)
    x, w, b, _ = _data(rng, m, k, n)
    w16 = w.astype(np.float16)
    wb, wb32 = _bf16(w)
    for stored, exact in ((w16, w16.astype(np.float32)), (wb, wb32)):
        pw = sgemm.PackedWeight(stored, b)
        np.testing.assert_array_equal(pw.packed, sgemm.PackedWeight(exact, b).packed)
        y, ref = pw(x), sgemm.linear_np(x, exact, b)
        assert (np.abs(y - ref) <= _bound(x, exact, b, None, k)).all()


def test_stacked_parts_of_mixed_types_and_strides():
    """Parts that end inside a panel (40 + 17 + 33 rows), of different dtypes, one a column slice of a wider
    array, pack as their float32 concatenation."""
    rng = np.random.default_rng(23)
    x, w, b, _ = _data(rng, 9, 64, 90)
    wide = np.zeros((17, 100), np.float16)
    wide[:, 10:74] = w[40:57]
    parts = [w[:40], wide[:, 10:74], _bf16(w[57:])[0]]
    exact = np.concatenate([w[:40], w[40:57].astype(np.float16).astype(np.float32), _bf16(w[57:])[1]])
    both = sgemm.PackedWeight.stacked(parts, [b[:40], b[40:57], b[57:]])
    np.testing.assert_array_equal(both.packed, sgemm.PackedWeight(exact, b).packed)
    np.testing.assert_array_equal(both(x), sgemm.PackedWeight(exact, b)(x))


def _panels_np(w):
    """deltadesk_cpu.h's packed layout from its formula: packed[(j // NR) * k * NR + kk * NR + j % NR] = w[j, kk],
    columns past n zero."""
    from engine import _native_cpu
    n, k = w.shape
    nr = _native_cpu.lib.DD_SGEMM_NR
    padded = np.zeros((-(-n // nr) * nr, k), np.float32)
    padded[:n] = w
    return padded.reshape(-1, nr, k).transpose(0, 2, 1).ravel()


def test_packing_is_the_layout_at_every_thread_count():
    """The panels are packed on the pool's threads: parts that start and end inside a panel (row0 = 40, 57), in
    float16, give the layout's formula and the same buffer at 1, 2 and 3 threads."""
    rng = np.random.default_rng(29)
    w = (rng.uniform(0.5, 1.5, (150, 77)) * rng.choice([-1.0, 1.0], (150, 77))).astype(np.float16)
    b = np.ones(150, np.float32)
    prev = cpu.threads()
    try:
        for t in (1, 2, 3):
            cpu.set_threads(t)
            stacked = sgemm.PackedWeight.stacked([w[:40], w[40:57], w[57:]], [b[:40], b[40:57], b[57:]])
            np.testing.assert_array_equal(stacked.packed, _panels_np(w.astype(np.float32)))
            np.testing.assert_array_equal(sgemm.PackedWeight(w, b).packed, _panels_np(w.astype(np.float32)))
    finally:
        cpu.set_threads(prev)


def _qkv(rng, s, n_head, hd):
    shape = (s, 3 * n_head * hd)
    return (rng.uniform(0.2, 1.2, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


@pytest.mark.parametrize("sizes,n_head,hd", [([13], 2, 8), ([300, 1, 37], 3, 72), ([600], 1, 40), ([4] * 30, 4, 72)])
def test_vit_attention_matches_float64(sizes, n_head, hd):
    """Pieces of odd lengths (one key block and several of 256 keys; a 1-row piece; 4-row pieces, the window-attention
    merger's 2x2 windows) and head widths that are not a multiple of 32 (72 and 40: a last value panel of 8
    columns, computed by the half-width tiles). Bound: a score q.k / sqrt(hd) is an FMA chain of hd terms, off by at
    most e_s = gamma_{hd+1} |q|.|k| / sqrt(hd); exp(s - max) then carries a relative error of about 2 e_s + 8 u, the sum
    and the division add (S + 2) u, and the output's chain over the S keys gamma_S: |err| <= (4 e_s + (2 S + 16) u)
    sum_j p_j |v_j| with e_s from the row's largest |q|.|k|."""
    rng = np.random.default_rng(len(sizes) * 100 + hd)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    qkv = _qkv(rng, int(starts[-1]), n_head, hd)
    out = sgemm.vit_attention(qkv, starts, n_head)
    assert out.ctypes.data % sgemm.ALIGN == 0
    ref = sgemm.vit_attention_np(qkv, starts, n_head)
    d = n_head * hd
    for p0, p1 in zip(starts[:-1], starts[1:], strict=True):
        s = p1 - p0
        x = np.abs(qkv[p0:p1].astype(np.float64))
        for h in range(n_head):
            c = slice(h * hd, (h + 1) * hd)
            qk = x[:, c] @ x[:, d + h * hd:d + (h + 1) * hd].T / np.sqrt(hd)
            e_s = (hd + 1) * U * qk.max(axis=1, keepdims=True)
            bound = (4 * e_s + (2 * s + 16) * U) * x[:, 2 * d + h * hd:2 * d + (h + 1) * hd].max(axis=0)
            assert (np.abs(out[p0:p1, c] - ref[p0:p1, c]) <= bound).all(), (p0, h)


def test_vit_attention_same_bits_at_every_thread_count_and_alone():
    rng = np.random.default_rng(21)
    starts = np.array([0, 40, 340, 347])
    qkv = _qkv(rng, 347, 4, 24)
    prev = cpu.threads()
    try:
        cpu.set_threads(3)
        ref = sgemm.vit_attention(qkv, starts, 4, threads=1)
        for t in (2, 3):
            np.testing.assert_array_equal(sgemm.vit_attention(qkv, starts, 4, threads=t), ref)
    finally:
        cpu.set_threads(prev)
    for p0, p1 in zip(starts[:-1], starts[1:], strict=True):
        np.testing.assert_array_equal(sgemm.vit_attention(qkv[p0:p1], [0, p1 - p0], 4), ref[p0:p1])


def test_half_width_tiles_give_the_full_tiles_bits():
    """A last panel of at most 16 valid columns runs the half-width micro-kernel (only those columns computed); its
    sums are the same FMA chains, so they equal the full-width kernel's bits for the same columns of a wider weight."""
    rng = np.random.default_rng(31)
    x, w, b, add = _data(rng, 29, 600, 64)
    for n in (33, 40, 48):
        narrow = sgemm.PackedWeight(w[:n], b[:n])(x, act="gelu_tanh", add=add[:, :n])
        wide = sgemm.PackedWeight(w, b)(x, act="gelu_tanh", add=add)
        np.testing.assert_array_equal(narrow, wide[:, :n])


def _ln_bound(x, w, b):
    """First-order forward error bound of dd_vit_layer_norm against float64, per element (module U): each sum runs
    n = ceil(d / 16) + 4 additions deep (16 lanes, then a 4-level tree) plus the division, so mean is off by
    dm <= gamma_{n+1} mean|x|; c = x - mean by dc <= dm + u|c|; var = mean(c^2) by dv <= gamma_{n+2} var + 2 dm mean|c|;
    rstd = 1 / sqrt(var + eps) by about (dv / (2 (var + eps)) + 2u) rstd; y = (c rstd) w + b adds three roundings. Twice
    that, for the second-order terms."""
    x = x.astype(np.float64)
    d = x.shape[1]
    n = -(-d // 16) + 5
    gamma = n * U / (1 - n * U)
    mean = x.mean(axis=1, keepdims=True)
    c = x - mean
    var = (c * c).mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt(var + 1e-6)
    dm = gamma * np.abs(x).mean(axis=1, keepdims=True)
    dv = (gamma + 2 * U) * var + 2 * dm * np.abs(c).mean(axis=1, keepdims=True)
    rel_rstd = dv / (2 * (var + 1e-6)) + 2 * U
    y = c * rstd * w + b
    err = np.abs(w) * rstd * (dm + U * np.abs(c) + np.abs(c) * rel_rstd + 2 * U * np.abs(c)) + U * np.abs(y)
    return 2 * err


@pytest.mark.parametrize("m,d", [(1, 1), (7, 15), (33, 1152), (20, 4608), (5, 1000)])
def test_layer_norm_matches_float64(m, d):
    """Rows with an offset (mean far from 0, where a one-pass variance would cancel) and both signs, widths with and
    without a tail shorter than 16, against float64; also within rounding of the numpy tower's LayerNorm."""
    rng = np.random.default_rng(m * 7 + d)
    x = (rng.uniform(0.5, 1.5, (m, d)) * rng.choice([-1.0, 1.0], (m, d))
         + rng.uniform(-3, 3, (m, 1))).astype(np.float32)
    w = (rng.uniform(0.5, 1.5, d) * rng.choice([-1.0, 1.0], d)).astype(np.float32)
    b = rng.uniform(-1, 1, d).astype(np.float32)
    out = sgemm.layer_norm(x, w, b, 1e-6)
    assert out.ctypes.data % sgemm.ALIGN == 0
    xd = x.astype(np.float64)
    mean = xd.mean(axis=1, keepdims=True)
    ref = (xd - mean) / np.sqrt(((xd - mean) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w + b
    assert (np.abs(out - ref) <= _ln_bound(x, w, b)).all()
    np.testing.assert_allclose(out, ops.layer_norm(x, w, b, 1e-6), rtol=0, atol=float(_ln_bound(x, w, b).max()) * 2)


def test_layer_norm_same_bits_at_every_thread_count_row_subset_and_in_place():
    rng = np.random.default_rng(41)
    x = (rng.uniform(0.5, 1.5, (203, 1157)) * rng.choice([-1.0, 1.0], (203, 1157))).astype(np.float32)
    w, b = (rng.uniform(0.5, 1.5, 1157).astype(np.float32) for _ in range(2))
    prev = cpu.threads()
    try:
        cpu.set_threads(3)
        ref = sgemm.layer_norm(x, w, b, 1e-6, threads=1)
        for t in (2, 3):
            np.testing.assert_array_equal(sgemm.layer_norm(x, w, b, 1e-6, threads=t), ref)
    finally:
        cpu.set_threads(prev)
    np.testing.assert_array_equal(sgemm.layer_norm(x[50:91], w, b, 1e-6), ref[50:91])
    wide = np.zeros((203, 1200), dtype=np.float32)
    np.testing.assert_array_equal(sgemm.layer_norm(x, w, b, 1e-6, out=wide[:, 3:1160]), ref)
    y = x.copy()
    assert sgemm.layer_norm(y, w, b, 1e-6, out=y) is y
    np.testing.assert_array_equal(y, ref)


def test_unavailable_below_avx512():
    prev = cpu.isa()
    try:
        cpu.set_isa("avx2")
        assert not sgemm.available()
    finally:
        cpu.set_isa(prev)


@pytest.mark.parametrize("ftype", ["F32", "F16", "Q8_0"])
def test_tower_packs_from_the_files_map(tmp_path, ftype):
    """MiniCPM-V's projections pack straight from the memory map (F32 / F16 views; Q8_0 dequantized first) to the
    same panels as their float32 values, and the map's matrices are never loaded as float32 at load."""
    from engine.arch.minicpmv import mmproj as mp
    from engine.testing import minicpmv as mp_test
    from engine.arch.minicpmv.packing import pack_weights
    mm = mp.load_mmproj(mp_test.synth_mmproj(tmp_path / "m.gguf", "tiny", seed=2, ftype=ftype))
    w = mm.weights
    assert "v.blk.0.attn_q.weight" not in w.loaded and "v.blk.0.ln1.weight" in w.loaded
    stored = w.stored("v.blk.0.attn_q.weight")
    assert (None if stored is None else stored.dtype) == {"F32": np.float32, "F16": np.float16, "Q8_0": None}[ftype]
    packed = pack_weights(w, mm.hparams, merger=True)
    hp = mm.hparams
    np.testing.assert_array_equal(packed["v.patch_embd"].packed,
                                  sgemm.PackedWeight(w["v.patch_embd.weight"].reshape(hp.n_embd, -1)).packed)
    np.testing.assert_array_equal(packed["v.blk.1.ffn_down"].packed,
                                  sgemm.PackedWeight(w["v.blk.1.ffn_down.weight"]).packed)
    qkv = [w[f"v.vit_merger.attn_{x}.weight"] for x in "qkv"]
    np.testing.assert_array_equal(packed["v.vit_merger.attn_qkv"].packed,
                                  sgemm.PackedWeight(np.concatenate(qkv)).packed)


@pytest.mark.parametrize("mode", ["16x", "4x"])
def test_tower_packs_the_merger_only_in_16x_mode(tmp_path, mode):
    """4x mode never runs the window-attention merger, so its projections are not packed."""
    from engine.arch.minicpmv import mmproj as mp
    from engine.testing import minicpmv as mp_test
    from engine.arch.minicpmv.tower import MiniCPMVTower
    tower = MiniCPMVTower(mp.load_mmproj(mp_test.synth_mmproj(tmp_path / "m.gguf", "tiny", seed=3)), threads=1,
                          mode=mode)
    merger = sorted(name for name in tower._packed if name.startswith("v.vit_merger."))
    assert merger == (["v.vit_merger.attn_out", "v.vit_merger.attn_qkv", "v.vit_merger.ds_ffn_down",
                       "v.vit_merger.ds_ffn_up"] if mode == "16x" else [])
    assert "v.blk.0.attn_qkv" in tower._packed and "mm.down" in tower._packed
