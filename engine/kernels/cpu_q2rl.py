"""Q2_K matrices in the 4-row rows-as-lanes layout: the repack in place and its inverse.

The layout (native/cpu/deltadesk_cpu.h, ``dd_q2_k_rl_pack``): each group of 4 rows keeps its bytes; super-block j
of the group's rows is 336 bytes, four 64-byte chunks (chunk c, dword 4 g + r: row r's qs dword 4 g + c), the 64
scale bytes in the order the kernel pairs them, the 4 d and the 4 dmin. Rows past the last multiple of 4 stay
row-major. A :class:`engine.kernels.cpu.Matrix` built with ``interleaved=True`` multiplies by such rows (the native
type ``DD_Q2_K_RL``: the AVX-512 VNNI level's kernel reads the groups directly, one column at a time, the other
levels unpack them into a scratch) with the bits of the row-major matrix.
Design: docs/design/quant-formats.md, "Q2_K and Q3_K decode on AVX-512".
"""

from __future__ import annotations

import numpy as np

from engine.kernels.cpu import _check, _native_cpu, _ptr

Q2_K_BYTES = 84
MAX_ROW_BYTES = _native_cpu.lib.DD_Q2_K_RL_MAX_ROW_BYTES if _native_cpu is not None else 0
"""The longest rows the layout takes (deltadesk_cpu.h's DD_Q2_K_RL_MAX_ROW_BYTES); 0 without the native kernels."""


def _q2_k_rows(raw: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected Q2_K rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % Q2_K_BYTES:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole Q2_K super-blocks of {Q2_K_BYTES} bytes")
    if _native_cpu is None:
        raise ValueError(f"{what}: the native CPU kernels are not built")
    if raw.shape[1] > MAX_ROW_BYTES:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are longer than the layout takes ({MAX_ROW_BYTES})")
    if not raw.flags.c_contiguous or not raw.flags.writeable:
        raise ValueError(f"{what}: the rows must be C-contiguous and writable to be repacked in place")
    return raw


def _permute(raw: np.ndarray, fn_name: str) -> None:
    raw = _q2_k_rows(raw, fn_name)
    fn = getattr(_native_cpu.lib, fn_name)
    _check(fn(_ptr(_native_cpu.ffi, "uint8_t *", raw), raw.shape[0], raw.shape[1]), fn_name)


def pack_q2_k(raw: np.ndarray) -> None:
    """Rewrite Q2_K rows in place into the rows-as-lanes layout (no second copy: one group of scratch).

    Args: raw (rows, k // 256 * 84) uint8, C-contiguous and writable.
    Raises ValueError for another shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, "dd_q2_k_rl_pack")


def unpack_q2_k(raw: np.ndarray) -> None:
    """The inverse of :func:`pack_q2_k`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, "dd_q2_k_rl_unpack")
