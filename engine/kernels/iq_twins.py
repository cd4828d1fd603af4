"""numpy twin of the IQ types' unpacking (native/cpu/quant/iquants.h, whose comment gives the layouts): each
super-block as unsigned values ``u = v + off``, an odd integer scale per 16 values and the f32 ``d_eff`` (the
f16 d times a power of two), so value j is ``d_eff * sc[j // 16] * (u[j] - off)``. The codebooks are
gguf-py's (``gguf.quants.IQ2_XXS.grid`` etc., the formats' tables); :func:`grids` hands them to the kernels.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq

Q = GGMLQuantizationType

IQ_TYPES = frozenset({Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M})
"""The IQ super-block types the kernels read (native/cpu/quant/iquants.h)."""
OFFSETS = {Q.IQ2_XXS: 43, Q.IQ2_XS: 43, Q.IQ2_S: 43, Q.IQ3_XXS: 62, Q.IQ3_S: 15, Q.IQ1_S: 9, Q.IQ1_M: 9}
"""What the kernels add to a type's integer values to make them unsigned (iquants.h ``DD_*_OFF``)."""
_GRID_OF = {Q.IQ2_XXS: gq.IQ2_XXS, Q.IQ2_XS: gq.IQ2_XS, Q.IQ2_S: gq.IQ2_S, Q.IQ3_XXS: gq.IQ3_XXS,
            Q.IQ3_S: gq.IQ3_S, Q.IQ1_S: gq.IQ1_S, Q.IQ1_M: gq.IQ1_S}


def grid(qtype: GGMLQuantizationType) -> np.ndarray:
    """(entries, width) int64 codebook of an IQ type (IQ1_M: IQ1_S's), from gguf-py."""
    cls = _GRID_OF[qtype]
    cls.init_grid()
    return np.rint(cls.grid.reshape(cls.grid_shape)).astype(np.int64)


def grids() -> dict[GGMLQuantizationType, np.ndarray]:
    """The codebooks the kernels need registered (``dd_set_iq_grid``), int8 flat: one per type but IQ1_M."""
    return {t: grid(t).astype(np.int8).reshape(-1) for t in IQ_TYPES if t != Q.IQ1_M}


def _signs(bits: np.ndarray) -> np.ndarray:
    """(..., n) sign bytes -> (..., n, 8) of +1 / -1 (bit j set: value j negative)."""
    return 1 - 2 * ((bits[..., None] >> np.arange(8)) & 1)


_KSIGNS = np.array([i | (i.bit_count() & 1) << 7 for i in range(128)], np.int64)
"""ggml's ksigns_iq2xs: 7 sign bits and their parity as bit 7."""


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4").astype(np.int64)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2").astype(np.int64)


def _values(b: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Signed integer values (rows, nsb, 256), scales (rows, nsb, 16), d_eff (rows, nsb) of blocks b (uint8)."""
    g = grid(qtype)
    ib = np.arange(8)
    if qtype in (Q.IQ2_XXS, Q.IQ3_XXS):
        aux = _u32(b[..., 66:98] if qtype == Q.IQ3_XXS else b[..., 2:66].reshape(*b.shape[:2], 8, 8)[..., 4:])
        aux = aux.reshape(*b.shape[:2], 8)
        signs = _signs(_KSIGNS[(aux[..., None] >> (7 * np.arange(4))) & 127])            # (r, s, 8, 4, 8)
        idx = b[..., 2:66].reshape(*b.shape[:2], 8, 8)[..., :4] if qtype == Q.IQ2_XXS else b[..., 2:66]
        vals = g[idx.astype(np.int64)].reshape(*signs.shape) * signs
        sc = np.repeat(2 * (aux >> 28) + 1, 2, axis=-1)
        d = _f16(b[..., :2]) * np.float32(0.125 if qtype == Q.IQ2_XXS else 0.25)
    elif qtype in (Q.IQ2_XS, Q.IQ2_S):
        if qtype == Q.IQ2_XS:
            qs = _u16(b[..., 2:66])
            idx, signs, scales = qs & 511, _signs(_KSIGNS[qs >> 9]), b[..., 66:74].astype(np.int64)
        else:
            e = np.arange(32)
            idx = b[..., 2:34].astype(np.int64) | ((b[..., 66 + e // 4].astype(np.int64) >> (2 * (e % 4))) & 3) << 8
            signs, scales = _signs(b[..., 34:66].astype(np.int64)), b[..., 74:82].astype(np.int64)
        vals = g[idx] * signs
        sc = 2 * np.stack([scales & 15, scales >> 4], axis=-1).reshape(*b.shape[:2], 16) + 1
        d = _f16(b[..., :2]) * np.float32(0.125)
    elif qtype == Q.IQ3_S:
        e = np.arange(64)
        idx = b[..., 2:66].astype(np.int64) | ((b[..., 66 + e // 8].astype(np.int64) >> (e % 8)) & 1) << 8
        vals = g[idx].reshape(*b.shape[:2], 32, 8) * _signs(b[..., 74:106].astype(np.int64))
        scales = (b[..., 106 + ib // 2].astype(np.int64) >> (4 * (ib % 2))) & 15
        sc = np.repeat(2 * scales + 1, 2, axis=-1)
        d = _f16(b[..., :2])
    elif qtype == Q.IQ1_S:
        qh = _u16(b[..., 34:50])                                                        # (r, s, 8)
        e = np.arange(32)
        idx = b[..., 2:34].astype(np.int64) | ((qh[..., e // 4] >> (3 * (e % 4))) & 7) << 8
        delta = np.where(qh[..., e // 4] & 0x8000, -1, 1)
        vals = 8 * g[idx] + delta[..., None]
        sc = np.repeat(2 * ((qh >> 12) & 7) + 1, 2, axis=-1)
        d = _f16(b[..., :2]) * np.float32(0.125)
    else:                                                                               # IQ1_M
        s = _u16(b[..., 48:56])                                                         # (r, s, 4)
        h = np.arange(16)
        sc = 2 * ((s[..., h // 4] >> (3 * (h % 4))) & 7) + 1
        e = np.arange(32)
        nib = (b[..., 32 + e // 2].astype(np.int64) >> (4 * (e % 2))) & 15
        idx = b[..., :32].astype(np.int64) | (nib & 7) << 8
        vals = 8 * g[idx] + np.where(nib & 8, -1, 1)[..., None]
        bits = (s[..., 0] >> 12) | ((s[..., 1] >> 8) & 0xF0) | ((s[..., 2] >> 4) & 0xF00) | (s[..., 3] & 0xF000)
        d = bits.astype("<u2").view("<f2").astype(np.float32) * np.float32(0.125)
    return vals.reshape(*b.shape[:2], 256), sc, d


def iq_unpack(raw: np.ndarray, qtype: GGMLQuantizationType
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`engine.kernels.lowbit_twins.lowbit_unpack` for an IQ type: u (rows, nsb, 256) int64, sc and mn
    (rows, nsb, 16) int64 (mn zero), d_eff and dmin (rows, nsb) float32 (dmin zero)."""
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, -1, gq.GGML_QUANT_SIZES[qtype][1])
    vals, sc, d = _values(b, qtype)
    return (vals + OFFSETS[qtype], sc, np.zeros_like(sc), d, np.zeros(d.shape, np.float32))

