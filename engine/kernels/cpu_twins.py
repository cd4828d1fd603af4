"""The numpy twins of the CPU kernels' Q8_0 activation quantization and Q4_0 / Q8_0 / K-quant products
(:mod:`engine.kernels.cpu`; block layouts and rounding: docs/design/native-cpu.md), and the
activation checks both sides share. Pure numpy: they run with or without the native extension.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant

Q = GGMLQuantizationType
QK = 32
Q8_0_BYTES = 34


Q4_0_IL = dataclasses.replace(quant.TYPES[Q.Q4_0], cpu_kernel=22)
"""Q4_0 rows in the native 8-row interleaved layout (``DD_Q4_0_IL``, :mod:`engine.kernels.cpu_q4il`): the Q4_0
blocks and sizes, read by the kernel of that layout. Only a :class:`engine.kernels.cpu.Matrix` built with
``interleaved=True`` carries it; everything that reads raw row-major bytes sees :data:`quant.TYPES` rows."""
MXFP4_IL = dataclasses.replace(quant.TYPES[Q.MXFP4], cpu_kernel=23)
"""MXFP4 rows in the same layout (``DD_MXFP4_IL``), as :data:`Q4_0_IL`."""
Q4_K_IL = dataclasses.replace(quant.TYPES[Q.Q4_K], cpu_kernel=24)
"""Q4_K rows in the native 8-row interleaved layout (``DD_Q4_K_IL``, :mod:`engine.kernels.cpu_q4il`), as
:data:`Q4_0_IL` for Q4_0."""
IL_TRAITS = {Q.Q4_0: Q4_0_IL, Q.MXFP4: MXFP4_IL, Q.Q4_K: Q4_K_IL}
"""The interleaved layout's kernel traits of each stored type that has one."""
IL_ROWS = 8


def deinterleave_np(raw: np.ndarray, qtype: GGMLQuantizationType = Q.Q4_0) -> np.ndarray:
    """The row-major rows of interleaved ones (a new array; the numpy twin of ``dd_q4_0_deinterleave`` and
    ``dd_mxfp4_deinterleave``).

    Args: raw (rows, k // 32 * block bytes) uint8 of ``qtype`` (a key of :data:`IL_TRAITS`; blocks of sc = 2
        (Q4_0's f16 d) or 1 (MXFP4's e8m0) scale bytes and 16 nibble bytes): stripes of 8 rows, block b of a
        stripe 8 (sc + 16) bytes (the 8 rows' scales, then at 8 sc + 32 q + 4 r row r's nibble bytes
        4 q .. 4 q + 3); rows past the last multiple of 8 row-major.
    Returns: raw's shape, uint8, each row's blocks as stored in the file.
    """
    rows, row_bytes = raw.shape
    block = quant.TYPES[qtype].block_bytes
    sc, nb, stripes = block - 16, row_bytes // block, rows // IL_ROWS
    out = np.array(raw, dtype=np.uint8, copy=True)
    blocks = raw[:IL_ROWS * stripes].reshape(stripes, nb, IL_ROWS * block)
    scales = blocks[:, :, :IL_ROWS * sc].reshape(stripes, nb, IL_ROWS, sc)
    runs = blocks[:, :, IL_ROWS * sc:].reshape(stripes, nb, 4, IL_ROWS, 4).transpose(0, 1, 3, 2, 4)
    per_row = np.concatenate([scales, runs.reshape(stripes, nb, IL_ROWS, 16)], axis=3)   # (s, b, r, block)
    out[:IL_ROWS * stripes] = per_row.transpose(0, 2, 1, 3).reshape(IL_ROWS * stripes, row_bytes)
    return out


