"""Qwen3.5/3.6's image preprocessing (Pillow + numpy): the resize, the normalisation and the patch rows.

The steps after :func:`engine.vision.images.open_image` (decode, EXIF orientation, RGB) are those of HF
``Qwen2VLImageProcessorPil`` (the processor Qwen3.5/3.6 checkpoints name), ``docs/spec/qwen3vl.md`` section 2:

1. :func:`smart_resize` to multiples of ``patch * merge`` = 32 within [min_pixels, max_pixels], Python
   rounding (half to even) as HF; Pillow bicubic, exactly what the HF PIL processor calls;
2. ``x = (p/255 - mean) / std`` in the same float steps as HF (float64 rescale, float32 normalise);
3. patches of ``(c, t, ky, kx)`` with the still frame repeated over ``t``, rows in merge-window order.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from engine.errors import ImageError
from engine.vision.images import (MAX_ASPECT, MAX_INPUT_PIXELS, ImageSource, PreparedImage, check_shape, open_image,
                                  read_source)

MIN_PIXELS = 65536
"""HF ``preprocessor_config.json`` ``size.shortest_edge`` for Qwen3.5/3.6 (256x256 at least)."""

MAX_PIXELS = 16777216
"""HF ``size.longest_edge`` for Qwen3.5/3.6 (4096x4096 at most, i.e. 16384 image tokens)."""


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
        ImageError: an empty image or an aspect ratio above :data:`engine.vision.images.MAX_ASPECT`.
        ValueError: inconsistent bounds.
    """
    if not factor * factor <= min_pixels <= max_pixels:
        raise ValueError(f"pixel bounds must satisfy {factor}^2 <= min_pixels <= max_pixels, "
                         f"got min {min_pixels}, max {max_pixels}")
    check_shape(height, width)
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
        max_input_pixels: decode guard, see :func:`engine.vision.images.open_image`.

    Returns:
        :class:`PreparedImage` (its ``size`` is the size actually used, for the app to show).

    Raises:
        ImageError: see :func:`engine.vision.images.open_image` and :func:`smart_resize`; messages name the source.
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
