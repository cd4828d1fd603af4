"""Q4_0 matrices in the 8-row interleaved layout: the repack in place, its inverse, and the GEMV that reads it.

The layout (native/cpu/deltadesk_cpu.h, ``dd_q4_0_interleave``): each stripe of 8 rows keeps its bytes; block b
of the stripe's rows is 144 bytes, the 8 f16 scales, then for each 4-byte run q of the 16 nibble bytes the 8
rows' runs side by side. Rows past the last multiple of 8 stay row-major. Only the AVX-512 VNNI level has the
interleaved GEMV; it gives the bits of :func:`engine.kernels.cpu.matmul` on the row-major matrix at that level.
Design: docs/design/q4-0-row-interleave.md.
"""

from __future__ import annotations

import numpy as np

from engine.errors import EngineError
from engine.kernels import cpu
from engine.kernels.cpu import _check, _native_cpu, _ptr

Q4_0_BYTES = 18
IL_ROWS = 8


def _q4_0_rows(raw: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected Q4_0 rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % Q4_0_BYTES:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole Q4_0 blocks of {Q4_0_BYTES} bytes")
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


def matvec_q4_0_il(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = W x for W interleaved by :func:`interleave_q4_0`, on the pool's threads.

    Args: raw (rows, k // 32 * 18) uint8, C-contiguous; x (k,) float32 activations (quantized to Q8_0).
    Returns (rows,) float32: the bits of ``cpu.matmul`` on the row-major rows at the avx512vnni level.
    Raises ValueError for bad shapes; EngineError when the active ISA level has no interleaved kernel.
    """
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
        raise ValueError("matvec_q4_0_il: expected C-contiguous Q4_0 rows as a 2-D uint8 array")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size % 32 or raw.shape[1] != x.size // 32 * Q4_0_BYTES:
        raise ValueError(f"matvec_q4_0_il: x of shape {x.shape} does not fit rows of {raw.shape[1]} Q4_0 bytes")
    level = cpu.isa()
    if _native_cpu is None or level == "numpy":
        raise EngineError("matvec_q4_0_il: the interleaved layout needs the native avx512vnni level")
    y = np.empty(raw.shape[0], dtype=np.float32)
    ffi = _native_cpu.ffi
    _check(_native_cpu.lib.dd_matvec_q4_0_il(cpu.ISA_LEVELS.index(level), _ptr(ffi, "uint8_t *", raw), raw.shape[0],
                                             x.size, _ptr(ffi, "float *", x), _ptr(ffi, "float *", y)),
           "matvec_q4_0_il")
    return y
