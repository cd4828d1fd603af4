"""Random low-bit blocks for synthetic files: Q2_K, Q3_K, IQ1/IQ2/IQ3, IQ4_NL and MXFP4.

Drawn directly as valid blocks (gguf-py cannot quantize to most of these): every byte uniform, then the
scales rewritten so dequantized values have mean ~0 and standard deviation ~``std``.
Design: docs/design/quant-formats.md (the scale of each type).
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType

from engine.kernels.iq_twins import IQ_TYPES, iq_unpack
from engine.kernels.iq_twins import OFFSETS as IQ_OFFSETS
from engine.gguf.quant import BLOCK_DTYPES, row_bytes, type_size

Q = GGMLQuantizationType

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""ggml-common.h ``kvalues_iq4nl``."""
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""ggml-common.h ``kvalues_mxfp4``."""

_RMS = {Q.Q2_K: math.sqrt(135.5 * 1.25), Q.Q3_K: math.sqrt(341.5 * 5.5),
        Q.IQ4_NL: math.sqrt(sum(v * v for v in KVALUES_IQ4NL) / 16),
        Q.MXFP4: math.sqrt(sum(v * v for v in KVALUES_MXFP4) / 16)}

DRAWN = frozenset(_RMS) | IQ_TYPES
"""Types :func:`random_lowbit_blocks` draws."""



def _scale(d_bits: np.ndarray, std: float, rms: float) -> np.ndarray:
    """f32 d from its own random f16 bits: magnitude std / rms * (0.8 .. 1.2), sign from bit 0."""
    r = d_bits.astype(np.float32)
    d = np.float32(std / rms) * (np.float32(0.8) + np.float32(0.4 / 65535) * r)
    return np.where(d_bits & 1, -d, d).astype(np.float32)


def _set_d(b: np.ndarray, qtype: GGMLQuantizationType, d: np.ndarray) -> None:
    """Write the f16 d of blocks b (IQ1_M: into the top nibbles of its 4 scale words)."""
    if qtype == Q.IQ1_M:
        bits = d.astype("<f2").view("<u2").astype(np.uint16)[..., None]
        b["scales"] = (b["scales"] & 0x0FFF) | ((bits >> (4 * np.arange(4, dtype=np.uint16))) & 15) << 12
    else:
        b["d"] = d.astype("<f2")


def _iq_rms(qtype: GGMLQuantizationType) -> float:
    """rms of an IQ type's values over 1024 random super-blocks of d = 1 (module doc)."""
    if qtype not in _RMS:
        raw = np.random.default_rng(0).integers(0, 256, (1024, type_size(qtype)), dtype=np.uint8)
        _set_d(raw.view(BLOCK_DTYPES[qtype]), qtype, np.ones((1024, 1), np.float32))
        u, sc, _, d, _ = iq_unpack(raw, qtype)
        x = d[..., None] * np.repeat(sc, 16, axis=-1) * (u - IQ_OFFSETS[qtype])
        _RMS[qtype] = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    return _RMS[qtype]


def random_lowbit_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
                         rng: np.random.Generator) -> np.ndarray:
    """Stored bytes ``(..., row_bytes)`` uint8 of a random tensor of math ``shape`` in ``qtype`` (one of
    :data:`DRAWN`), values of std ~``std`` (module doc)."""
    rb = row_bytes(qtype, shape[-1])
    nbytes = math.prod(shape[:-1]) * rb
    out = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    b = out.view(BLOCK_DTYPES[qtype])
    if qtype == Q.MXFP4:
        e = 128 + round(math.log2(std / _RMS[qtype]))
        b["e"] = e - (b["e"] & 1)
        return out.reshape(*shape[:-1], rb)
    if qtype in IQ_TYPES:
        r = rng.integers(0, 65536, b.shape, dtype=np.uint16)
        _set_d(b, qtype, _scale(r, std, _iq_rms(qtype)))
        return out.reshape(*shape[:-1], rb)
    d = _scale(b["d"].view("<u2"), std, _RMS[qtype])
    b["d"] = d.astype("<f2")
    if qtype == Q.Q2_K:
        sc = 8 + (b["scales"] & 7)
        b["scales"] = sc | sc << 4
        b["dmin"] = (d * np.float32(1.5)).astype("<f2")
    return out.reshape(*shape[:-1], rb)
