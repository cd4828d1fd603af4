"""numpy twins of the low-bit CPU kernels (native/cpu/quant/lowbit.h: Q2_K, Q3_K and the IQ1/IQ2/IQ3 types read
as stored; the IQ types' unpacking is :mod:`engine.kernels.iq_twins`).

A super-block of 256 values is decoded to unsigned integers ``u = value + off`` in value order, an
integer scale per 16 values and (Q2_K) an integer min per 16 values, plus the f16 super-block scales;
the product replays the kernels' exact integer parts and f64 order (see lowbit.h's exactness note).
Pure numpy: they run with or without the native extension.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels.cpu_twins import lane_tree, superblock_acts
from engine.kernels.iq_twins import IQ_TYPES, iq_unpack
from engine.kernels.iq_twins import OFFSETS as IQ_OFFSETS

Q = GGMLQuantizationType

LOW_BIT = frozenset({Q.Q2_K, Q.Q3_K} | IQ_TYPES)
"""The types lowbit.h reads: 256-value super-blocks."""
OFFSETS = {Q.Q2_K: 0, Q.Q3_K: 4, **IQ_OFFSETS}
"""What the kernels add to a type's integer values to make them unsigned."""


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(rows, nsb, 64) qs bytes -> (rows, nsb, 256) two-bit fields: value 128n + 32j + l is bits 2j, 2j + 1
    of qs[32n + l] (ggml-quants.c dequantize_row_q2_K / _q3_K)."""
    rows, nsb = qs.shape[:2]
    q = qs.astype(np.int64).reshape(rows, nsb, 2, 1, 32) >> (2 * np.arange(4)).reshape(4, 1)
    return (q & 3).reshape(rows, nsb, 256)


def lowbit_unpack(raw: np.ndarray, qtype: GGMLQuantizationType
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Integer parts of Q2_K / Q3_K super-blocks (layouts in native/cpu/quant/lowbit.h; the IQ types:
    :func:`engine.kernels.iq_twins.iq_unpack`).

    Args: raw (rows, nsb * block bytes) uint8; qtype one of :data:`LOW_BIT`.
    Returns: u (rows, nsb, 256) int64 unsigned values; sc, mn (rows, nsb, 16) int64 scale and min of
    each 16 values (mn zero for Q3_K); d, dmin (rows, nsb) float32 (dmin zero for Q3_K). Value v is
    ``d * sc[v // 16] * (u[v] - off) - dmin * mn[v // 16]`` with off = :data:`OFFSETS`[qtype].
    """
    if qtype in IQ_TYPES:
        return iq_unpack(raw, qtype)
    rows = raw.shape[0]
    b = quant.block_view(raw, qtype)
    nsb = b.shape[1]
    u = _crumbs(b["qs"])
    if qtype == Q.Q2_K:
        s = b["scales"].astype(np.int64)
        return u, s & 15, s >> 4, b["d"].astype(np.float32), b["dmin"].astype(np.float32)
    hm = b["hmask"].astype(np.int64).reshape(rows, nsb, 1, 1, 32)
    u = u | (((hm >> np.arange(8).reshape(2, 4, 1)) & 1) << 2).reshape(rows, nsb, 256)
    s = b["scales"].astype(np.int64)
    i = np.arange(16)
    sc = ((s[..., i % 8] >> (4 * (i // 8))) & 15) | (((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
    return (u, sc - 32, np.zeros_like(sc), b["d"].astype(np.float32), np.zeros((rows, nsb), np.float32))


def lowbit_product_np(raw: np.ndarray, x2: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(m, rows) float32 = x2 (m, k) quantized to Q8_0 times rows of a :data:`LOW_BIT` type, in exactly
    the f64 operations and order of native/cpu/quant/lowbit.h (integer parts exact, f32 scale products exact,
    lane b % 8 accumulated over super-blocks in order, lanes added in a fixed tree)."""
    u, sc, mn, d, dmin = lowbit_unpack(raw, qtype)
    rows, nsb = d.shape
    m = x2.shape[0]
    da, aq, s16 = superblock_acts(x2, nsb)
    sc2, mn2 = sc.reshape(rows, nsb, 8, 2), mn.reshape(rows, nsb, 8, 2)
    halves = np.einsum("rsihj,csihj->crsih", u.reshape(rows, nsb, 8, 2, 16), aq)   # (m, rows, nsb, 8, 2)
    dot = (sc2[None] * (halves - OFFSETS[qtype] * s16[:, None])).sum(axis=-1)
    mins = (mn2[None] * s16[:, None]).sum(axis=-1)
    terms = (d[None, :, :, None] * da[:, None]).astype(np.float64) * dot.astype(np.float64)
    min_terms = (dmin[None, :, :, None] * da[:, None]).astype(np.float64) * mins.astype(np.float64)
    acc = np.zeros((m, rows, 8))
    for s in range(nsb):
        acc += terms[:, :, s]
        if qtype == Q.Q2_K:
            acc -= min_terms[:, :, s]
    return lane_tree(acc)
