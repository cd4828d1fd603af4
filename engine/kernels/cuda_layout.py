"""What a weight and a device buffer look like to the CUDA kernels, whatever the architecture: the storage
types the GEMM kernels read, buffer alignment, the grouped-GEMM tile height and :class:`Matrix`.

Free of CUDA, so the planning that uses it is testable on any machine. Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from engine.errors import DeviceError
from engine.gguf.quant import TYPES, row_bytes

Q = GGMLQuantizationType

GPU_TYPES = frozenset(t for t, traits in TYPES.items() if traits.cuda_suffix is not None)
"""Storage types the GEMM kernels (native/cuda/gemm.cu) read directly (the quant-type table's
``cuda_suffix``); weights of other types (a Q4_K_M file's Q4_K / Q6_K) are converted to Q8_0 on the host
at load, resident matrices (:func:`gemm_matrix`) and routed experts alike (F32 would take about four
times the VRAM and, for streamed experts, the PCIe time)."""

ALIGN = 256
"""Every device buffer starts on this many bytes."""

TILE_ROWS = 32
"""Rows of one grouped-GEMM M tile (BM of qgemm32_* in gemm.cu): each expert's rows are cut into tiles
of this size (a 947-token prompt gives 256 experts ~30 rows each, so 64-row tiles would be half empty)."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (the bytes a device buffer of n bytes occupies)."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Matrix:
    """A GEMM weight as it will live on the GPU.

    Attributes:
        name: GGUF tensor name.
        qtype: storage type on the GPU (the file's type, or Q8_0 when converted on the host).
        rows, cols: math shape (OUT, IN).
        row_bytes: bytes of one stored row.
        converted: True when the file's type has no kernel and the host converts it to Q8_0.
    """

    name: str
    qtype: GGMLQuantizationType
    rows: int
    cols: int
    row_bytes: int
    converted: bool

    @property
    def nbytes(self) -> int:
        """Bytes on the GPU."""
        return self.rows * self.row_bytes


def gemm_matrix(name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Matrix:
    """The :class:`Matrix` for a 2-D tensor of ``shape`` (OUT, IN) stored as ``qtype``: kept in that type
    when a GEMM kernel reads it, else laid out as Q8_0 (rounding at most max|w| / 254 per 32 weights, ~1/16
    of a 4-bit step; the native CPU kernels convert types they cannot read the same way).

    Raises:
        DeviceError: IN is not a multiple of 32 (the kernels read whole 32-value blocks).
    """
    rows, cols = int(shape[0]), int(shape[-1])
    if cols % 32:
        raise DeviceError(f"tensor {name}: {cols} input columns are not a multiple of 32, which the GPU GEMM needs")
    if qtype in GPU_TYPES:
        return Matrix(name, qtype, rows, cols, row_bytes(qtype, cols), False)
    return Matrix(name, Q.Q8_0, rows, cols, row_bytes(Q.Q8_0, cols), True)

