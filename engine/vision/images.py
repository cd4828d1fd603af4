"""Image loading and preprocessing for the Qwen3.5/3.6 vision tower (Pillow + numpy).

HF ``Qwen2VLImageProcessorPil``'s steps (``docs/spec/qwen3vl.md`` section 2): safe decode (pixel count
checked before decoding; bad files raise :class:`~engine.errors.ImageError`), EXIF orientation, RGB
uint8, :func:`smart_resize` to multiples of 32, normalise, patches in merge-window order. The content
digest (SHA-256) keys the embedding and prefix caches. Design: docs/design/vision-towers.md.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageError
from ..gguf.regular import MAX_IMAGE_FILE_BYTES, FileRefused, read_regular

MIN_PIXELS = 65536
"""HF ``preprocessor_config.json`` ``size.shortest_edge`` for Qwen3.5/3.6 (256x256 at least)."""

MAX_PIXELS = 16777216
"""HF ``size.longest_edge`` for Qwen3.5/3.6 (4096x4096 at most, i.e. 16384 image tokens)."""

MAX_INPUT_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
"""Largest image (width x height of the file) decoded at all: Pillow's own bomb threshold (~89.5 MP,
about 270 MB as RGB). Larger files are refused from their header, before decoding."""

MAX_ASPECT = 200
"""Largest long/short side ratio the processor accepts (HF ``smart_resize``)."""



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


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor`` near the input aspect ratio, area in range.

    HF ``smart_resize`` (section 2.1): round each side to a multiple of ``factor`` (Python ``round``, ties
    to even); if the area exceeds ``max_pixels`` scale down with floor, if below ``min_pixels`` scale up
    with ceil. A side is never below ``factor`` (HF could return 0 only for ``min_pixels`` <= 0).

    Args:
        height, width: input size in pixels (>= 1).
        factor: patch size x merge size (32).
        min_pixels, max_pixels: area bounds in pixels, ``factor**2 <= min_pixels <= max_pixels``.

    Returns:
        (height, width) in pixels.

    Raises:
        ImageError: an empty image or an aspect ratio above :data:`MAX_ASPECT`.
        ValueError: inconsistent bounds.
    """
    if not factor * factor <= min_pixels <= max_pixels:
        raise ValueError(f"pixel bounds must satisfy {factor}^2 <= min_pixels <= max_pixels, "
                         f"got min {min_pixels}, max {max_pixels}")
    if height < 1 or width < 1:
        raise ImageError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"image of {width}x{height} pixels is too elongated: aspect ratio "
                         f"{max(height, width) / min(height, width):.0f}:1, at most {MAX_ASPECT}:1 is supported")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return max(factor, h), max(factor, w)


def max_resized_pixels(factor: int = 32, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """The largest area :func:`smart_resize` returns for these bounds over every accepted input, pixels.

    It can exceed ``max_pixels``: a side below ``factor`` is raised to it after the scale-down, and the
    scale-up (ceil on both sides) can overshoot. Both results depend only on the aspect ratio r = long / short
    (1 <= r <= :data:`MAX_ASPECT`), and each is a product of a long-side step function (non-decreasing in r)
    and a short-side one (non-increasing), so the maximum sits at the steps of the long side:
    long = k*factor from r = (k*factor)^2 / max_pixels on (scale-down, short side floor(max_pixels /
    (k*factor^2)) factors, at least 1), and (k+1)*factor just above r = (k*factor)^2 / min_pixels (scale-up,
    short side ceil(min_pixels / (k*factor^2)) factors). Exact integer arithmetic; an upper bound that inputs
    of the worst aspect ratio reach.

    Args:
        factor, min_pixels, max_pixels: as :func:`smart_resize` (``factor**2 <= min_pixels <= max_pixels``).

    Returns:
        The bound in pixels, a multiple of ``factor**2``.
    """
    best = max_pixels // factor ** 2
    for k in range(1, math.isqrt(MAX_ASPECT * max_pixels) // factor + 1):
        if (k * factor) ** 2 >= max_pixels:
            best = max(best, k * max(1, max_pixels // (k * factor ** 2)))
        if min_pixels <= (k * factor) ** 2 < MAX_ASPECT * min_pixels:
            best = max(best, (k + 1) * -(-min_pixels // (k * factor ** 2)))
    square = -(-(math.isqrt(min_pixels - 1) + 1) // factor)  # ceil(sqrt(min_pixels) / factor): r = 1, scale-up
    return max(best, square * square) * factor ** 2


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


def patchify(rgb: np.ndarray, patch: int, merge: int, temporal: int,
             mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """Normalise an RGB image and cut it into patch rows in merge-window order (section 2.2-2.5).

    Args:
        rgb: (h, w, 3) uint8 with h, w multiples of ``patch * merge``.
        patch, merge, temporal: 16, 2, 2 for Qwen3.5/3.6.
        mean, std: per channel (0.5 each).

    Returns:
        (gh*gw, 3*temporal*patch*patch) float32; row ``((bh*(gw/m)+bw)*m+dy)*m+dx`` is the patch at
        (bh*m+dy, bw*m+dx); within a row index ``((c*T + t)*P + ky)*P + kx``, the frame repeated over t.
    """
    h, w, c = rgb.shape
    gh, gw = h // patch, w // patch
    x = (rgb.astype(np.float64) * (1.0 / 255.0)).astype(np.float32)
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    x = x.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)                      # (bh, bw, dy, dx, c, ky, kx)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(x, dtype=np.float32).reshape(gh * gw, c * temporal * patch * patch)


def prepare_image(source: ImageSource, *, patch: int = 16, merge: int = 2, temporal: int = 2,
                  mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
                  min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                  max_input_pixels: int = MAX_INPUT_PIXELS) -> PreparedImage:
    """Decode, orient, convert, resize, normalise and patchify one image for the tower.

    Args:
        source: path, file bytes, :class:`ImageData` or Pillow image.
        patch, merge, temporal, mean, std: the tower's (``VisionHParams`` fields of the same names).
        min_pixels, max_pixels: area bounds of the resized image (user-settable maximum; lower it to
            bound CPU time, each 1024 pixels being one image token).
        max_input_pixels: decode guard, see :func:`open_image`.

    Returns:
        :class:`PreparedImage` (its ``size`` is the size actually used, for the app to show).

    Raises:
        ImageError: see :func:`open_image` and :func:`smart_resize`; messages name the source.
        ValueError: inconsistent pixel bounds.
    """
    src = read_source(source)
    name = src.name
    im, digest = open_image(src, max_input_pixels)
    factor = patch * merge
    original = (im.height, im.width)
    try:
        h, w = smart_resize(im.height, im.width, factor, min_pixels, max_pixels)
    except ImageError as e:
        raise ImageError(f"{name}: {e}") from e
    if (h, w) != (im.height, im.width):
        im = im.resize((w, h), Image.Resampling.BICUBIC)
    pixels = patchify(np.asarray(im, dtype=np.uint8), patch, merge, temporal, mean, std)
    return PreparedImage(pixel_values=pixels, grid=(h // patch, w // patch), size=(h, w),
                         original_size=original,
                         digest=digest, source=name)
