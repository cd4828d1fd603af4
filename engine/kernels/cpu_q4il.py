"""Q4_0 matrices in the 8-row interleaved layout: the repack in place and its inverse.

The layout (native/cpu/deltadesk_cpu.h, ``dd_q4_0_interleave``): each stripe of 8 rows keeps its bytes; block b
of the stripe's rows is 144 bytes, the 8 f16 scales, then for each 4-byte run q of the 16 nibble bytes the 8
rows' runs side by side. Rows past the last multiple of 8 stay row-major. A :class:`engine.kernels.cpu.Matrix`
built with ``interleaved=True`` multiplies by such rows (the native type ``DD_Q4_0_IL``: the AVX-512 VNNI
level's GEMV reads the stripes directly, every other product de-interleaves them into a scratch) with the bits
of the row-major matrix.
Design: docs/design/q4-0-row-interleave.md.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.cpu import _check, _native_cpu, _ptr

Q4_0_BYTES = 18
MAX_ROW_BYTES = _native_cpu.lib.DD_Q4_0_IL_MAX_ROW_BYTES if _native_cpu is not None else 0
"""The longest rows the layout takes (deltadesk_cpu.h's DD_Q4_0_IL_MAX_ROW_BYTES); 0 without the native kernels."""


def _q4_0_rows(raw: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected Q4_0 rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % Q4_0_BYTES:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole Q4_0 blocks of {Q4_0_BYTES} bytes")
    if _native_cpu is not None and raw.shape[1] > MAX_ROW_BYTES:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are longer than the layout takes ({MAX_ROW_BYTES})")
    if not raw.flags.c_contiguous or not raw.flags.writeable:
        raise ValueError(f"{what}: the rows must be C-contiguous and writable to be repacked in place")
    if _native_cpu is None:
        raise ValueError(f"{what}: the native CPU kernels are not built")
    return raw


def _permute(raw: np.ndarray, fn_name: str) -> None:
    raw = _q4_0_rows(raw, fn_name)
    fn = getattr(_native_cpu.lib, fn_name)
    _check(fn(_ptr(_native_cpu.ffi, "uint8_t *", raw), raw.shape[0], raw.shape[1]), fn_name)


def interleave_q4_0(raw: np.ndarray) -> None:
    """Rewrite Q4_0 rows in place into the interleaved layout (no second copy: one stripe of scratch).

    Args: raw (rows, k // 32 * 18) uint8, C-contiguous and writable.
    Raises ValueError for another shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, "dd_q4_0_interleave")


def deinterleave_q4_0(raw: np.ndarray) -> None:
    """The inverse of :func:`interleave_q4_0`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, "dd_q4_0_deinterleave")
