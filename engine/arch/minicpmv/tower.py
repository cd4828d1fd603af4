"""The MiniCPM-V 4.6 vision tower in numpy float32: SigLIP2 blocks, the window-attention merger and the final
2x2 merger. One piece (the overview or one slice) in, ``(n_tokens, out_dim)`` LLM-width rows out.

Forward of one piece of ``gh x gw`` patches in raster order, S = gh*gw, D = ``n_embd`` (HF
``MiniCPMV4_6VisionModel`` / ``MiniCPMV4_6ViTWindowAttentionMerger`` / ``MiniCPMV4_6Merger`` in
``modeling_minicpmv4_6.py``; llama.cpp ``clip_graph_minicpmv4_6``)::

    h  = patches @ W_patch^T + b                                   patch_embd     (S, D)
    h += E_pos[bucket_position_ids(gh, gw)]                        embeddings     (no pre-LN, no RoPE)
    for il in 0 .. n_layer-1:                                      layer_out.il
        h += attn_out(MHA(LN1(h)))            full attention over the piece, scale 1/sqrt(d)
        h += fc2(gelu_tanh(fc1(LN2(h))))
        if 16x mode and il == insert_layer:                        vit_merger     (S/4, D)
            r = h;  u = LN_m1(h) in window order  (2x2 windows in raster order; inside one: (0,0) (0,1) (1,0) (1,1))
            x = r[window order] + attn_out_m(MHA_m(u))            attention only inside each 4-token window
            c = the 4 rows of each window side by side (4D);  mean = their average
            h = ds_ffn_down(gelu_tanh(ds_ffn_up(LN_ds(c)))) + mean     one row per window, windows in raster order
            gh, gw = gh/2, gw/2
    z   = LN_post(h)                                               post_ln
    z   = 2x2 concat of z on the (gh, gw) grid (same order)        (gh*gw/4, 4D)
    out = mm.down(gelu_erf(mm.up(LN_in(z))))                       merger_out     (gh*gw/4, out_dim)

In 4x mode the window-attention merger is skipped: all layers run at full resolution. GELU: tanh form in the
blocks and the window-attention merger (HF ``gelu_pytorch_tanh``), the exact erf form in the final merger (HF
``nn.GELU()``). Every norm is a LayerNorm with bias, eps from the file. Projections are float32 GEMMs on the
dequantized weights (:func:`engine.ops.vision_reference.linear`, the Qwen tower's path) with BLAS limited to
the threads handed in. Full attention (:func:`engine.ops.vision_reference.attention`) runs its heads split
over that many Python threads with BLAS single-threaded: its GEMMs are small (1024 x 72 x 1024 for a
448-pixel piece), and a threaded BLAS ran them about 10 times slower than one thread on a loaded 2-core
machine. Each head is computed the same way whatever the split, so the result does not depend on it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

from engine.errors import GenerationCancelled
from engine.images import ImageSource, PreparedImage, read_source
from engine.ops import vision_reference as ops

from .mmproj import MiniCPMVHParams, MiniCPMVMmproj
from .preprocess import SlicePlan, bucket_position_ids, merge_factor, plan_slices, prepare_pieces

StageCallback = Callable[[str, int, np.ndarray], None]
"""``cb(stage, il, x)``: sees each named intermediate (module doc); ``il`` is the block index or -1. ``x`` may be
a buffer that later stages overwrite: copy it to keep it."""


def window_order(gh: int, gw: int) -> np.ndarray:
    """Raster indices of a (gh, gw) grid in 2x2-window order: windows in raster order, inside each window
    (0,0), (0,1), (1,0), (1,1) (HF ``get_vision_window_index`` with window 2).

    Returns:
        (gh*gw,) int64 permutation; ``x[window_order(gh, gw)].reshape(-1, 4, D)`` groups the windows.
    """
    idx = np.arange(gh * gw).reshape(gh // 2, 2, gw // 2, 2)
    return idx.transpose(0, 2, 1, 3).reshape(-1)


def window_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int) -> np.ndarray:
    """Softmax attention inside groups of 4 consecutive rows (one 2x2 window each), per head.

    Args:
        q, k, v: (S, D) float32 with S a multiple of 4, heads of ``D / n_head`` side by side.

    Returns:
        (S, D) float32.
    """
    s, d = q.shape
    hd = d // n_head
    qw, kw, vw = (x.reshape(s // 4, 4, n_head, hd) for x in (q, k, v))
    scores = np.einsum("wihd,wjhd->whij", qw, kw) * np.float32(1.0 / np.sqrt(hd))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.einsum("whij,wjhd->wihd", scores, vw).reshape(s, d)


def merge_2x2(x: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """The 2x2 concat of the final merger: (gh*gw, D) raster rows -> (gh*gw/4, 4D), windows in raster order,
    each row the window's (0,0), (0,1), (1,0), (1,1) tokens side by side."""
    d = x.shape[1]
    return np.ascontiguousarray(x.reshape(gh // 2, 2, gw // 2, 2, d).transpose(0, 2, 1, 3, 4)).reshape(-1, 4 * d)


class MiniCPMVTower:
    """The tower of one projector file, float32 numpy, one piece per :meth:`encode_piece` call.

    Args:
        mm: a loaded :class:`~engine.arch.minicpmv.mmproj.MiniCPMVMmproj` (its float32 weights are used in place).
        threads: BLAS threads for the GEMMs (None: BLAS's own default).
        mode: ``"16x"`` or ``"4x"``; None = the file's (``clip.vision.projector.scale_factor``). HF allows
            either on the same weights (``downsample_mode``).

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mm: MiniCPMVMmproj, threads: int | None = None, mode: str | None = None):
        self.hp: MiniCPMVHParams = mm.hparams
        self.identity = mm.identity
        self.mode = self.hp.mode if mode is None else mode
        merge_factor(self.mode)
        self.threads = threads
        self._workers = max(1, threads or os.cpu_count() or 1)
        self._w = mm.weights
        self._patch_w = mm.weights["v.patch_embd.weight"].reshape(self.hp.n_embd, -1)

    @property
    def merge(self) -> int:
        """Patches per output token side (4 in 16x mode, 2 in 4x mode)."""
        return merge_factor(self.mode)

    def encode(self, pieces: list[np.ndarray], grids: list[tuple[int, int]], cb: StageCallback | None = None,
               cancel: threading.Event | None = None) -> list[np.ndarray]:
        """:meth:`encode_piece` for each piece of an image, each its own sequence (no attention across pieces)."""
        return [self.encode_piece(p, g, cb, cancel) for p, g in zip(pieces, grids, strict=True)]

    def encode_piece(self, pixel_values: np.ndarray, grid: tuple[int, int], cb: StageCallback | None = None,
                     cancel: threading.Event | None = None) -> np.ndarray:
        """Run the tower and both mergers on one piece (module doc).

        Args:
            pixel_values: (gh*gw, 3*P*P) float32 patch rows in raster order
                (:attr:`~engine.arch.minicpmv.preprocess.PreparedPieces.pieces`).
            grid: (gh, gw) patches, both multiples of :attr:`merge`.
            cb: optional stage callback (stage names in the module doc).
            cancel: checked before every block; when set, :class:`~engine.errors.GenerationCancelled` is raised.

        Returns:
            (gh*gw / merge**2, out_dim) float32, tokens in raster order of the merged grid.

        Raises:
            ValueError: ``pixel_values`` does not fit ``grid``, or a side is not a multiple of :attr:`merge`.
            GenerationCancelled: ``cancel`` was set.
        """
        hp, w = self.hp, self._w
        gh, gw = int(grid[0]), int(grid[1])
        if gh % self.merge or gw % self.merge or gh < 1 or gw < 1 or pixel_values.shape != (gh * gw, hp.patch_dim):
            raise ValueError(f"pixel_values {pixel_values.shape} do not fit grid {gh}x{gw} (expected "
                             f"({gh * gw}, {hp.patch_dim}), sides positive multiples of {self.merge})")
        emit = cb or (lambda stage, il, x: None)
        with (threadpool_limits(limits=self.threads, user_api="blas"),
              ThreadPoolExecutor(self._workers, thread_name_prefix="minicpmv") as pool):
            h = ops.linear(np.asarray(pixel_values, dtype=np.float32), self._patch_w, w["v.patch_embd.bias"])
            emit("patch_embd", -1, h)
            h += w["v.position_embd.weight"][bucket_position_ids(gh, gw, hp.pos_side)]
            emit("embeddings", -1, h)
            for il in range(hp.n_layer):
                if cancel is not None and cancel.is_set():
                    raise GenerationCancelled("image encoding cancelled")
                self._block(h, il, pool)
                emit("layer_out", il, h)
                if self.mode == "16x" and il == hp.insert_layer:
                    h = self._vit_merger(h, gh, gw)
                    gh, gw = gh // 2, gw // 2
                    emit("vit_merger", -1, h)
            z = self._norm(h, "v.post_ln")
            emit("post_ln", -1, z)
            z = self._norm(merge_2x2(z, gh, gw), "mm.input_norm")
            y = ops.gelu_erf(ops.linear(z, w["mm.up.weight"], w["mm.up.bias"]))
            out = ops.linear(y, w["mm.down.weight"], w["mm.down.bias"])
            emit("merger_out", -1, out)
        return out

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return ops.layer_norm(x, self._w[name + ".weight"], self._w[name + ".bias"], self.hp.eps)

    def _qkv(self, a: np.ndarray, p: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w = self._w
        return tuple(ops.linear(a, w[f"{p}attn_{x}.weight"], w[f"{p}attn_{x}.bias"]) for x in "qkv")

    def _block(self, h: np.ndarray, il: int, pool: ThreadPoolExecutor) -> None:
        """One SigLIP pre-norm block with full attention, updating the residual stream ``h`` (S, D) in place."""
        hp, w, p = self.hp, self._w, f"v.blk.{il}."
        s, hd = len(h), hp.head_dim
        q, k, v = (x.reshape(s, hp.n_head, hd) for x in self._qkv(self._norm(h, p + "ln1"), p))
        att = self._attention(q, k, v, pool)
        h += ops.linear(att, w[p + "attn_out.weight"], w[p + "attn_out.bias"])
        f = ops.gelu_tanh(ops.linear(self._norm(h, p + "ln2"), w[p + "ffn_up.weight"], w[p + "ffn_up.bias"]))
        h += ops.linear(f, w[p + "ffn_down.weight"], w[p + "ffn_down.bias"])

    def _attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, pool: ThreadPoolExecutor) -> np.ndarray:
        """Full attention, (S, H, d) each -> (S, H*d), heads split over ``pool`` with BLAS single-threaded."""
        s, n_head, hd = q.shape
        out = np.empty((s, n_head * hd), dtype=np.float32)
        groups = [g for g in np.array_split(np.arange(n_head), self._workers) if len(g)]

        def run(g: np.ndarray) -> None:
            h = slice(int(g[0]), int(g[-1]) + 1)
            ops.attention(q[:, h], k[:, h], v[:, h], out=out[:, h.start * hd:h.stop * hd])

        with threadpool_limits(limits=1, user_api="blas"):
            for f in [pool.submit(run, g) for g in groups]:
                f.result()
        return out

    def _vit_merger(self, h: np.ndarray, gh: int, gw: int) -> np.ndarray:
        """The window-attention merger: (gh*gw, D) raster rows -> (gh*gw/4, D), windows in raster order."""
        w, p, d = self._w, "v.vit_merger.", self.hp.n_embd
        order = window_order(gh, gw)
        q, k, v = self._qkv(self._norm(h, p + "ln1")[order], p)
        att = window_attention(q, k, v, self.hp.n_head)
        x = h[order] + ops.linear(att, w[p + "attn_out.weight"], w[p + "attn_out.bias"])
        wins = x.reshape(-1, 4, d)
        c = self._norm(x.reshape(-1, 4 * d), p + "ds_ln")
        f = ops.gelu_tanh(ops.linear(c, w[p + "ds_ffn_up.weight"], w[p + "ds_ffn_up.bias"]))
        return ops.linear(f, w[p + "ds_ffn_down.weight"], w[p + "ds_ffn_down.bias"]) + wins.mean(axis=1)


class PiecesTower:
    """The tower as :class:`engine.registry.VisionTower`, the interface :class:`engine.vision.ImageEncoder` uses:
    one prepared image holds all of its pieces.

    :meth:`prepare` concatenates the pieces' patch rows and gives as ``grid`` the tuple of their patch grids;
    :meth:`encode` runs each piece as its own sequence and concatenates their token rows (overview first);
    :meth:`token_grid` is ``(1, n_tokens)``: the text model's positions are sequential, and the prompt layout
    comes from :meth:`layout`.

    Args:
        mm: the loaded projector. threads, mode: as :class:`MiniCPMVTower`.
    """

    def __init__(self, mm: MiniCPMVMmproj, threads: int | None = None, mode: str | None = None):
        self.tower = MiniCPMVTower(mm, threads, mode)
        self.hp = mm.hparams
        self.identity = f"{mm.identity}:{self.tower.mode}"

    def pixel_bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The caller's bounds, unchanged (``min <= max``): MiniCPM-V sizes its pieces by its slicing rules
        (:func:`~engine.arch.minicpmv.preprocess.plan_slices`), not by an area bound."""
        return min(int(min_pixels), int(max_pixels)), int(max_pixels)

    def plan(self, height: int, width: int) -> SlicePlan:
        """How an image of ``height x width`` pixels is cut (:func:`~engine.arch.minicpmv.preprocess.plan_slices`
        with this file's slice size and patch and this tower's mode)."""
        return plan_slices(height, width, scale=self.hp.image_size, max_slices=self.hp.max_slices,
                           patch=self.hp.patch_size, mode=self.tower.mode)

    def prepare(self, source: ImageSource, min_pixels: int, max_pixels: int, max_input_pixels: int) -> PreparedImage:
        """Decode and cut one image: ``pixel_values`` (sum of S_i, 3*P*P) float32, ``grid`` the tuple of piece
        grids, ``size`` the overview's (height, width). Raises ImageError."""
        hp = self.hp
        src = read_source(source)
        prep = prepare_pieces(src, scale=hp.image_size, max_slices=hp.max_slices, patch=hp.patch_size,
                              mode=self.tower.mode, mean=hp.image_mean, std=hp.image_std,
                              max_input_pixels=max_input_pixels)
        return PreparedImage(np.concatenate(prep.pieces), tuple(prep.plan.piece_grids), prep.plan.overview,
                             prep.original_size, prep.digest, src.name)

    def token_grid(self, grid: tuple) -> tuple[int, int]:
        """``(1, n_tokens)`` of the piece grids ``grid``."""
        return 1, sum(gh * gw for gh, gw in grid) // self.tower.merge ** 2

    def encode(self, pixel_values: np.ndarray, grid: tuple, cb: StageCallback | None = None,
               cancel: threading.Event | None = None) -> np.ndarray:
        """(n_tokens, out_dim) float32: every piece of ``grid`` encoded on its own, rows concatenated.

        Raises:
            ValueError: ``pixel_values`` does not hold the pieces' patches. GenerationCancelled: ``cancel`` set.
        """
        sizes = [gh * gw for gh, gw in grid]
        if len(pixel_values) != sum(sizes):
            raise ValueError(f"pixel_values has {len(pixel_values)} rows; the pieces {list(grid)} hold {sum(sizes)}")
        pieces = np.split(pixel_values, np.cumsum(sizes)[:-1])
        return np.concatenate(self.tower.encode(pieces, list(grid), cb, cancel))
