"""Random low-bit blocks for synthetic files (:mod:`engine.arch.qwen35.synth`): Q2_K and Q3_K super-blocks
and the IQ4_NL blocks llama-quantize falls back to, drawn directly as valid blocks (gguf-py cannot
quantize to these types).

Every byte is drawn uniformly (so every code is uniform over its levels), then the scales are rewritten
so the dequantized values have mean ~0 and standard deviation ~``std`` (layouts: native/cpu/lowbit.h,
ggml-common.h; values as ggml-quants.c ``dequantize_row_*``):

* Q2_K: x = d sc q - dmin m with q uniform in 0..3; sc = 8 + (byte & 7), m = sc, dmin = 1.5 d, so
  x = d sc (q - 1.5); rms(sc) = sqrt(135.5), rms(q - 1.5) = sqrt(1.25);
* Q3_K: x = d (s - 32) (u - 4) with u uniform in 0..7 and the 6-bit s uniform in 0..63: mean
  -d (s - 32) / 2 per 16 values (small against the std), rms(s - 32) = sqrt(341.5), rms(u - 4) = sqrt(5.5);
* IQ4_NL: x = d kvalues_iq4nl[nibble], rms of the 16 code values.

``|d|`` = std / (the rms above) * (0.8 + 0.4 r / 65535) from d's own random 16 bits r, sign from bit 0 of r.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType

from engine.quant import BLOCK_DTYPES, row_bytes

Q = GGMLQuantizationType

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""ggml-common.h ``kvalues_iq4nl``."""

_RMS = {Q.Q2_K: math.sqrt(135.5 * 1.25), Q.Q3_K: math.sqrt(341.5 * 5.5),
        Q.IQ4_NL: math.sqrt(sum(v * v for v in KVALUES_IQ4NL) / 16)}

DRAWN = frozenset(_RMS)
"""Types :func:`random_lowbit_blocks` draws."""

SHAPE_FALLBACK = {Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL}
"""llama-quantize's type for a tensor whose ``ne0`` is not a multiple of 256 (``tensor_type_fallback``)."""


def _scale(d_bits: np.ndarray, std: float, rms: float) -> np.ndarray:
    """f32 d from its own random f16 bits: magnitude std / rms * (0.8 .. 1.2), sign from bit 0."""
    r = d_bits.astype(np.float32)
    d = np.float32(std / rms) * (np.float32(0.8) + np.float32(0.4 / 65535) * r)
    return np.where(d_bits & 1, -d, d).astype(np.float32)


def random_lowbit_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
                         rng: np.random.Generator) -> np.ndarray:
    """Stored bytes ``(..., row_bytes)`` uint8 of a random tensor of math ``shape`` in ``qtype`` (one of
    :data:`DRAWN`), values of std ~``std`` (module doc)."""
    rb = row_bytes(qtype, shape[-1])
    nbytes = math.prod(shape[:-1]) * rb
    out = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    b = out.view(BLOCK_DTYPES[qtype])
    d = _scale(b["d"].view("<u2"), std, _RMS[qtype])
    b["d"] = d.astype("<f2")
    if qtype == Q.Q2_K:
        sc = 8 + (b["scales"] & 7)
        b["scales"] = sc | sc << 4
        b["dmin"] = (d * np.float32(1.5)).astype("<f2")
    return out.reshape(*shape[:-1], rb)
