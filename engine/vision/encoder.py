"""Images for the prompt, whatever the tower: preprocessing through the tower, GPU/CPU routing and an
embedding cache. One image in, ``(n_tokens, out_dim)`` LLM-width embeddings out.

The tower (picked by :mod:`engine.registry` from the projector's ``clip.projector_type``) owns the
architecture's facts: the resize bounds, the preprocessing into patch rows, the forward, and the
grid of image tokens its output fills.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import DeviceBudgetError, DeviceError, GenerationCancelled
from .images import MAX_INPUT_PIXELS, ImageInfo, ImageSource, read_source
from ..registry import LoadedVision, VisionArch, VisionTower

log = logging.getLogger(__name__)

DEFAULT_MIN_PIXELS = 256 * 256
"""Smallest area an image is resized to unless the caller says otherwise, pixels (a tower narrows it)."""

DEFAULT_MAX_PIXELS = 4096 * 4096
"""Largest area an image is resized to unless the caller says otherwise, pixels (a tower narrows it)."""


class EmbeddingCache:
    """LRU cache of encoded images bounded by the bytes of their embeddings.

    Keys are tuples (projector identity, content digest, min_pixels, max_pixels): an image's
    embeddings are a function of exactly these. Not thread-safe; the engine thread owns it.

    Args:
        max_bytes: total embedding bytes kept; least recently used entries are dropped beyond it.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[tuple, EncodedImage] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Embedding bytes held now."""
        return self._bytes

    def get(self, key: tuple) -> EncodedImage | None:
        """The entry for ``key`` (marked most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: tuple, item: EncodedImage) -> None:
        """Store ``item`` under ``key``; an item larger than ``max_bytes`` is not kept."""
        if key in self._items:
            self._bytes -= self._items.pop(key).embeddings.nbytes
        if item.embeddings.nbytes > self.max_bytes:
            return
        self._items[key] = item
        self._bytes += item.embeddings.nbytes
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.embeddings.nbytes


@dataclass(frozen=True)
class EncodedImage:
    """One image encoded for the prompt.

    Attributes:
        embeddings: (n_tokens, out_dim) float32, read-only; row k replaces the k-th image-pad token.
        grid: (rows, cols) of image tokens (:meth:`engine.registry.VisionTower.token_grid`);
            ``rows * cols == n_tokens``; the text architecture's positions read it.
        size: (height, width) pixels the tower saw (after the resize).
        original_size: (height, width) pixels of the (EXIF-rotated) input.
        digest: SHA-256 hex of the image content, for the prefix-cache key.
        from_cache: True when the embeddings came from the cache (no decoding, no encoding).
        seconds: wall time of the call that returned this.
    """

    embeddings: np.ndarray
    grid: tuple[int, int]
    size: tuple[int, int]
    original_size: tuple[int, int]
    digest: str
    from_cache: bool
    seconds: float

    @property
    def n_tokens(self) -> int:
        """Number of image-pad tokens this image takes."""
        return int(self.embeddings.shape[0])