def q4_k_deinterleave_np(raw: np.ndarray) -> np.ndarray:
    """The row-major Q4_K rows of interleaved ones (a new array; the numpy twin of ``dd_q4_k_deinterleave``).

    Args: raw (rows, k // 256 * 144) uint8: stripes of 8 rows, super-block b of a stripe 1152 bytes (the 8 rows'
        d, their dmin, the scales' and mins' low nibbles, their top bits, then at 128 + 256 j + 32 u + 4 r row r's
        qs bytes 32 j + 4 u .. + 3; native/cpu/deltadesk_cpu.h); rows past the last multiple of 8 row-major.
    Returns: (rows, k // 256 * 144) uint8, each row's super-blocks as stored in the file.
    """
    rows, row_bytes = raw.shape
    nsb, stripes = row_bytes // quant.TYPES[Q.Q4_K].block_bytes, rows // IL_ROWS
    out = np.array(raw, dtype=np.uint8, copy=True)
    blk = raw[:IL_ROWS * stripes].reshape(stripes, nsb, 1152)
    d = blk[..., :16].reshape(stripes, nsb, 8, 2)
    dmin = blk[..., 16:32].reshape(stripes, nsb, 8, 2)
    s, m, h = (blk[..., o:o + 32].reshape(stripes, nsb, 4, 8).astype(np.uint32) for o in (32, 64, 96))
    sc = np.concatenate([(s & 15) | (h & 3) << 4, s >> 4 | (h >> 2 & 3) << 4], axis=2)      # (s, b, i, r)
    mn = np.concatenate([(m & 15) | (h >> 4 & 3) << 4, m >> 4 | (h >> 6) << 4], axis=2)
    packed = np.concatenate([sc[:, :, :4] | (sc[:, :, 4:] >> 4) << 6, mn[:, :, :4] | (mn[:, :, 4:] >> 4) << 6,
                             (sc[:, :, 4:] & 15) | (mn[:, :, 4:] & 15) << 4], axis=2)        # (s, b, 12, r)
    qs = blk[..., 128:].reshape(stripes, nsb, 4, 8, 8, 4).transpose(0, 1, 4, 2, 3, 5).reshape(stripes, nsb, 8, 128)
    per_row = np.concatenate([d, dmin, packed.transpose(0, 1, 3, 2).astype(np.uint8), qs], axis=3)   # (s, b, r, 144)
    out[:IL_ROWS * stripes] = per_row.transpose(0, 2, 1, 3).reshape(IL_ROWS * stripes, row_bytes)
    return out


Q2_K_RL = dataclasses.replace(quant.TYPES[Q.Q2_K], cpu_kernel=25)
"""Q2_K rows in the native 4-row rows-as-lanes layout (``DD_Q2_K_RL``, :mod:`engine.kernels.cpu_rl`), carried
as :data:`Q4_0_IL` is."""
Q3_K_RL = dataclasses.replace(quant.TYPES[Q.Q3_K], cpu_kernel=26)
"""Q3_K rows in the native 4-row rows-as-lanes layout (``DD_Q3_K_RL``, :mod:`engine.kernels.cpu_rl`), as
:data:`Q2_K_RL` for Q2_K."""
RL_TRAITS = {Q.Q2_K: Q2_K_RL, Q.Q3_K: Q3_K_RL}
"""The rows-as-lanes layout's kernel traits of each stored type that has one."""
RL_ROWS = 4
# the super-block whose two scale bytes sit at 32 p + 8 q of a group's scale bytes (deltadesk_cpu.h)
_RL_PAIR_BLOCK = np.array([[0, 4, 1, 5], [2, 6, 3, 7]])
_RL_SCALE_AT = (2 * _RL_PAIR_BLOCK[:, :, None] + np.arange(2)).reshape(-1)   # layout position -> scale byte

def layout_rows(traits: quant.QuantType) -> int:
    """Rows per group of a row-grouped layout's traits (8 for the stripes of :data:`IL_TRAITS`, 4 for
    :data:`RL_TRAITS`), else 1."""
    return IL_ROWS if traits in IL_TRAITS.values() else RL_ROWS if traits in RL_TRAITS.values() else 1


def _rl_unpack(raw: np.ndarray, qtype: Q, rows_of) -> np.ndarray:
    """Row-major rows of a rows-as-lanes matrix of qtype (a new array): rows_of(sbs, qs) gives the 4 rows' stored
    super-blocks (groups, nsb, 4, block bytes) from the groups' super-blocks sbs (groups, nsb, 4 * block bytes) and
    their qs bytes qs (groups, nsb, 4, 64) in row order (chunk c, dword 4 g + r: row r's qs dword 4 g + c)."""
    rows, row_bytes = raw.shape
    block = quant.TYPES[qtype].block_bytes
    nsb, groups = row_bytes // block, rows // RL_ROWS
    out = np.array(raw, dtype=np.uint8, copy=True)
    sbs = raw[:RL_ROWS * groups].reshape(groups, nsb, RL_ROWS * block)
    qs = sbs[..., :256].reshape(groups, nsb, 4, 4, 4, 4).transpose(0, 1, 4, 3, 2, 5).reshape(groups, nsb, 4, 64)
    out[:RL_ROWS * groups] = rows_of(sbs, qs).transpose(0, 2, 1, 3).reshape(RL_ROWS * groups, row_bytes)
    return out


