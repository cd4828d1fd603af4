"""Q4_0 and Q4_K matrices in the 8-row interleaved layouts: the repack in place and its inverse.

The layouts (native/cpu/deltadesk_cpu.h, ``dd_q4_0_interleave`` and ``dd_q4_k_interleave``): each stripe of 8 rows
keeps its bytes; a block (Q4_0) or super-block (Q4_K) of the stripe's rows holds the 8 rows' scales together,
then their quant bytes 4 at a time, the 8 rows' runs side by side. Rows past the last multiple of 8 stay
row-major. A :class:`engine.kernels.cpu.Matrix` built with ``interleaved=True`` multiplies by such rows (the native
types ``DD_Q4_0_IL`` and ``DD_Q4_K_IL``: the AVX-512 VNNI level's GEMV reads the stripes directly, other products
de-interleave them into a scratch) with the bits of the row-major matrix.
Design: docs/design/q4-0-row-interleave.md, docs/design/q4-k-row-interleave.md.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels.cpu import _check, _native_cpu, _ptr

Q = GGMLQuantizationType
Q4_0_BYTES = 18
MAX_ROW_BYTES = _native_cpu.lib.DD_Q4_0_IL_MAX_ROW_BYTES if _native_cpu is not None else 0
"""The longest Q4_0 rows the layout takes (deltadesk_cpu.h's DD_Q4_0_IL_MAX_ROW_BYTES); 0 without the native kernels."""
MAX_ROW_BYTES_BY_TYPE = {Q.Q4_0: MAX_ROW_BYTES,
                         Q.Q4_K: _native_cpu.lib.DD_Q4_K_IL_MAX_ROW_BYTES if _native_cpu is not None else 0}
"""The longest rows each interleaved layout takes (deltadesk_cpu.h); 0 without the native kernels."""


def _rows(raw: np.ndarray, qtype: GGMLQuantizationType, what: str) -> np.ndarray:
    block, limit = quant.TYPES[qtype].block_bytes, MAX_ROW_BYTES_BY_TYPE[qtype]
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected {qtype.name} rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % block:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole {qtype.name} blocks of {block} bytes")
    if _native_cpu is not None and raw.shape[1] > limit:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are longer than the layout takes ({limit})")
    if not raw.flags.c_contiguous or not raw.flags.writeable:
        raise ValueError(f"{what}: the rows must be C-contiguous and writable to be repacked in place")
    if _native_cpu is None:
        raise ValueError(f"{what}: the native CPU kernels are not built")
    return raw


def _permute(raw: np.ndarray, qtype: GGMLQuantizationType, fn_name: str) -> None:
    raw = _rows(raw, qtype, fn_name)
    fn = getattr(_native_cpu.lib, fn_name)
    _check(fn(_ptr(_native_cpu.ffi, "uint8_t *", raw), raw.shape[0], raw.shape[1]), fn_name)


def interleave_q4_0(raw: np.ndarray) -> None:
    """Rewrite Q4_0 rows in place into the interleaved layout (no second copy: one stripe of scratch).

    Args: raw (rows, k // 32 * 18) uint8, C-contiguous and writable.
    Raises ValueError for another shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, Q.Q4_0, "dd_q4_0_interleave")


def deinterleave_q4_0(raw: np.ndarray) -> None:
    """The inverse of :func:`interleave_q4_0`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, Q.Q4_0, "dd_q4_0_deinterleave")


def interleave_q4_k(raw: np.ndarray) -> None:
    """Rewrite Q4_K rows in place into the interleaved layout (no second copy: one stripe of scratch).

    Args: raw (rows, k // 256 * 144) uint8, C-contiguous and writable.
    Raises ValueError for another shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, Q.Q4_K, "dd_q4_k_interleave")


def deinterleave_q4_k(raw: np.ndarray) -> None:
    """The inverse of :func:`interleave_q4_k`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, Q.Q4_K, "dd_q4_k_deinterleave")


INTERLEAVE = {Q.Q4_0: interleave_q4_0, Q.Q4_K: interleave_q4_k}
"""The in-place repack of each type with an interleaved layout."""
