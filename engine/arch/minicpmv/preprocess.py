"""MiniCPM-V 4.6 image preprocessing: HF ``MiniCPMV4_6ImageProcessorPil`` in Pillow + numpy.

An image becomes an overview and, by area, a grid of slices, each resized (bicubic) to a multiple of
the alignment, normalised and cut into patch rows in raster order; position ids are the exact buckets
``(G * i) // n`` of the ``G x G`` table. Design: docs/design/vision-towers.md (the steps and sources).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from engine.errors import ImageError
from engine.vision.images import MAX_INPUT_PIXELS, ImageSource, check_shape, open_image, read_source

MODES = ("16x", "4x")
"""Downsampling modes: ``"16x"`` (window-attention merger + final merger, the released default) or ``"4x"``
(final merger only, 4 times the tokens)."""


def merge_factor(mode: str) -> int:
    """Patches per token side: 4 in 16x mode (two 2x2 merges), 2 in 4x mode.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"downsample mode {mode!r} is not one of {MODES}")
    return 4 if mode == "16x" else 2


def ensure_divide(length: float, divisor: int) -> int:
    """``max(round(length / divisor) * divisor, divisor)``: the nearest positive multiple (ties to even)."""
    return max(round(length / divisor) * divisor, divisor)


def best_resize(height: float, width: float, scale: int, align: int, allow_upscale: bool) -> tuple[int, int]:
    """HF ``find_best_resize``: (height, width) in pixels, multiples of ``align``, about ``scale**2`` in area when
    the input is larger or ``allow_upscale`` is set, else the input rounded to the alignment."""
    if height * width > scale * scale or allow_upscale:
        ratio = width / height
        height = int(scale / math.sqrt(ratio))
        width = int(height * ratio)
    return ensure_divide(height, align), ensure_divide(width, align)