def q2_k_rl_unpack_np(raw: np.ndarray) -> np.ndarray:
    """The row-major Q2_K rows of rows-as-lanes ones (a new array; the numpy twin of ``dd_q2_k_rl_unpack``).

    Args: raw (rows, k // 256 * 84) uint8: groups of 4 rows, super-block j of a group 336 bytes (deltadesk_cpu.h:
        at 64 c + 4 (4 g + r) + i row r's qs byte 16 g + 4 c + i, then the permuted scale bytes, the 4 d, the 4
        dmin); rows past the last multiple of 4 row-major.
    Returns: (rows, k // 256 * 84) uint8, each row's super-blocks as stored in the file.
    """
    def rows_of(sbs: np.ndarray, qs: np.ndarray) -> np.ndarray:
        groups, nsb = sbs.shape[:2]
        placed = sbs[..., 256:320].reshape(groups, nsb, 2, 4, 4, 2).transpose(0, 1, 4, 2, 3, 5)
        placed = placed.reshape(groups, nsb, 4, 16)
        scales = np.empty_like(placed)
        scales[..., _RL_SCALE_AT] = placed
        d, dmin = sbs[..., 320:328].reshape(groups, nsb, 4, 2), sbs[..., 328:336].reshape(groups, nsb, 4, 2)
        return np.concatenate([scales, qs, d, dmin], axis=3)   # (groups, nsb, r, 84)

    return _rl_unpack(raw, Q.Q2_K, rows_of)


# the scale whose low nibble a Q3_K group's scale byte 8 q + 2 r + t holds as its own: 2 B[q] + t (deltadesk_cpu.h)
_RL3_NIBBLE_OF = (2 * np.array([0, 4, 1, 5])[:, None] + np.arange(2)).reshape(-1)   # (q, t) -> scale


def q3_k_rl_unpack_np(raw: np.ndarray) -> np.ndarray:
    """The row-major Q3_K rows of rows-as-lanes ones (a new array; the numpy twin of ``dd_q3_k_rl_unpack``).

    Args: raw (rows, k // 256 * 110) uint8: groups of 4 rows, super-block j of a group 440 bytes (deltadesk_cpu.h:
        at 64 c + 4 (4 g + r) + i row r's qs byte 16 g + 4 c + i, at 256 + 32 c + 4 (4 t + r) + i its hmask byte
        16 t + 4 c + i, then the scales' low nibbles and top bits in the kernel's order, the 4 d); rows past the last
        multiple of 4 row-major.
    Returns: (rows, k // 256 * 110) uint8, each row's super-blocks as stored in the file.
    """
    def rows_of(sbs: np.ndarray, qs: np.ndarray) -> np.ndarray:
        groups, nsb = sbs.shape[:2]
        hm = sbs[..., 256:384].reshape(groups, nsb, 4, 2, 4, 4).transpose(0, 1, 4, 3, 2, 5).reshape(groups, nsb, 4, 32)
        nib = sbs[..., 384:416].reshape(groups, nsb, 4, 4, 2).transpose(0, 1, 3, 2, 4).reshape(groups, nsb, 4, 8)
        low = np.empty((groups, nsb, 4, 16), dtype=np.uint8)   # (group, super-block, row, scale)
        low[..., _RL3_NIBBLE_OF], low[..., _RL3_NIBBLE_OF + 4] = nib & 15, nib >> 4
        top_bytes = sbs[..., 416:432].reshape(groups, nsb, 2, 4, 2).transpose(0, 1, 3, 2, 4)   # (g, j, r, u, t)
        top = (top_bytes[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None] & 3).reshape(groups, nsb, 4, 16)
        scales = np.zeros((groups, nsb, 4, 12), dtype=np.uint8)   # top: scale 8 u + 2 f + t at its index
        scales[..., :8] = low[..., :8] | low[..., 8:] << 4
        for k in range(4):
            scales[..., 8:] |= top[..., 4 * k:4 * k + 4] << (2 * k)
        d = sbs[..., 432:440].reshape(groups, nsb, 4, 2)
        return np.concatenate([hm, qs, scales, d], axis=3)   # (groups, nsb, r, 110)

    return _rl_unpack(raw, Q.Q3_K, rows_of)