class ImageEncoder:
    """Preprocess + tower + cache: what the runtime calls for each image of a prompt.

    Images are encoded by ``gpu`` when one is given; the first :class:`~engine.errors.DeviceError` it
    raises closes it, and that image and every later one are encoded by the CPU tower
    (``device_note`` says why, and the failure is logged as a warning). A
    :class:`~engine.errors.DeviceBudgetError` (an image too large for the tower's VRAM budget) sends only
    that image to the CPU, with a logged warning; the GPU tower stays.

    Args:
        vision: the opened projector and its family (:func:`engine.registry.open_projector`).
        min_pixels, max_pixels: default area bounds of the resized image (HF's by default; lower
            ``max_pixels`` to bound CPU time: for Qwen3.5/3.6 S = pixels / 256 patches, attention cost ~ S^2),
            narrowed by the projector's own (:meth:`engine.registry.VisionTower.pixel_bounds`).
        cache_bytes: embedding cache size.
        max_input_pixels: decode guard (see :func:`engine.vision.images.open_image`).
        gpu: a GPU tower of the same projector with ``encode(pixel_values, grid) -> (n, out_dim) float32``
            and ``close()`` (:class:`engine.arch.qwen3vl.cuda.CudaVisionTower`), or None for the CPU.
        device_note: why images are encoded on the CPU although a GPU was looked for, or "".
    """

    def __init__(self, vision: LoadedVision, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS,
                 cache_bytes: int = 256 << 20, max_input_pixels: int = MAX_INPUT_PIXELS, gpu: Any = None,
                 device_note: str = ""):
        self.arch: VisionArch = vision.arch
        self.tower: VisionTower = self.arch.cpu_tower(vision.projector)
        self.gpu = gpu
        self.device_note = device_note
        self._asked_min_pixels = int(min_pixels)
        self.min_pixels, self.max_pixels = self.tower.pixel_bounds(min_pixels, max_pixels)
        self.max_input_pixels = int(max_input_pixels)
        self.cache = EmbeddingCache(cache_bytes)

    @property
    def device(self) -> str:
        """Where the next image is encoded: "cuda" or "cpu"."""
        return "cpu" if self.gpu is None else "cuda"

    def close(self) -> None:
        """Release the GPU tower (device and pinned memory); later images are encoded on the CPU. A failure
        to release it (a broken CUDA context) is logged, not raised."""
        gpu, self.gpu = self.gpu, None
        if gpu is None:
            return
        try:
            gpu.close()
        except Exception as exc:  # noqa: BLE001 - a broken CUDA context must not end the CPU fallback
            log.warning("releasing the GPU vision tower: %s", exc)

    def _gpu_failed(self, message: str) -> None:
        """The GPU tower failed: release it and encode on the CPU from now on."""
        self.device_note = f"GPU vision tower failed, encoding images on the CPU: {message}"
        log.warning(self.device_note)
        self.close()

    def _run_tower(self, pixel_values: np.ndarray, grid: tuple[int, int],
                   cancel: threading.Event | None) -> np.ndarray:
        """(n, out_dim) float32 embeddings from the GPU tower, or the CPU tower when there is none or it fails."""
        if self.gpu is not None:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("image encoding cancelled")
            try:
                return self.gpu.encode(pixel_values, grid)
            except DeviceBudgetError as exc:
                log.warning("encoding a %dx%d-patch image on the CPU: %s", grid[0], grid[1], exc)
            except DeviceError as exc:
                self._gpu_failed(str(exc))
        return self.tower.encode(pixel_values, grid, cancel=cancel)

    def encode(self, source: ImageSource, max_pixels: int | None = None,
               cancel: threading.Event | None = None) -> EncodedImage:
        """Encode one image, from the cache when the same content was encoded with the same bounds.

        Args:
            source: file path, file bytes, :class:`~engine.vision.images.ImageData` or Pillow image.
            max_pixels: overrides the default area bound for this image, within the projector's own
                (``min_pixels`` is lowered to it when above).
            cancel: checked between tower blocks on the CPU; on the GPU only before the image (one launch sequence).

        Returns:
            :class:`EncodedImage`.

        Raises:
            ImageError: bad image (see :meth:`engine.registry.VisionTower.prepare`).
            GenerationCancelled: ``cancel`` was set.
            ValueError: ``max_pixels`` below ``factor**2`` (1024).
        """
        t0 = time.perf_counter()
        tower = self.tower
        min_px, max_px = tower.pixel_bounds(self._asked_min_pixels,
                                            self.max_pixels if max_pixels is None else max_pixels)
        src = read_source(source)
        key = (tower.identity, src.digest, min_px, max_px)
        hit = self.cache.get(key)
        if hit is not None:
            return replace(hit, from_cache=True, seconds=time.perf_counter() - t0)
        prep = tower.prepare(src, min_px, max_px, self.max_input_pixels)
        emb = self._run_tower(prep.pixel_values, prep.grid, cancel)
        emb.flags.writeable = False
        item = EncodedImage(emb, tower.token_grid(prep.grid), prep.size, prep.original_size, prep.digest, False,
                            time.perf_counter() - t0)
        self.cache.put(key, item)
        return item

    def image_info(self, source: ImageSource) -> ImageInfo:
        """The (height, width) in pixels ``source`` has when it reaches the tower under the default bounds,
        and the image tokens (embedding rows) it becomes: the tower's
        :meth:`~engine.registry.VisionTower.token_grid` of its patch grid, rows x cols. One preparation.

        Raises:
            ImageError: unreadable image (see :meth:`engine.registry.VisionTower.prepare`).
        """
        prepared = self.tower.prepare(source, min(self.min_pixels, self.max_pixels), self.max_pixels,
                                      self.max_input_pixels)
        rows, cols = self.tower.token_grid(prepared.grid)
        height, width = prepared.size
        return ImageInfo(height, width, rows * cols, prepared.pieces)
