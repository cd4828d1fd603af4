"""The prompt layout of a MiniCPM-V 4.6 image, and its sequential positions.

Image k becomes ``<image_id>k</image_id><image> PAD*n0 </image>`` then one line of ``<slice> PAD*n </slice>``
per slice row (HF ``MiniCPMV4_6Processor``; llama.cpp ``MTMD_SLICE_TMPL_MINICPMV_2_6``). Positions are
sequential, so M-RoPE reduces to plain partial RoPE. Design: docs/design/vision-towers.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .preprocess import SlicePlan

Segment = str | int
"""A piece of an image's prompt layout: text (tokenized like any prompt text) or a count of pad tokens."""


def image_layout(plan: SlicePlan, image_id: int) -> list[Segment]:
    """The prompt layout of one image (module doc): text segments and pad-run lengths, in order; the pad
    runs are the pieces' token counts, overview first."""
    counts = plan.token_counts
    out: list[Segment] = [f"<image_id>{image_id}</image_id><image>", counts[0], "</image>"]
    if plan.grid is not None:
        rows, cols = plan.grid
        for r in range(rows):
            if r:
                out.append("\n")
            for c in range(cols):
                out += ["<slice>", counts[1 + r * cols + c], "</slice>"]
    merged: list[Segment] = []
    for seg in out:
        if isinstance(seg, str) and merged and isinstance(merged[-1], str):
            merged[-1] += seg
        else:
            merged.append(seg)
    return merged


def expand_layout(layout: list[Segment], tokenize: Callable[[str], list[int]],
                  pad_id: int) -> tuple[list[int], list[int]]:
    """Token ids of an image layout and the index of each pad run's first token.

    Args:
        layout: :func:`image_layout`'s segments. tokenize: text -> ids (special tokens matched verbatim).
        pad_id: the ``<|image_pad|>`` id (248056).

    Returns:
        (ids, starts): ``starts[i]`` is where piece i's ``n_i`` pads begin in ``ids``.
    """
    ids: list[int] = []
    starts: list[int] = []
    for seg in layout:
        if isinstance(seg, str):
            ids += tokenize(seg)
        else:
            starts.append(len(ids))
            ids += [pad_id] * seg
    return ids, starts


def sequential_positions(token_ids: Sequence[int] | np.ndarray, token_grids: Sequence, image_pad_id: int,
                         vision_start_id: int, start: int = 0) -> np.ndarray:
    """The (3, n) int64 positions of a prompt holding MiniCPM-V images: ``start + arange(n)`` in all three rows
    (the :class:`engine.registry.VisionArch` ``positions`` signature; the grids and ids do not matter here)."""
    n = len(token_ids)
    return np.repeat((start + np.arange(n, dtype=np.int64))[None, :], 3, axis=0)
