"""Plain numpy ops of the Qwen3.5/3.6 vision tower: the executable spec its fast paths are tested on.

Every function is vectorised, takes and returns float32 (float64 only inside, where noted), and is
written to be read next to ``docs/spec/qwen3vl.md`` (section numbers below). Sources: transformers 5.24
``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (Qwen3_5MoeVisionModel and its parts) and
``vision_utils.py`` (``get_vision_interpolation_indices_and_weights``, ``get_vision_position_ids``);
llama.cpp ``tools/mtmd/models/qwen3vl.cpp``; W. H. Press et al., *Numerical Recipes* (3rd ed.),
section 6.2.2 for the erfc approximation.
"""

from __future__ import annotations

import numpy as np

ATTN_CHUNK_BYTES = 2 << 20
"""Upper bound on the float32 score block one attention step materialises (rows x keys x 4 bytes):
small enough to stay in a core's L2 cache through the max / subtract / exp passes, large enough that
the two GEMMs get 170+ query rows at 3072 keys (1 MB blocks cost 14% more there)."""

ROW_CHUNK_BYTES = 1 << 20
"""Elementwise ops (LayerNorm, GELU, RoPE) walk their input in row blocks of about this many bytes, so
every pass after the first reads the block from cache rather than from memory."""


def _row_blocks(n_rows: int, row_bytes: int, chunk_bytes: int = ROW_CHUNK_BYTES):
    """Slices covering ``range(n_rows)`` in blocks of ``max(1, chunk_bytes // row_bytes)`` rows."""
    step = max(1, chunk_bytes // max(1, row_bytes))
    for i in range(0, n_rows, step):
        yield slice(i, min(i + step, n_rows))


def _float32_rows(x: np.ndarray, out: np.ndarray | None):
    """``(out, x2, o2, scratch, blocks)`` for a row-wise op over the last axis of float32 ``x``: ``out``
    (given or new), 2-D views of ``x`` and ``out``, one row block of float32 scratch, and the row-block
    slices of :func:`_row_blocks`."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    out = np.empty(x.shape, dtype=np.float32) if out is None else out
    x2, o2 = x.reshape(-1, d), out.reshape(-1, d)
    scratch = np.empty((min(len(x2), max(1, ROW_CHUNK_BYTES // (4 * d))), d), dtype=np.float32)
    return out, x2, o2, scratch, _row_blocks(len(x2), 4 * d)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * w + b`` (biased variance).

    Args:
        x: (..., d) float32. w, b: (d,) float32. eps: 1e-6 for every vision norm (docs/spec/qwen3vl.md, conventions).
        out: optional (..., d) float32 destination that does not overlap ``x``; 2-D with any strides,
            or C-contiguous.

    Returns:
        (..., d) float32: ``out``, or a new array.
    """
    out, x2, o2, sq, blocks = _float32_rows(x, out)
    for sl in blocks:
        xb, ob, tb = x2[sl], o2[sl], sq[:sl.stop - sl.start]
        np.subtract(xb, xb.mean(axis=1, keepdims=True), out=ob)
        np.multiply(ob, ob, out=tb)
        rstd = tb.mean(axis=1, keepdims=True)
        rstd += np.float32(eps)
        np.sqrt(rstd, out=rstd)
        np.divide(1.0, rstd, out=rstd)
        ob *= rstd
        ob *= w
        ob += b
    return out


def gelu_tanh(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """GELU, tanh form (HF ``gelu_pytorch_tanh``): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Used in the ViT blocks' MLP (section 1). Evaluated as ``x * (0.5 + 0.5 tanh(x (c0 + c1 x^2)))`` in row
    blocks (float32 rounding differs from HF's order by about 1e-7 relative).

    Args:
        x: (..., d) float32. out: optional float32 destination of the same shape, may be ``x``; 2-D with
            any strides (e.g. a column slice of a wider array), or C-contiguous.

    Returns:
        (..., d) float32: ``out``, or a new array.
    """
    out, x2, o2, tmp, blocks = _float32_rows(x, out)
    c0 = np.float32(np.sqrt(2.0 / np.pi))
    c1 = np.float32(np.sqrt(2.0 / np.pi) * 0.044715)
    half = np.float32(0.5)
    for sl in blocks:
        xb, tb = x2[sl], tmp[:sl.stop - sl.start]
        np.multiply(xb, xb, out=tb)
        tb *= c1
        tb += c0
        tb *= xb
        np.tanh(tb, out=tb)
        tb *= half
        tb += half
        np.multiply(tb, xb, out=o2[sl])
    return out


def erfc(x: np.ndarray) -> np.ndarray:
    """Complementary error function, float64, relative error below 1.2e-7 everywhere.

    Numerical Recipes' Chebyshev fit ``erfc(z) = t exp(-z^2 + P(t))``, ``t = 1 / (1 + z/2)`` for z >= 0,
    and ``erfc(-z) = 2 - erfc(z)``. numpy has no erf and the engine may not import scipy.
    """
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    coef = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
            0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)
    poly = np.full_like(t, coef[-1])
    for c in coef[-2::-1]:
        poly *= t
        poly += c
    r = t * np.exp(-z * z + poly)
    return np.where(x >= 0, r, 2.0 - r)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU, exact form (HF ``nn.GELU()``): ``0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2)``.

    Used in the merger (section 5.5; llama.cpp uses the tanh form there, a known divergence).
    x: any shape float32; computed in float64, returned as float32.
    """
    x64 = np.asarray(x, dtype=np.float64)
    return (0.5 * x64 * erfc(-x64 * np.sqrt(0.5))).astype(np.float32)


def merge_window_coords(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch (row, col) of each sequence index in merge-window order (section 2.5).

    Sequence index ``((bh * (gw/m) + bw) * m + dy) * m + dx`` holds the patch at
    ``(bh*m + dy, bw*m + dx)``, so every run of ``m*m`` tokens is one merge window.

    Args:
        gh, gw: patch grid (multiples of ``merge``).

    Returns:
        rows, cols: (gh*gw,) int64 each.
    """
    bh, bw, dy, dx = np.meshgrid(np.arange(gh // merge), np.arange(gw // merge),
                                 np.arange(merge), np.arange(merge), indexing="ij")
    return (bh * merge + dy).reshape(-1), (bw * merge + dx).reshape(-1)


def _align_corners_taps(n: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps resampling ``side`` points to ``n`` with align_corners=True (section 5.2).

    Returns:
        lo, hi: (n,) int64 source indices (``hi = min(lo + 1, side - 1)``); frac: (n,) float32 weight of ``hi``.
    """
    src = np.arange(n, dtype=np.float64) * (side - 1) / max(n - 1, 1)
    lo = np.floor(src).astype(np.int64)
    return lo, np.minimum(lo + 1, side - 1), (src - lo).astype(np.float32)


def pos_embed_at(table: np.ndarray, side: int, gh: int, gw: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Learned position table resampled bilinearly, align_corners=True, to a (gh, gw) patch grid, at
    the given patch coordinates (section 5.2; HF ``get_vision_interpolation_indices_and_weights``).

    Each output row is the float32 sum of 4 weighted table rows, as HF computes it.

    Args:
        table: (side*side, d) float32, row ``r*side + c`` for grid point (r, c).
        gh, gw: target grid in patches.
        rows, cols: (S,) int patch coordinates (e.g. :func:`merge_window_coords`).

    Returns:
        (S, d) float32.
    """
    table = np.asarray(table, dtype=np.float32)
    r0, r1, a = _align_corners_taps(gh, side)
    c0, c1, b = _align_corners_taps(gw, side)
    r0, r1, a, c0, c1, b = r0[rows], r1[rows], a[rows], c0[cols], c1[cols], b[cols]
    one = np.float32(1.0)
    out = table[r0 * side + c0] * ((one - a) * (one - b))[:, None]
    out += table[r0 * side + c1] * ((one - a) * b)[:, None]
    out += table[r1 * side + c0] * (a * (one - b))[:, None]
    out += table[r1 * side + c1] * (a * b)[:, None]
    return out


def interpolate_pos_table(table: np.ndarray, side: int, gh: int, gw: int) -> np.ndarray:
    """:func:`pos_embed_at` on the whole grid in raster order: (gh, gw, d) float32."""
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    return pos_embed_at(table, side, gh, gw, rows, cols).reshape(gh, gw, -1)


def rope_2d_cos_sin(rows: np.ndarray, cols: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables of the 2-D vision RoPE (section 5.3).

    ``inv_j = theta^(-2j / (head_dim/2))`` for j < head_dim/4; angles ``[row*inv, col*inv]``: one angle
    per rotated pair (k, k + head_dim/2) of the half-split rotation.

    Args:
        rows, cols: (S,) int patch coordinates. head_dim: multiple of 4.

    Returns:
        cos, sin: (S, head_dim/2) float32.
    """
    half = head_dim // 2
    inv = 1.0 / theta ** (np.arange(0, half, 2, dtype=np.float64) / half)
    ang = np.concatenate([np.outer(rows, inv), np.outer(cols, inv)], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Half-split (NeoX, rotate_half) rotation: ``x*cos + rotate_half(x)*sin``, rotate_half(a) = [-a2, a1].

    With h = d/2: ``out[:h] = x[:h] cos - x[h:] sin`` and ``out[h:] = x[h:] cos + x[:h] sin``, in row blocks.

    Args:
        x: (S, H, d) float32, any strides (e.g. the q slice of the fused qkv output).
        cos, sin: (S, d/2) float32 (:func:`rope_2d_cos_sin`, shared by all heads).
        out: optional (S, H, d) float32 destination that does not overlap ``x``.

    Returns:
        (S, H, d) float32: ``out``, or a new C-contiguous array.
    """
    s, n_head, d = x.shape
    h = d // 2
    out = np.empty((s, n_head, d), dtype=np.float32) if out is None else out
    tmp = np.empty((min(s, max(1, ROW_CHUNK_BYTES // (4 * n_head * d))), n_head, h), dtype=np.float32)
    for sl in _row_blocks(s, 4 * n_head * d):
        x1, x2, tb = x[sl, :, :h], x[sl, :, h:], tmp[:sl.stop - sl.start]
        c, sn = cos[sl, None, :], sin[sl, None, :]
        o1, o2 = out[sl, :, :h], out[sl, :, h:]
        np.multiply(x1, c, out=o1)
        np.multiply(x2, sn, out=tb)
        o1 -= tb
        np.multiply(x2, c, out=o2)
        np.multiply(x1, sn, out=tb)
        o2 += tb
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk_bytes: int = ATTN_CHUNK_BYTES,
              out: np.ndarray | None = None) -> np.ndarray:
    """Non-causal multi-head attention over one image: ``softmax(q k^T / sqrt(d)) v`` per head.

    One head at a time, query rows in blocks whose score matrix takes at most ``chunk_bytes`` (so it
    stays in cache). Each block: scores by GEMM, minus the row max, exp in place, then one GEMM with
    ``[v | 1]``, whose last column is the softmax denominator that divides the (rows, d) output.

    Args:
        q, k, v: (S, H, d) float32, any strides (e.g. slices of the fused qkv output).
        out: optional (S, H*d) float32 destination, any strides (e.g. one head's columns of a wider array).

    Returns:
        (S, H*d) float32, heads concatenated in order: ``out``, or a new array.
    """
    s, n_head, d = q.shape
    out = np.empty((s, n_head * d), dtype=np.float32) if out is None else out
    step = min(s, max(1, chunk_bytes // (4 * s)))
    scale = np.float32(1.0 / np.sqrt(d))
    scores = np.empty((step, s), dtype=np.float32)
    q_blk = np.empty((step, d), dtype=np.float32)
    o_blk = np.empty((step, d + 1), dtype=np.float32)
    v_one = np.empty((s, d + 1), dtype=np.float32)
    v_one[:, d] = 1.0
    for h in range(n_head):
        k_t = k[:, h].T
        v_one[:, :d] = v[:, h]
        for i in range(0, s, step):
            r = min(step, s - i)
            sc, qb, ob = scores[:r], q_blk[:r], o_blk[:r]
            np.multiply(q[i:i + r, h], scale, out=qb)
            np.matmul(qb, k_t, out=sc)
            sc -= sc.max(axis=1, keepdims=True)
            np.exp(sc, out=sc)
            np.matmul(sc, v_one, out=ob)
            np.divide(ob[:, :d], ob[:, d:], out=out[i:i + r, h * d:(h + 1) * d])
    return out


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T + b``: one float32 GEMM (``w.T`` is a transposed view, no copy), then the bias in place.

    Args:
        x: (n, in) float32. w: (out, in) float32 (GGUF math shape). b: (out,) float32 or None.
        out: optional (n, out) float32 destination that does not overlap ``x``, any strides (numpy goes
            through a temporary when BLAS cannot write it directly).

    Returns:
        (n, out) float32: ``out``, or a new array.
    """
    y = np.matmul(x, w.T, out=out)
    if b is not None:
        y += b
    return y
