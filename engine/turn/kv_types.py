"""KV cache element types: how one attention K or V row is stored, written and read back as float32.

"f32" rows are float32; "f16" rows IEEE halves (rounded to nearest even when written); "q8_0" rows are
GGML Q8_0 blocks of 32 values, 34 bytes each (a little-endian half scale ``d``, then 32 int8 ``q``; value
= d * q), held as uint8 arrays whose last axis is ``head_dim / 32 * 34`` bytes. Every type reads back to
float32 exactly (a half times an int8 has at most 19 significant bits), so the kernels widen a row and run
the F32 arithmetic on it. Design: docs/design/kv-cache.md (the Q8_0 scale and rounding).
"""

from __future__ import annotations

import numpy as np

KV_TYPES: dict[str, type] = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}
"""KV cache element types by name -> the numpy dtype of the stored arrays ("q8_0": raw block bytes)."""

Q8_BLOCK = 32
"""Values per Q8_0 block (GGML's QK8_0)."""
Q8_BYTES = 34
"""Bytes per Q8_0 block: a half scale and 32 int8 values."""
_Q8 = np.dtype([("d", "<f2"), ("q", "i1", (Q8_BLOCK,))])


def kv_dtype(kv_type: str) -> np.dtype:
    """The numpy dtype of KV type ``kv_type``'s stored arrays. Raises ValueError for a name not in :data:`KV_TYPES`."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV type {kv_type!r} is not one of {sorted(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


def kv_row_shape(row: tuple[int, ...], kv_type: str) -> tuple[int, ...]:
    """Stored shape of one position's K (or V) row of logical shape ``row`` = (n_kv, head_dim).

    Raises ValueError for an unknown type, or "q8_0" with a head_dim that is not a multiple of 32.
    """
    kv_dtype(kv_type)
    if kv_type != "q8_0":
        return tuple(row)
    if row[-1] % Q8_BLOCK:
        raise ValueError(f"KV type q8_0 needs a head_dim that is a multiple of {Q8_BLOCK}, not {row[-1]}")
    return (*row[:-1], row[-1] // Q8_BLOCK * Q8_BYTES)


def kv_row_bytes(row: tuple[int, ...], kv_type: str) -> int:
    """Bytes of one stored row of logical shape ``row`` (Q8_0: 34 per 32 values)."""
    return int(np.prod(kv_row_shape(row, kv_type))) * kv_dtype(kv_type).itemsize


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of float32 rows x (..., hd), hd a multiple of 32 -> uint8 (..., hd / 32 * 34).

    Per block: amax = max |x| (NaN ignored), d = half(amax / 127) (float32 division, then round to
    nearest even), q = clamp(round_half_away(x / d), -127, 127) with the float32 quotient by the stored
    half (0 where d is 0 or the quotient NaN). Every step is one IEEE operation or exact, so the C writer
    (native/cpu/runtime/step.c q8_0_row) gives the same bytes. Design: docs/design/kv-cache.md.
    """
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)
    amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=np.float32(0))
    d = (amax / np.float32(127)).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = blocks / df
    r = np.floor(np.abs(y).astype(np.float64) + 0.5)                 # round half away from zero, exactly
    ok = (df > 0) & ~np.isnan(y)
    q = np.where(ok, np.copysign(np.minimum(np.where(ok, r, 0), 127), y), 0).astype(np.int8)
    out = np.empty(blocks.shape[:-1], _Q8)
    out["d"], out["q"] = d, q
    return out.view(np.uint8).reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK * Q8_BYTES)


def dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    """float32 values of Q8_0 rows b (..., nb * 34) uint8 -> (..., nb * 32): d * q, exact."""
    b = np.ascontiguousarray(b, dtype=np.uint8)
    blocks = b.reshape(*b.shape[:-1], b.shape[-1] // Q8_BYTES, Q8_BYTES).view(_Q8)[..., 0]
    out = blocks["d"].astype(np.float32)[..., None] * blocks["q"].astype(np.float32)
    return out.reshape(*b.shape[:-1], b.shape[-1] // Q8_BYTES * Q8_BLOCK)


def kv_widen(rows: np.ndarray) -> np.ndarray:
    """float32 values of stored KV rows of any type (told apart by dtype: float32, float16, uint8 = Q8_0)."""
    if rows.dtype == np.uint8:
        return dequantize_q8_0(rows)
    return np.asarray(rows, dtype=np.float32)


def kv_store(cache: np.ndarray, start: int, rows: np.ndarray) -> None:
    """Write float32 rows (n, n_kv, hd) into ``cache[start:start + n]``, rounded to the cache's type (F16:
    to nearest even; Q8_0: :func:`quantize_q8_0`)."""
    cache[start:start + len(rows)] = quantize_q8_0(rows) if cache.dtype == np.uint8 else rows
