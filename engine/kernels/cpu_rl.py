"""Q2_K and Q3_K matrices in the 4-row rows-as-lanes layouts: the repack in place and its inverse.

The layouts (native/cpu/deltadesk_cpu.h, ``dd_q2_k_rl_pack``, ``dd_q3_k_rl_pack``): each group of 4 rows keeps its
bytes; super-block j of the group's rows holds four 64-byte qs chunks (chunk c, dword 4 g + r: row r's qs dword
4 g + c), Q3_K's hmask dwords in the same order (4 chunks of 32 bytes), the scales in the order the kernel pairs
them (Q3_K's 6-bit ones as low nibbles and top bits), the 4 d (and Q2_K's 4 dmin). Rows past the last multiple of 4
stay row-major. A :class:`engine.kernels.cpu.Matrix` built with ``interleaved=True`` multiplies by such rows (the
native types ``DD_Q2_K_RL``, ``DD_Q3_K_RL``: the AVX-512 VNNI level's kernel reads the groups directly, one column
at a time, the other levels unpack them into a scratch) with the bits of the row-major matrix.
Design: docs/design/quant-formats.md, "Q2_K and Q3_K decode on AVX-512".
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels.cpu import _check, _native_cpu, _ptr

Q = GGMLQuantizationType
_NATIVE = {Q.Q2_K: ("dd_q2_k_rl_pack", "dd_q2_k_rl_unpack", "DD_Q2_K_RL_MAX_ROW_BYTES"),
           Q.Q3_K: ("dd_q3_k_rl_pack", "dd_q3_k_rl_unpack", "DD_Q3_K_RL_MAX_ROW_BYTES")}
MAX_ROW_BYTES = {t: getattr(_native_cpu.lib, names[2]) if _native_cpu is not None else 0
                 for t, names in _NATIVE.items()}
"""The longest rows the layout takes per type (deltadesk_cpu.h's DD_Q2_K_RL_MAX_ROW_BYTES, k of 49,920;
DD_Q3_K_RL_MAX_ROW_BYTES, k of 37,888); 0 without the native kernels."""
TYPES = tuple(_NATIVE)
"""The stored types that have the layout."""


def _rows(raw: np.ndarray, qtype: GGMLQuantizationType, what: str) -> np.ndarray:
    if qtype not in _NATIVE:
        raise ValueError(f"{what}: {qtype.name} has no rows-as-lanes layout (only {', '.join(t.name for t in TYPES)})")
    name, block = qtype.name, quant.TYPES[qtype].block_bytes
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected {name} rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % block:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole {name} super-blocks of {block} bytes")
    if _native_cpu is None:
        raise ValueError(f"{what}: the native CPU kernels are not built")
    if raw.shape[1] > MAX_ROW_BYTES[qtype]:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are longer than the layout takes "
                         f"({MAX_ROW_BYTES[qtype]})")
    if not raw.flags.c_contiguous or not raw.flags.writeable:
        raise ValueError(f"{what}: the rows must be C-contiguous and writable to be repacked in place")
    return raw


def _permute(raw: np.ndarray, qtype: GGMLQuantizationType, inverse: bool) -> None:
    fn_name = _NATIVE[qtype][int(inverse)] if qtype in _NATIVE else "rows-as-lanes repack"
    raw = _rows(raw, qtype, fn_name)
    fn = getattr(_native_cpu.lib, fn_name)
    _check(fn(_ptr(_native_cpu.ffi, "uint8_t *", raw), raw.shape[0], raw.shape[1]), fn_name)


def pack(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """Rewrite rows of ``qtype`` (Q2_K or Q3_K) in place into the rows-as-lanes layout (one group of scratch).

    Args: raw (rows, k // 256 * 84 or 110) uint8, C-contiguous and writable.
    Raises ValueError for another type, shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, qtype, False)


def unpack(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """The inverse of :func:`pack`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, qtype, True)