def row_major(raw: np.ndarray, traits: quant.QuantType) -> tuple[np.ndarray, quant.QuantType]:
    """(raw, traits) as the stored type's row-major rows: a row-grouped layout's rows unpacked (a copy), others as
    given."""
    if traits == Q4_K_IL:
        return q4_k_deinterleave_np(raw), quant.TYPES[Q.Q4_K]
    if traits == Q2_K_RL:
        return q2_k_rl_unpack_np(raw), quant.TYPES[Q.Q2_K]
    if traits == Q3_K_RL:
        return q3_k_rl_unpack_np(raw), quant.TYPES[Q.Q3_K]
    if traits in IL_TRAITS.values():
        return deinterleave_np(raw, traits.qtype), quant.TYPES[traits.qtype]
    return raw, traits


def activations(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """x as C-contiguous (m, k) float32 with k % 32 == 0, and whether it came in 1-D."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    vector = x.ndim == 1
    x2 = x.reshape(1, -1) if vector else x
    if x2.ndim != 2 or x2.shape[1] % QK != 0 or x2.shape[1] == 0:
        raise ValueError(f"activations: expected (m, k) or (k,) with k a positive multiple of {QK}, got {x.shape}")
    return x2, vector


def quantize_q8_0_np(x: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`engine.kernels.cpu.quantize_q8_0` (same arguments, same bytes)."""
    x2, vector = activations(x)
    blocks = x2.reshape(-1, QK)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    t = np.abs(blocks * inv)
    q = np.sign(blocks) * (np.floor(t) + (t - np.floor(t) >= 0.5))   # round half away from zero
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=1)
    out = out.reshape(x2.shape[0], -1)
    return out[0] if vector else out


Q4Q8 = frozenset({Q.Q4_0, Q.Q8_0})
"""The 32-value types whose products sum f32 terms in 16 lanes (native/cpu/quant/kernels.h, dd_tree16_f32)."""
Q4Q8_LANES = 16


