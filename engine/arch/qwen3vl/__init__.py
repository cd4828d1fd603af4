"""The Qwen3.5 / Qwen3.6 vision tower (mmproj ``clip.projector_type`` = ``qwen3vl_merger``): a ViT over
16-pixel patches with a learned, bilinearly interpolated position table and 2-D rotary attention, then a
2x2 merger MLP to the text model's width; its image tokens get M-RoPE (t, h, w) positions.

The folder holds the projector file format (:mod:`.mmproj`), the image resize and patch rows
(:mod:`.preprocess`), the numpy tower (:mod:`.tower`), the GPU
tower (:mod:`.cuda`) and the prompt positions (:mod:`.positions`). :data:`ARCH` is what
:mod:`engine.registry` hands out.
"""

from __future__ import annotations

from typing import Any

from engine.registry import VisionArch

from .mmproj import Mmproj, mmproj_from_header
from .positions import mrope_positions
from .preprocess import MIN_PIXELS, max_resized_pixels
from .tower import VisionTower


def _cuda_tower(mm: Mmproj, max_pixels: int, budget_bytes: int | None) -> Any:
    """The GPU tower, with activation buffers for the most patches an image can have under ``max_pixels``
    narrowed by the projector's own bound (:meth:`.mmproj.VisionHParams.pixel_bounds`;
    :func:`.preprocess.max_resized_pixels`: a very elongated image can exceed the area bound).

    Raises:
        DeviceError: no GPU, pycuda or nvcc, or the weights and buffers do not fit ``budget_bytes``.
    """
    from .cuda import CudaVisionTower
    hp = mm.hparams
    # below factor**2 every encode fails anyway
    min_px, max_px = hp.pixel_bounds(MIN_PIXELS, max(max_pixels, hp.factor ** 2))
    reserve = max_resized_pixels(hp.factor, min_px, max_px) // hp.patch_size ** 2
    return CudaVisionTower(mm, reserve_patches=reserve, budget_bytes=budget_bytes)


ARCH = VisionArch(name="qwen3vl", load=mmproj_from_header, cpu_tower=VisionTower, cuda_tower=_cuda_tower,
                  positions=mrope_positions)
