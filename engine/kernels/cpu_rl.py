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

from engine.kernels import cpu_q4il
from engine.kernels.cpu import _native_cpu

Q = GGMLQuantizationType
_NATIVE = {Q.Q2_K: ("dd_q2_k_rl_pack", "dd_q2_k_rl_unpack", "DD_Q2_K_RL_MAX_ROW_BYTES"),
           Q.Q3_K: ("dd_q3_k_rl_pack", "dd_q3_k_rl_unpack", "DD_Q3_K_RL_MAX_ROW_BYTES")}
MAX_ROW_BYTES = {t: getattr(_native_cpu.lib, names[2]) if _native_cpu is not None else 0
                 for t, names in _NATIVE.items()}
"""The longest rows the layout takes per type (deltadesk_cpu.h's DD_Q2_K_RL_MAX_ROW_BYTES, k of 49,920;
DD_Q3_K_RL_MAX_ROW_BYTES, k of 37,888); 0 without the native kernels."""
TYPES = tuple(_NATIVE)
"""The stored types that have the layout."""


def _permute(raw: np.ndarray, qtype: GGMLQuantizationType, inverse: bool) -> None:
    cpu_q4il.permute_rows(raw, qtype, inverse, _NATIVE, MAX_ROW_BYTES, "rows-as-lanes")


def pack(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """Rewrite rows of ``qtype`` (Q2_K or Q3_K) in place into the rows-as-lanes layout (one group of scratch).

    Args: raw (rows, k // 256 * 84 or 110) uint8, C-contiguous and writable.
    Raises ValueError for another type, shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, qtype, False)


def unpack(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """The inverse of :func:`pack`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, qtype, True)