def slice_grid(height: int, width: int, scale: int, max_slices: int) -> tuple[int, int] | None:
    """HF ``get_sliced_grid``: the (rows, cols) grid an image is cut into, or None when it is not sliced."""
    log_ratio = math.log(width / height)
    multiple = min(math.ceil(width * height / (scale * scale)), max_slices)
    if multiple <= 1:
        return None
    best, best_err = (1, 1), math.inf
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slices:
            continue
        for rows in range(1, n + 1):
            if n % rows:
                continue
            err = abs(log_ratio - math.log((n // rows) / rows))
            if err < best_err or (err == best_err and rows > best[0]):
                best, best_err = (rows, n // rows), err
    return best


@dataclass(frozen=True)
class SlicePlan:
    """How one image is cut into pieces.

    Attributes:
        overview: (height, width) pixels of the whole-image piece.
        grid: (rows, cols) of the slices, or None (the overview is the only piece).
        slice_size: (height, width) pixels of every slice, or None.
        mode: ``"16x"`` or ``"4x"``.
        patch: patch size in pixels.
    """

    overview: tuple[int, int]
    grid: tuple[int, int] | None
    slice_size: tuple[int, int] | None
    mode: str
    patch: int

    @property
    def piece_sizes(self) -> list[tuple[int, int]]:
        """(height, width) pixels of every piece in prompt order: the overview, then the slices row-major."""
        if self.grid is None or self.slice_size is None:
            return [self.overview]
        return [self.overview] + [self.slice_size] * (self.grid[0] * self.grid[1])

    @property
    def piece_grids(self) -> list[tuple[int, int]]:
        """(rows, cols) patch grid of every piece."""
        return [(h // self.patch, w // self.patch) for h, w in self.piece_sizes]

    @property
    def token_counts(self) -> list[int]:
        """Image tokens of every piece: its patches divided by ``merge_factor(mode)**2``."""
        f = merge_factor(self.mode) ** 2
        return [gh * gw // f for gh, gw in self.piece_grids]


def plan_slices(height: int, width: int, *, scale: int = 448, max_slices: int = 9, patch: int = 14,
                mode: str = "16x") -> SlicePlan:
    """The pieces HF's processor makes of a ``height x width`` image (module doc, steps 2-5).

    Args:
        height, width: the (EXIF-oriented) input size in pixels.
        scale: slice resolution (``clip.vision.image_size``, 448). max_slices: 9. patch: 14.
        mode: ``"16x"`` or ``"4x"`` (the alignment is ``patch * merge_factor(mode)``).

    Returns:
        :class:`SlicePlan`; e.g. 448x448 -> one 448x448 piece (64 tokens), 768x1024 (h x w) -> a 392x504
        overview and 2x2 slices of 392x504 (5 x 63 = 315 tokens).

    Raises:
        ImageError: an empty image or an aspect ratio above :data:`engine.vision.images.MAX_ASPECT`.
        ValueError: an unknown mode.
    """
    align = patch * merge_factor(mode)
    check_shape(height, width)
    grid = slice_grid(height, width, scale, max_slices)
    overview = best_resize(height, width, scale, align, allow_upscale=grid is None)
    if grid is None:
        return SlicePlan(overview, None, None, mode, patch)
    rows, cols = grid
    sh, sw = best_resize(ensure_divide(height, rows) / rows, ensure_divide(width, cols) / cols, scale, align,
                         allow_upscale=True)
    return SlicePlan(overview, grid, (sh, sw), mode, patch)


def bucket_position_ids(gh: int, gw: int, side: int = 70) -> np.ndarray:
    """Position-table rows of a (gh, gw) patch grid in raster order, with the exact bucket ``(side*i)//n``
    (module doc).

    Returns:
        (gh*gw,) int64, values in ``[0, side*side)``.
    """
    rows = (side * np.arange(gh, dtype=np.int64)) // gh
    cols = (side * np.arange(gw, dtype=np.int64)) // gw
    return (rows[:, None] * side + cols[None, :]).reshape(-1)


def patchify(rgb: np.ndarray, patch: int, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """Normalise an RGB piece and cut it into patch rows in raster order (module doc, steps 6-7).

    Args:
        rgb: (h, w, 3) uint8, h and w multiples of ``patch``.
        mean, std: per channel (0.5 each).

    Returns:
        (gh*gw, 3*patch*patch) float32; row ``r*gw + c`` is the patch at (r, c), values ``(ch, ky, kx)``.
    """
    h, w, c = rgb.shape
    x = (rgb.astype(np.float64) * (1.0 / 255.0)).astype(np.float32)
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    x = x.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 4, 1, 3)   # (r, c, ch, ky, kx)
    return np.ascontiguousarray(x).reshape((h // patch) * (w // patch), c * patch * patch)


@dataclass(frozen=True)
class PreparedPieces:
    """One image ready for the tower.

    Attributes:
        pieces: per piece, (gh*gw, 3*P*P) float32 patch rows in raster order (overview first).
        plan: the :class:`SlicePlan` (piece sizes, grid, token counts).
        original_size: (height, width) after EXIF rotation, before resizing.
        digest: SHA-256 hex of the source content (:func:`engine.vision.images.read_source`).
    """

    pieces: list[np.ndarray]
    plan: SlicePlan
    original_size: tuple[int, int]
    digest: str


def _resize(im: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """(h, w, 3) uint8 of ``im`` resized to ``size`` = (h, w) with Pillow bicubic (HF's PIL backend)."""
    h, w = size
    if (im.height, im.width) != (h, w):
        im = im.resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(im, dtype=np.uint8)


def prepare_pieces(source: ImageSource, *, scale: int = 448, max_slices: int = 9, patch: int = 14,
                   mode: str = "16x", mean: tuple[float, ...] = (0.5, 0.5, 0.5),
                   std: tuple[float, ...] = (0.5, 0.5, 0.5),
                   max_input_pixels: int = MAX_INPUT_PIXELS) -> PreparedPieces:
    """Decode, orient, convert, slice, resize, normalise and patchify one image (module doc).

    Args:
        source: path, file bytes, :class:`~engine.vision.images.ImageData` or Pillow image.
        scale, max_slices, patch, mode: see :func:`plan_slices`. mean, std: the file's.
        max_input_pixels: decode guard (:func:`engine.vision.images.open_image`).

    Returns:
        :class:`PreparedPieces`.

    Raises:
        ImageError: unreadable, empty, too large or too elongated image; the message names the source.
        ValueError: an unknown mode.
    """
    src = read_source(source)
    im, digest = open_image(src, max_input_pixels)
    try:
        plan = plan_slices(im.height, im.width, scale=scale, max_slices=max_slices, patch=patch, mode=mode)
    except ImageError as e:
        raise ImageError(f"{src.name}: {e}") from e
    pieces = [patchify(_resize(im, plan.overview), patch, mean, std)]
    if plan.grid is not None:
        (rows, cols), (sh, sw) = plan.grid, plan.slice_size
        whole = _resize(im, (rows * sh, cols * sw))
        pieces += [patchify(whole[r * sh:(r + 1) * sh, c * sw:(c + 1) * sw], patch, mean, std)
                   for r in range(rows) for c in range(cols)]
    return PreparedPieces(pieces, plan, (im.height, im.width), digest)
