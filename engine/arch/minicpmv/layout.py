"""MiniCPM-V 4.6 images for the prompt: preprocess + tower + an embedding cache, and the prompt layout.

Layout (HF ``MiniCPMV4_6Processor.replace_image_token`` and ``_prepend_local_ids``; llama.cpp
``MTMD_SLICE_TMPL_MINICPMV_2_6``): image k of a prompt (k from 0, counted over the whole prompt text as HF
counts per sample) becomes

    <image_id>k</image_id><image> PAD*n0 </image>                           the overview
    <slice> PAD*n1 </slice><slice> PAD*n2 </slice> ... \\n <slice> ...       one line per slice row, no trailing \\n

with PAD = ``<|image_pad|>`` and n_i the tokens of piece i (:attr:`SlicePlan.token_counts`). Each run of pads
takes its piece's embedding rows in order. Positions are sequential for every token (t = h = w = p), so
Qwen3.5's interleaved M-RoPE reduces to plain partial RoPE (HF's default ``mrope_mode``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ...images import MAX_INPUT_PIXELS, ImageSource, read_source
from ...models.vision import EmbeddingCache
from .mmproj import MiniCPMVMmproj
from .preprocess import SlicePlan, plan_slices, prepare_pieces
from .tower import MiniCPMVTower

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


def expand_layout(layout: list[Segment], tokenize: Callable[[str], list[int]], pad_id: int) -> tuple[list[int], list[int]]:
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


def expand_prompt(ids: list[int], pad_id: int, images: list["EncodedPieces"],
                  tokenize: Callable[[str], list[int]]) -> tuple[list[int], list[tuple[int, np.ndarray, bytes]]]:
    """Replace each single ``pad_id`` placeholder of a rendered prompt by image k's layout (module doc).

    Args:
        ids: the rendered prompt, one ``pad_id`` per image. pad_id: ``<|image_pad|>``.
        images: the encoded images, in order. tokenize: text -> ids for the layout's text.

    Returns:
        (tokens, spans): the expanded ids and, per piece of every image, (index of its first pad, its
        (n_i, out_dim) rows, the image's :attr:`EncodedPieces.key`), the spans the runtime splices in.

    Raises:
        ValueError: the prompt holds a different number of placeholders than ``images``.
    """
    n_placeholders = sum(1 for t in ids if t == pad_id)
    if n_placeholders != len(images):
        raise ValueError(f"the prompt has {n_placeholders} image placeholders for {len(images)} images")
    tokens: list[int] = []
    spans: list[tuple[int, np.ndarray, bytes]] = []
    k = 0
    for t in ids:
        if t != pad_id:
            tokens.append(t)
            continue
        img = images[k]
        layout_ids, starts = expand_layout(image_layout(img.plan, k), tokenize, pad_id)
        spans += [(len(tokens) + s, e, img.key) for s, e in zip(starts, img.piece_embeddings(), strict=True)]
        tokens += layout_ids
        k += 1
    return tokens, spans


@dataclass(frozen=True)
class EncodedPieces:
    """One image encoded for the prompt.

    Attributes:
        embeddings: (n_tokens, out_dim) float32, read-only: the rows of every piece in prompt order (overview
            first; piece i has ``plan.token_counts[i]`` rows, see :meth:`piece_embeddings`).
        plan: how the image was cut (:class:`SlicePlan`: sizes, grid, token counts).
        original_size: (height, width) of the (EXIF-rotated) input.
        digest: SHA-256 hex of the image content.
        key: what the image contributes to a prefix-cache key (tower identity, digest, mode), 16 bytes.
        from_cache: the embeddings came from the cache. seconds: wall time of the call.
    """

    embeddings: np.ndarray
    plan: SlicePlan
    original_size: tuple[int, int]
    digest: str
    key: bytes
    from_cache: bool
    seconds: float

    @property
    def n_tokens(self) -> int:
        """Image-pad tokens of all pieces."""
        return int(self.embeddings.shape[0])

    def piece_embeddings(self) -> list[np.ndarray]:
        """Views of :attr:`embeddings`, one (n_i, out_dim) array per piece."""
        return np.split(self.embeddings, np.cumsum(self.plan.token_counts)[:-1])


class MiniCPMVImageEncoder:
    """Preprocess + tower + cache: what the engine calls for each image of a prompt.

    Args:
        mm: the loaded projector. threads: BLAS threads of the tower. mode: ``"16x"`` / ``"4x"`` / None (the file's).
        cache_bytes: embedding bytes kept (LRU). max_input_pixels: decode guard (:func:`engine.images.open_image`).
    """

    def __init__(self, mm: MiniCPMVMmproj, threads: int | None = None, mode: str | None = None,
                 cache_bytes: int = 256 << 20, max_input_pixels: int = MAX_INPUT_PIXELS):
        self.tower = MiniCPMVTower(mm, threads, mode)
        self.hp = mm.hparams
        self.max_input_pixels = int(max_input_pixels)
        self.cache = EmbeddingCache(cache_bytes)

    def plan(self, height: int, width: int) -> SlicePlan:
        """How an image of ``height x width`` pixels is cut (its :attr:`SlicePlan.token_counts`)."""
        return plan_slices(height, width, scale=self.hp.image_size, max_slices=self.hp.max_slices,
                           patch=self.hp.patch_size, mode=self.tower.mode)

    def encode(self, source: ImageSource, cancel: threading.Event | None = None) -> EncodedPieces:
        """Encode one image, from the cache when the same content was encoded by the same tower and mode.

        Raises:
            ImageError: bad image (:func:`engine.arch.minicpmv.preprocess.prepare_pieces`).
            GenerationCancelled: ``cancel`` was set (checked before every tower block).
        """
        t0 = time.perf_counter()
        src = read_source(source)
        key = (self.tower.identity, src.digest, self.tower.mode)
        hit = self.cache.get(key)
        if hit is not None:
            return replace(hit, from_cache=True, seconds=time.perf_counter() - t0)
        hp = self.hp
        prep = prepare_pieces(src, scale=hp.image_size, max_slices=hp.max_slices, patch=hp.patch_size,
                              mode=self.tower.mode, mean=hp.image_mean, std=hp.image_std,
                              max_input_pixels=self.max_input_pixels)
        emb = np.concatenate(self.tower.encode(prep.pieces, prep.plan.piece_grids, cancel=cancel))
        emb.flags.writeable = False
        digest = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
        item = EncodedPieces(emb, prep.plan, prep.original_size, prep.digest, digest, False,
                             time.perf_counter() - t0)
        self.cache.put(key, item)
        return item
