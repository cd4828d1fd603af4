"""M-RoPE positions of a prompt that holds Qwen3.5/3.6 images (HF ``get_rope_index`` of Qwen3-VL / Qwen3.5)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(token_ids: Sequence[int] | np.ndarray, image_grids: Sequence[tuple[int, int]],
                    image_pad_id: int, vision_start_id: int, start: int = 0) -> np.ndarray:
    """M-RoPE (t, h, w) positions of a token sequence holding whole images (HF ``get_rope_index``).

    Text token: (p, p, p), p + 1 per token. An image whose first pad token would be at P, merged grid
    H' x W' (row-major pads): token (i, j) at (P, P + i, P + j); the token after it gets
    P + max(H', W') (docs/spec/qwen3vl.md section 6). The next position after the sequence
    (for decoding or the next chunk) is ``positions.max() + 1``.

    Args:
        token_ids: (n,) ints. Every run of ``image_pad_id`` must directly follow ``vision_start_id``
            and hold exactly the tokens of its image.
        image_grids: merged (rows, cols) per image, in order of appearance.
        image_pad_id: ``<|image_pad|>`` (248056). vision_start_id: ``<|vision_start|>`` (248053).
        start: position of the first token (the next position of the previous chunk).

    Returns:
        (3, n) int64: rows t, h, w.

    Raises:
        ValueError: a pad run without a preceding vision-start token, a run whose length is not
            rows*cols of its grid, or a number of runs different from ``len(image_grids)``.
    """
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = ids.size
    out = np.empty((3, n), dtype=np.int64)
    is_pad = ids == image_pad_id
    pos, i, img = int(start), 0, 0
    while i < n:
        if not is_pad[i]:
            j = i
            while j < n and not is_pad[j]:
                j += 1
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
            i = j
            continue
        if i == 0 or ids[i - 1] != vision_start_id:
            raise ValueError(f"image-pad token at index {i} does not follow a vision-start token")
        if img >= len(image_grids):
            raise ValueError(f"more image-pad runs than the {len(image_grids)} image grids given")
        rows, cols = (int(x) for x in image_grids[img])
        j = i + rows * cols
        if j > n or not is_pad[i:j].all() or (j < n and is_pad[j]):
            raise ValueError(f"image {img} (grid {rows}x{cols}) needs a run of exactly {rows * cols} "
                             f"image-pad tokens at index {i}")
        r, c = np.divmod(np.arange(rows * cols), cols)
        out[0, i:j] = pos
        out[1, i:j] = pos + r
        out[2, i:j] = pos + c
        pos += max(rows, cols)
        img += 1
        i = j
    if img != len(image_grids):
        raise ValueError(f"{len(image_grids)} image grids given but {img} image-pad runs found")
    return out
