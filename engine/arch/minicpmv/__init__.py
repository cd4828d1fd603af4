"""MiniCPM-V 4.6 vision (``clip.projector_type = "minicpmv4_6"``): a SigLIP2 tower with a window-attention merger,
on the dense Qwen3.5 text model (GGUF ``qwen35``).

- :mod:`.mmproj`: the llama.cpp projector layout (keys, tensors), validated reading, random-weight writing;
- :mod:`.preprocess`: HF ``MiniCPMV4_6ImageProcessorPil`` (resize, slicing, patches, position buckets,
  image-token counts);
- :mod:`.tower`: the float32 forward (16x and 4x modes; native kernels on AVX-512, numpy otherwise) and
  :class:`.tower.PiecesTower`, the :class:`engine.registry.VisionTower` the engine's image encoder drives;
- :mod:`.packing`: the projection weights packed for the native GEMM;
- :mod:`.layout`: the prompt layout of an image (slice rows) and the sequential positions.

The facts are taken from HF transformers ``models/minicpmv4_6/`` (``modeling_minicpmv4_6.py``,
``image_processing_pil_minicpmv4_6.py``, ``processing_minicpmv4_6.py``, ``configuration_minicpmv4_6.py``,
``vision_utils.py``) and llama.cpp PR #22529 (``tools/mtmd/models/minicpmv.cpp``
``clip_graph_minicpmv4_6``, ``conversion/minicpm.py`` ``MiniCPMV4_6VisionModel``); ``docs/minicpmv.md``
summarises them. :data:`ARCH` is what :mod:`engine.registry` hands out.
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
