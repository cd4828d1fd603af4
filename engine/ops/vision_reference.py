"""Plain numpy ops of the Qwen3.5/3.6 vision tower: the executable spec its fast paths are tested on.

Every function is vectorised, takes and returns float32 (float64 only inside, where noted), and is
written to be read next to ``shared/spec/vision.md`` part A (section numbers below) and
``shared/spec/reference.md`` section 5 "Vision tower". Sources: transformers 5.24
``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (Qwen3_5MoeVisionModel and its parts) and
``vision_utils.py`` (``get_vision_interpolation_indices_and_weights``, ``get_vision_position_ids``);
llama.cpp ``tools/mtmd/models/qwen3vl.cpp``; W. H. Press et al., *Numerical Recipes* (3rd ed.),
section 6.2.2 for the erfc approximation.
"""

from __future__ import annotations

import numpy as np

ATTN_CHUNK_BYTES = 8 << 20
"""Upper bound on the float32 score block one attention step materialises (rows x keys x 4 bytes)."""


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * w + b`` (biased variance).

    Args:
        x: (..., d) float32. w, b: (d,) float32. eps: 1e-6 for every vision norm (spec 0).

    Returns:
        (..., d) float32, a new array.
    """
    x = np.asarray(x, dtype=np.float32)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    xc *= 1.0 / np.sqrt(var + np.float32(eps))
    xc *= w
    xc += b
    return xc


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form (HF ``gelu_pytorch_tanh``): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Used in the ViT blocks' MLP (spec A1). x: any shape float32; returns float32.
    """
    x = np.asarray(x, dtype=np.float32)
    inner = x * x
    inner *= np.float32(0.044715)
    inner += np.float32(1.0)
    inner *= x
    inner *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    inner *= x
    inner *= np.float32(0.5)
    return inner


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

    Used in the merger (spec A5.5; llama.cpp uses the tanh form there, a known divergence).
    x: any shape float32; computed in float64, returned as float32.
    """
    x64 = np.asarray(x, dtype=np.float64)
    return (0.5 * x64 * erfc(-x64 * np.sqrt(0.5))).astype(np.float32)


def merge_window_coords(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch (row, col) of each sequence index in merge-window order (spec A2.5).

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


def _align_corners_matrix(n: int, side: int) -> np.ndarray:
    """(n, side) float64 bilinear weights resampling ``side`` points to ``n`` with align_corners=True."""
    src = np.arange(n, dtype=np.float64) * (side - 1) / max(n - 1, 1)
    lo = np.floor(src).astype(np.int64)
    frac = src - lo
    hi = np.minimum(lo + 1, side - 1)
    m = np.zeros((n, side), dtype=np.float64)
    np.add.at(m, (np.arange(n), lo), 1.0 - frac)
    np.add.at(m, (np.arange(n), hi), frac)
    return m


def interpolate_pos_table(table: np.ndarray, side: int, gh: int, gw: int) -> np.ndarray:
    """Learned position table resampled bilinearly, align_corners=True, to a (gh, gw) patch grid (spec A5.2).

    Args:
        table: (side*side, d) float32, row ``r*side + c`` for grid point (r, c).
        gh, gw: target grid in patches.

    Returns:
        (gh, gw, d) float32 in raster order (callers gather rows in merge-window order).
    """
    d = table.shape[-1]
    grid = np.asarray(table, dtype=np.float64).reshape(side, side, d)
    a_r = _align_corners_matrix(gh, side)
    a_c = _align_corners_matrix(gw, side)
    rows = np.tensordot(a_r, grid, axes=(1, 0))          # (gh, side, d)
    out = np.einsum("cs,rsd->rcd", a_c, rows)             # (gh, gw, d)
    return out.astype(np.float32)


def rope_2d_cos_sin(rows: np.ndarray, cols: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables of the 2-D vision RoPE (spec A5.3).

    ``inv_j = theta^(-2j / (head_dim/2))`` for j < head_dim/4; angles ``[row*inv, col*inv]`` (head_dim/2),
    repeated twice to cover the whole head for the half-split rotation.

    Args:
        rows, cols: (S,) int patch coordinates. head_dim: multiple of 4.

    Returns:
        cos, sin: (S, head_dim) float32.
    """
    half = head_dim // 2
    inv = 1.0 / theta ** (np.arange(0, half, 2, dtype=np.float64) / half)
    ang = np.concatenate([np.outer(rows, inv), np.outer(cols, inv)], axis=1)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split (NeoX, rotate_half) rotation: ``x*cos + rotate_half(x)*sin``, rotate_half(a) = [-a2, a1].

    Args:
        x: (S, H, d) float32. cos, sin: (S, d) float32 (shared by all heads).

    Returns:
        (S, H, d) float32, a new array.
    """
    h = x.shape[-1] // 2
    rot = np.empty_like(x)
    rot[..., :h] = -x[..., h:]
    rot[..., h:] = x[..., :h]
    rot *= sin[:, None, :]
    out = x * cos[:, None, :]
    out += rot
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk_bytes: int = ATTN_CHUNK_BYTES) -> np.ndarray:
    """Non-causal multi-head attention over one image: ``softmax(q k^T / sqrt(d)) v`` per head.

    One head at a time, query rows in blocks whose score matrix takes at most ``chunk_bytes`` (so it
    stays in cache); the softmax denominator divides the (rows, d) output rather than the scores.

    Args:
        q, k, v: (S, H, d) float32.

    Returns:
        (S, H*d) float32, heads concatenated in order.
    """
    s, n_head, d = q.shape
    qh = np.ascontiguousarray(q.transpose(1, 0, 2)) * np.float32(1.0 / np.sqrt(d))
    kh = np.ascontiguousarray(k.transpose(1, 0, 2))
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    out = np.empty((s, n_head, d), dtype=np.float32)
    step = max(1, chunk_bytes // (4 * s))
    for h in range(n_head):
        k_t = kh[h].T
        for i in range(0, s, step):
            sc = qh[h, i:i + step] @ k_t                  # (rows, S)
            sc -= sc.max(axis=1, keepdims=True)
            np.exp(sc, out=sc)
            o = sc @ vh[h]
            o /= sc.sum(axis=1, keepdims=True)
            out[i:i + step, h] = o
    return out.reshape(s, n_head * d)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T + b``. x: (n, in) float32; w: (out, in) float32 (GGUF math shape); b: (out,)."""
    y = x @ w.T
    if b is not None:
        y += b
    return y