def q4q8_product_np(raw: np.ndarray, x2: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(m, rows) float32 = x2 (m, k) quantized to Q8_0 times rows of Q4_0 or Q8_0, in the f32 operations and
    order of the kernels (native/cpu/quant/kernels.h): block b's exact int dot to f32 times the exact f32
    d_w d_a, rounded once; added to lane b % 16 in order of b from +0; lanes (i, i + 8), (i, i + 4), (i, i + 2),
    (0, 1). numpy's float32 multiply and add round as the kernels' (no fused multiply-add on either side)."""
    rows, nb = raw.shape[0], x2.shape[1] // QK
    blocks = raw.reshape(rows, nb, quant.type_size(qtype))
    dw = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)          # (rows, nb)
    qs = blocks[..., 2:]
    if qtype == Q.Q4_0:
        v = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64) - 8
    else:
        v = qs.view(np.int8).astype(np.int64)
    acts = quantize_q8_0_np(x2).reshape(len(x2), nb, Q8_0_BYTES)
    da = acts[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)            # (m, nb)
    dot = np.einsum("rbj,cbj->crb", v, acts[..., 2:].view(np.int8).astype(np.int64))  # (m, rows, nb), |.| < 2^24
    terms = dot.astype(np.float32) * (dw[None] * da[:, None])
    acc = np.zeros((len(x2), rows, Q4Q8_LANES), dtype=np.float32)
    for g in range(0, nb, Q4Q8_LANES):
        n = min(Q4Q8_LANES, nb - g)
        acc[..., :n] += terms[..., g:g + n]
    half = acc[..., :8] + acc[..., 8:]
    quarter = half[..., :4] + half[..., 4:]
    return (quarter[..., 0] + quarter[..., 2]) + (quarter[..., 1] + quarter[..., 3])


K_QUANTS = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
"""The K-quant types the kernels read (native/cpu/quant/kquants.h); 256-value super-blocks."""
KQ_ROWS = 1024
"""Weight rows the numpy twin takes at a time (bounds its int64 temporaries)."""


def kquant_unpack(raw: np.ndarray, qtype: GGMLQuantizationType
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Integer parts of Q4_K / Q5_K / Q6_K super-blocks (layouts in native/cpu/quant/kquants.h, after
    ggml-quants.c ``dequantize_row_q4_K`` / ``_q5_K`` / ``_q6_K``).

    Args: raw (rows, nsb * block bytes) uint8; qtype one of :data:`K_QUANTS`.
    Returns: q (rows, nsb, 256) int64 unsigned quants in value order; sc (rows, nsb, 16) int64 scale
    of each 16 values; mn (rows, nsb, 8) int64 min of each 32 (zeros for Q6_K); d, dmin (rows, nsb)
    float32 (dmin zeros for Q6_K). Value v of super-block s is ``d * sc[v // 16] * q[v] - dmin *
    mn[v // 32]`` (Q4_K, Q5_K) or ``d * sc[v // 16] * (q[v] - 32)`` (Q6_K).
    """
    rows = raw.shape[0]
    b = quant.block_view(raw, qtype)
    nsb = b.shape[1]
    if qtype == Q.Q6_K:
        ql = b["ql"].reshape(rows, nsb, 2, 64).astype(np.int64)
        qh = b["qh"].reshape(rows, nsb, 2, 32).astype(np.int64)
        lo, hi = ql[..., :32], ql[..., 32:]
        q = np.stack([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                      (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=-2)
        zeros = np.zeros((rows, nsb), dtype=np.float32)
        return (q.reshape(rows, nsb, 256), b["scales"].astype(np.int64), np.zeros((rows, nsb, 8), np.int64),
                b["d"].astype(np.float32), zeros)
    qs = b["qs"].reshape(rows, nsb, 4, 1, 32).astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=3)                         # (rows, nsb, chunk, half, 32)
    if qtype == Q.Q5_K:
        qh = b["qh"].astype(np.int64)[:, :, None, None, :]
        q |= ((qh >> np.arange(8).reshape(4, 2, 1)) & 1) << 4               # bit 2j + half of qh[l]
    s = b["scales"].astype(np.int64)                                       # get_scale_min_k4
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return (q.reshape(rows, nsb, 256), np.repeat(sc, 2, axis=-1), mn, b["d"].astype(np.float32),
            b["dmin"].astype(np.float32))


def superblock_acts(x2: np.ndarray, nsb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x2`` (m, k) quantized to Q8_0 and laid out by 256-value super-block: the f32 scales (m, nsb, 8), the
    int64 quants (m, nsb, 8, 2, 16) and their half-block sums (m, nsb, 8, 2)."""
    m = x2.shape[0]
    blocks = quantize_q8_0_np(x2).reshape(m, nsb, 8, Q8_0_BYTES)
    da = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    aq = blocks[..., 2:].view(np.int8).astype(np.int64).reshape(m, nsb, 8, 2, 16)
    return da, aq, aq.sum(axis=-1)


def lane_tree(acc: np.ndarray) -> np.ndarray:
    """The kernels' fixed sum of 8 f64 lanes (last axis of ``acc``): pairs, then pairs of pairs; float32."""
    lanes = [acc[..., i] for i in range(8)]
    pairs = [lanes[i] + lanes[i + 1] for i in range(0, 8, 2)]
    return ((pairs[0] + pairs[1]) + (pairs[2] + pairs[3])).astype(np.float32)


def kquant_product_np(raw: np.ndarray, x2: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(m, rows) float32 = x2 (m, k) quantized to Q8_0 times the K-quant rows, in exactly the f32 operations
    and order of native/cpu/quant/kquants.h: per block i of a super-block, Q4_K / Q5_K take
    ``(d sc_i) da_i`` (one rounding) times the int sum S_i, less ``(dmin m_i)(da_i bs_i)``; Q6_K takes
    ``(d da_i) I_i``; lane i adds them super-block by super-block from +0; then the lanes' fixed tree.
    numpy's float32 multiply, add and subtract round as the kernels' (no fused multiply-add on either side)."""
    q, sc, mn, d, dmin = kquant_unpack(raw, qtype)
    rows, nsb = d.shape
    m = x2.shape[0]
    da, aq, s16 = superblock_acts(x2, nsb)
    sc2 = sc.reshape(rows, nsb, 8, 2)
    halves = np.einsum("rsihj,csihj->crsih", q.reshape(rows, nsb, 8, 2, 16), aq)   # (m, rows, nsb, 8, 2)
    if qtype == Q.Q6_K:
        ints = ((halves - 32 * s16[:, None]) * sc2[None]).sum(axis=-1)           # I_i, |.| < 2^24
        terms = (d[None, :, :, None] * da[:, None]) * ints.astype(np.float32)      # d da_i exact
        mins = None
    else:
        w = (d[:, :, None] * sc2[..., 0].astype(np.float32))[None] * da[:, None]   # d sc_i exact, one rounding
        terms = w * halves.sum(axis=-1).astype(np.float32)                        # S_i, |.| < 2^17
        mins = (dmin[:, :, None] * mn.astype(np.float32))[None] * (da * s16.sum(-1).astype(np.float32))[:, None]
    acc = np.zeros((m, rows, 8), dtype=np.float32)
    for s in range(nsb):
        acc += terms[:, :, s]
        if mins is not None:
            acc -= mins[:, :, s]
    return lane_tree_f32(acc)


def lane_tree_f32(acc: np.ndarray) -> np.ndarray:
    """The K-quant kernels' fixed sum of 8 f32 lanes (last axis of ``acc``): ((l0 + l1) + (l2 + l3)) +
    ((l4 + l5) + (l6 + l7)), each add rounded in float32."""
    pairs = acc[..., 0::2] + acc[..., 1::2]
    return (pairs[..., 0] + pairs[..., 1]) + (pairs[..., 2] + pairs[..., 3])


B_QUANTS = frozenset({Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4})
"""The other 4/5-bit types the kernels read as stored (native/cpu/quant/bquants.h): 32-value blocks taken
eight at a time (IQ4_XS: its 256-value super-block)."""
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
"""ggml-common.h ``kvalues_iq4nl``: the int8 codebook IQ4_NL / IQ4_XS nibbles index."""
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
"""ggml-common.h ``kvalues_mxfp4`` (the e2m1 values doubled): the codebook MXFP4 nibbles index."""


def bquant_unpack(raw: np.ndarray, qtype: GGMLQuantizationType
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Integer parts of Q4_1 / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS / MXFP4 rows (layouts in native/cpu/quant/bquants.h,
    after ggml-quants.c ``dequantize_row_q4_1`` / ``_q5_0`` / ``_q5_1`` / ``_iq4_nl`` / ``_iq4_xs`` / ``_mxfp4``).

    Args: raw (rows, row bytes) uint8; qtype one of :data:`B_QUANTS`.
    Returns: v (rows, nb, 32) int64 integer values in value order (q for Q4_1 / Q5_1, q - 16 for
    Q5_0, ``kvalues_iq4nl[nibble]`` for the IQ4 types, ``kvalues_mxfp4[nibble]`` for MXFP4); mult (rows, nb)
    int64 integer block scale (``ls - 32`` for IQ4_XS, else 1); d (rows, nb) float32 block scale (IQ4_XS: its
    super-block's; MXFP4: ``2^(e - 128)``, ggml_e8m0_to_fp32_half);
    m (rows, nb) float32 block min for Q4_1 / Q5_1, else None. Value j of block b is
    ``d * mult * v[j] (+ m)``.
    """
    rows = raw.shape[0]
    b = quant.block_view(raw, qtype)
    qs = b["qs"].astype(np.int64).reshape(rows, -1, 16)                # (rows, nb, 16) for every type
    nib = np.concatenate([qs & 15, qs >> 4], axis=-1)                   # (rows, nb, 32)
    nb = nib.shape[1]
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        v = KVALUES_IQ4NL[nib]
    elif qtype == Q.MXFP4:
        v = KVALUES_MXFP4[nib]
    elif qtype in (Q.Q5_0, Q.Q5_1):
        qh = b["qh"].astype(np.int64)                                   # (rows, nb, 4) little-endian u32
        bits = (qh[..., np.arange(32) // 8] >> (np.arange(32) % 8)) & 1
        v = nib | bits << 4
        v = v - 16 if qtype == Q.Q5_0 else v
    else:
        v = nib
    if qtype == Q.IQ4_XS:
        lo = (b["scales_l"].astype(np.int64)[..., np.arange(8) // 2] >> (4 * (np.arange(8) % 2))) & 15
        hi = (b["scales_h"].astype(np.int64)[..., None] >> (2 * np.arange(8))) & 3
        mult = ((lo | hi << 4) - 32).reshape(rows, nb)
        d = np.repeat(b["d"].astype(np.float32), 8, axis=1)
    elif qtype == Q.MXFP4:
        mult = np.ones((rows, nb), np.int64)
        e = b["e"].astype(np.uint32)
        d = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
    else:
        mult = np.ones((rows, nb), np.int64)
        d = b["d"].astype(np.float32)
    m = b["m"].astype(np.float32) if qtype in (Q.Q4_1, Q.Q5_1) else None
    return v, mult, d, m


def bquant_product_np(raw: np.ndarray, x2: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(m, rows) float32 = x2 (m, k) quantized to Q8_0 times rows of a :data:`B_QUANTS` type, in exactly
    the f64 operations and order of native/cpu/quant/bquants.h: per block the exact ``(d da) I`` (and
    ``(m da) S`` for Q4_1 / Q5_1) into lane b % 8, groups of 8 blocks in order, lanes in a fixed tree."""
    v, mult, d, mn = bquant_unpack(raw, qtype)
    rows, nb = d.shape
    m = x2.shape[0]
    blocks = quantize_q8_0_np(x2).reshape(m, nb, Q8_0_BYTES)
    da = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)          # (m, nb)
    aq = blocks[..., 2:].view(np.int8).astype(np.int64)                              # (m, nb, 32)
    dot = np.einsum("rbj,cbj->crb", v, aq) * mult[None]                               # (m, rows, nb) exact
    terms = [(d[None] * da[:, None]).astype(np.float64) * dot.astype(np.float64)]     # exact f32 products
    if mn is not None:
        terms.append((mn[None] * da[:, None]).astype(np.float64) * aq.sum(-1)[:, None].astype(np.float64))
    ng = -(-nb // 8)
    acc = np.zeros((m, rows, 8))
    for g in range(ng):
        n = min(8, nb - 8 * g)
        for t in terms:
            acc[..., :n] += t[..., 8 * g:8 * g + n]
    return lane_tree(acc)


BF16_LANES = 8
"""The f64 lanes of a BF16 dot (native/cpu/quant/bf16.h): lane l sums the products of values 8j + l in order of j."""


def bf16_product_np(raw: np.ndarray, x2: np.ndarray, qtype: GGMLQuantizationType = Q.BF16) -> np.ndarray:
    """numpy twin of the BF16 and F16 kernels (native/cpu/quant/bf16.h): ``x2 @ W.T`` with the f32 activations.

    Args: raw (rows, 2 k) uint8, each row k BF16 values (the top halves of f32s) or, for ``qtype`` F16, k IEEE
    halves; x2 (m, k) float32.
    Returns: (m, rows) float32. Every product w x is exact in f64 (8 or 11 x 24 significand bits); per dot the
    8 lanes are summed in order (a cumulative sum, which adds term by term), then added as (l, l + 4),
    (l, l + 2), (0, 1) and rounded to f32 once: the kernels' bits.
    """
    k = x2.shape[1]
    if qtype == Q.F16:
        w = raw.view("<f2").astype(np.float64)
    else:
        w = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    w = w.reshape(len(raw), k // BF16_LANES, BF16_LANES)
    out = np.empty((len(x2), len(raw)), dtype=np.float32)
    for c, xc in enumerate(x2.astype(np.float64)):
        lanes = np.cumsum(w * xc.reshape(1, -1, BF16_LANES), axis=1)[:, -1, :]
        half = lanes[:, :4] + lanes[:, 4:]
        out[c] = ((half[:, 0] + half[:, 2]) + (half[:, 1] + half[:, 3])).astype(np.float32)
    return out
