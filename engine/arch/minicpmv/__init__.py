"""MiniCPM-V 4.6 vision (``clip.projector_type = "minicpmv4_6"``): a SigLIP2 tower with a window-attention
merger, on the dense Qwen3.5 text model (GGUF ``qwen35``).

Modules: ``mmproj`` (file layout), ``preprocess`` (HF image processor), ``tower`` (forward,
``PiecesTower``), ``packing`` (native GEMM weights), ``layout`` (prompt layout, positions).
:data:`ARCH` is what :mod:`engine.registry` hands out. Design: docs/design/vision-towers.md (sources).
"""

from __future__ import annotations

from typing import Any

from engine.errors import DeviceError
from engine.registry import VisionArch

from .layout import Segment, image_layout, sequential_positions
from .mmproj import MiniCPMVMmproj, mmproj_from_header
from .tower import PiecesTower


def _cuda_tower(mm: MiniCPMVMmproj, max_pixels: int, budget_bytes: int | None) -> Any:
    """No GPU tower yet: images are encoded on the CPU (the engine shows "No GPU vision tower (not written yet for
    MiniCPM-V 4.6): images are encoded on the CPU")."""
    raise DeviceError("not written yet for MiniCPM-V 4.6")


def _layout(tower: PiecesTower, image: Any, index: int) -> list[Segment]:
    """The prompt layout of encoded image ``index`` (:func:`.layout.image_layout`), its plan recomputed from the
    image's original size (the plan is a function of it)."""
    return image_layout(tower.plan(*image.original_size), index)


ARCH = VisionArch(name="minicpmv", load=mmproj_from_header, cpu_tower=PiecesTower, cuda_tower=_cuda_tower,
                  positions=sequential_positions, layout=_layout)
