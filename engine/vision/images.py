"""Reading images for any vision tower (Pillow + numpy): the family-free steps before a tower's own resize.

Safe decode (the pixel count is checked before any pixel is decoded; truncated or unreadable files raise
:class:`~engine.errors.ImageError`; an animated file gives its first frame), EXIF orientation, any mode to
RGB uint8, and :func:`check_shape` (no empty or too elongated image). The families' resize and patching
live in their folders (e.g. :mod:`engine.arch.qwen3vl.preprocess`). The content digest (SHA-256) keys the
embedding and prefix caches. Design: docs/design/vision-towers.md.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageError
from ..gguf.regular import MAX_IMAGE_FILE_BYTES, FileRefused, read_regular

MAX_INPUT_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
"""Largest image (width x height of the file) decoded at all: Pillow's own bomb threshold (~89.5 MP,
about 270 MB as RGB). Larger files are refused from their header, before decoding."""

MAX_ASPECT = 200
"""Largest long/short side ratio accepted (HF ``smart_resize``'s bound, which the towers share)."""


@dataclass(frozen=True)
class ImageData:
    """An image source read into memory, with its content digest (see :func:`read_source`).

    Attributes:
        data: the encoded file bytes, or a decoded Pillow image.
        name: printable name for messages (the path, ``"<bytes>"`` or ``"<image>"``).
        digest: SHA-256 hex of the file bytes, or of mode, size and pixels for a Pillow image.
    """

    data: bytes | Image.Image
    name: str
    digest: str


ImageSource = Union[str, os.PathLike, bytes, Image.Image, ImageData]
"""A path, the encoded file bytes, a decoded Pillow image, or an :class:`ImageData` already read."""


@dataclass(frozen=True)
class ImageInfo:
    """What one image becomes for a vision tower, from a single preparation of it.

    Attributes:
        height, width: pixels the image has when it reaches the tower (after the tower's resize; of the
            overview when the tower also reads slices).
        tokens: image tokens (embedding rows, all slices together) it takes in the prompt.
        pieces: images the tower reads: 1, or the overview plus its slices (MiniCPM-V 4.6).
    """

    height: int
    width: int
    tokens: int
    pieces: int = 1


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower.

    Attributes:
        pixel_values: (gh*gw, 3*T*P*P) float32, patches in merge-window order (HF ``pixel_values``).
        grid: (gh, gw) patch grid (HF ``image_grid_thw`` without the leading t = 1).
        size: (height, width) in pixels after the resize, what the tower sees.
        original_size: (height, width) after EXIF rotation, before resizing.
        digest: SHA-256 hex of the source content (see module doc).
        source: a printable name of the source (file path, ``"<bytes>"`` or ``"<image>"``).
        pieces: images in ``pixel_values``: 1, or the overview plus its slices (MiniCPM-V 4.6).
    """

    pixel_values: np.ndarray
    grid: tuple[int, int]
    size: tuple[int, int]
    original_size: tuple[int, int]
    digest: str
    source: str
    pieces: int = 1


def check_shape(height: int, width: int) -> None:
    """Refuse an image a tower cannot resize: no pixels, or a long/short side ratio above :data:`MAX_ASPECT`.

    Raises:
        ImageError: naming the size and, for an elongated image, its ratio and the limit.
    """
    if height < 1 or width < 1:
        raise ImageError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"image of {width}x{height} pixels is too elongated: aspect ratio "
                         f"{max(height, width) / min(height, width):.0f}:1, at most {MAX_ASPECT}:1 is supported")


def read_source(source: ImageSource) -> ImageData:
    """Read a source into memory once and compute its content digest; no decoding happens.

    Raises:
        ImageError: the file cannot be read (missing, no permission, not a regular file, over
            :data:`~engine.gguf.regular.MAX_IMAGE_FILE_BYTES`), naming it.
    """
    if isinstance(source, ImageData):
        return source
    if isinstance(source, Image.Image):
        h = hashlib.sha256(f"{source.mode}:{source.width}x{source.height}:".encode())
        h.update(source.tobytes())
        return ImageData(source, "<image>", h.hexdigest())
    if isinstance(source, (bytes, bytearray)):
        data, name = bytes(source), "<bytes>"
    else:
        name = str(source)
        try:
            data = read_regular(source, MAX_IMAGE_FILE_BYTES)
        except FileRefused as e:
            raise ImageError(f"{name}: the image file {e}") from None
        except OSError as e:
            raise ImageError(f"{name}: cannot read the file ({e.strerror or e})") from e
    return ImageData(data, name, hashlib.sha256(data).hexdigest())


def _scale_to_u8(a: np.ndarray, mode: str) -> np.ndarray:
    if mode.startswith("I;16"):
        scaled = a.astype(np.float64) / 257.0
    elif mode == "F":
        scaled = a.astype(np.float64) * (255.0 if np.nanmax(a, initial=0.0) <= 1.0 else 1.0)
    else:
        scaled = a.astype(np.float64) / (257.0 if a.max(initial=0) > 255 else 1.0)
    return np.clip(np.nan_to_num(np.rint(scaled)), 0, 255).astype(np.uint8)


_HIGH_DEPTH = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")


def to_rgb(im: Image.Image, source: str = "<image>") -> Image.Image:
    """Convert a decoded image of any Pillow mode to RGB, compositing transparency on white.

    ``P`` with a transparency entry, ``PA``, ``LA``, ``La``, ``RGBA``, ``RGBa``: alpha-composited on white.
    ``I;16*`` (16-bit PNG/TIFF greyscale): value / 257. ``I`` (32-bit): / 257 when any value exceeds 255.
    ``F``: x 255 when all values are <= 1, then clipped (a transparency key on these is ignored).
    ``LAB``: CIE L*a*b* -> sRGB through Pillow's colour management (ImageCms). ``CMYK``, ``YCbCr``,
    ``HSV``, ``1``, ``L``, ``P``: Pillow's conversion (an embedded ICC profile is not applied).

    Args:
        im: a decoded Pillow image. source: name used in error messages.

    Returns:
        An RGB image (``im`` itself when already RGB).

    Raises:
        ImageError: a mode Pillow cannot convert to RGB, naming ``source`` and the mode.
    """
    if im.mode == "RGB":
        return im
    try:
        if im.mode in _HIGH_DEPTH:
            return Image.fromarray(_scale_to_u8(np.asarray(im), im.mode)).convert("RGB")
        if im.mode == "LAB":
            from PIL import ImageCms

            lab_to_srgb = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"),
                                                  "LAB", "RGB")
            return ImageCms.applyTransform(im, lab_to_srgb)
        if "A" in im.getbands() or "a" in im.getbands() or im.info.get("transparency") is not None:
            if im.mode == "La":
                im = im.convert("LA")
            rgba = im.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return im.convert("RGB")
    except (ValueError, OSError, ImportError) as e:
        raise ImageError(f"{source}: images of Pillow mode {im.mode!r} cannot be converted to RGB ({e})") from e


def open_image(source: ImageSource, max_input_pixels: int = MAX_INPUT_PIXELS) -> tuple[Image.Image, str]:
    """Decode an image safely, apply its EXIF orientation and convert it to RGB.

    Args:
        source: a file path, the file's bytes, an :class:`ImageData`, or a Pillow image (used as
            is: no size guard).
        max_input_pixels: largest width x height decoded; checked from the header first.

    Returns:
        (RGB image, digest): the digest is the SHA-256 hex of the file bytes (path or bytes sources)
        or of mode, size and pixels (Pillow image sources).

    Raises:
        ImageError: unreadable file, not an image (e.g. a text file named ``.png``), more than
            ``max_input_pixels`` pixels, truncated or corrupt data, or an unconvertible mode. The
            message names the source and what was expected.
    """
    src = read_source(source)
    name, digest = src.name, src.digest
    im = src.data if isinstance(src.data, Image.Image) else _decode(src.data, name, max_input_pixels)
    try:
        im = ImageOps.exif_transpose(im)
    except (ValueError, OSError, SyntaxError, TypeError) as e:
        raise ImageError(f"{name}: the EXIF orientation data is corrupt ({e})") from e
    return to_rgb(im, name), digest


def _decode(data: bytes, name: str, max_input_pixels: int) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ImageError(f"{name}: image exceeds the limit of {max_input_pixels:,} pixels; refusing to decode "
                             f"it (possible decompression bomb; Pillow: {e}). Downscale it first.") from e
        except UnidentifiedImageError as e:
            suffix = Path(name).suffix.lower()
            named = f" despite its name ending in {suffix!r}" if suffix else ""
            raise ImageError(
                f"{name}: not an image Pillow can read{named}; expected PNG, JPEG, GIF, WebP, BMP or TIFF "
                f"data, the file starts with {data[:12]!r}") from e
        except (OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"{name}: corrupt image header ({e})") from e
        w, h = im.size
        if w * h > max_input_pixels:
            raise ImageError(
                f"{name}: image of {w}x{h} = {w * h:,} pixels exceeds the limit of {max_input_pixels:,} pixels; "
                "refusing to decode it (possible decompression bomb). Downscale it first.")
        if w < 1 or h < 1:
            raise ImageError(f"{name}: image of {w}x{h} pixels is empty")
        try:
            im.load()
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageError(f"{name}: truncated or corrupt {im.format or 'image'} data ({e})") from e
    return im
