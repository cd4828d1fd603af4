"""The MiniCPM-V 4.6 vision tower in numpy float32: SigLIP2 blocks, window-attention merger, 2x2 merger.

The pieces of one image (overview, then slices) in, per piece ``(n_tokens, out_dim)`` LLM-width rows
out (HF ``modeling_minicpmv4_6.py``; llama.cpp ``clip_graph_minicpmv4_6``). Projections, attention and
LayerNorm use :mod:`engine.kernels.sgemm` on AVX-512 CPUs, numpy tiles elsewhere.
Design: docs/design/vision-towers.md (the forward pass, step by step).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

from engine.errors import GenerationCancelled
from engine.vision.images import ImageSource, PreparedImage, read_source
from engine.kernels import sgemm
from engine.ops import vision_reference as ops

from .mmproj import MiniCPMVHParams, MiniCPMVMmproj
from .packing import pack_weights
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


TILE_ROWS = 512
"""Rows of one GEMM tile. Fixed, whatever the thread count: OpenBLAS's float32 GEMM
gives bits that depend on the shape of the call (a 1-row or 333-row call can round differently from a 256-row
one), so every call the tower makes has a shape set by the input alone."""

TILE_COLS = 1152
"""Widest GEMM tile in output columns. 512 x 1152 tiles (K = 1152 or 4304) ran 6-15 % faster than 256 x 576
ones on one core of the 2-core dev machine (thread CPU time; less packing per FLOP)."""

ROW_TASK = 128
"""Rows of one LayerNorm or window-attention task (a multiple of 4: no 2x2 window straddles two tasks)."""

MIN_TILES = 4
"""A GEMM is cut into at least this many tiles (narrower columns when it has few rows, e.g. the 256 rows of a
448-pixel piece after the window-attention merger), so that a few cores share even a small one."""


def _spans(n: int, step: int) -> list[slice]:
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _tiles(m: int, n: int) -> list[tuple[slice, slice]]:
    """The (rows, cols) tiles of an (m, n) GEMM output: a function of the shape only (:data:`TILE_ROWS`)."""
    rows = _spans(m, TILE_ROWS)
    n_cols = max(-(-n // TILE_COLS), -(-MIN_TILES // len(rows)))
    step = -(-n // (64 * n_cols)) * 64
    return [(r, c) for r in rows for c in _spans(n, step)]


class _Plan:
    """Row bookkeeping of a stack of pieces: ``starts[i]`` is the first row of piece ``i`` at full resolution,
    ``merged_starts[i]`` after the window-attention merger (16x mode) or the same (4x mode)."""

    def __init__(self, grids: list[tuple[int, int]], quarter: bool):
        sizes = [gh * gw for gh, gw in grids]
        self.grids = grids
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.merged_grids = [(gh // 2, gw // 2) for gh, gw in grids] if quarter else list(grids)
        self.merged_starts = self.starts // 4 if quarter else self.starts

    @staticmethod
    def _order(grids: list[tuple[int, int]], starts: np.ndarray) -> np.ndarray:
        return np.concatenate([window_order(gh, gw) + s for (gh, gw), s in zip(grids, starts[:-1], strict=True)])

    def window_order(self) -> np.ndarray:
        """Full-resolution rows of the whole stack in 2x2-window order, piece by piece."""
        return self._order(self.grids, self.starts)

    def merged_window_order(self) -> np.ndarray:
        """Rows after the window-attention merger in 2x2-window order (the final merger's grouping)."""
        return self._order(self.merged_grids, self.merged_starts)


class MiniCPMVTower:
    """The tower of one projector file, float32. :meth:`encode` runs all pieces of an image together.

    The pieces are stacked row-wise into one ``(sum S_i, D)`` residual stream, so every projection of every
    piece is one set of GEMM calls; attention stays per piece (no attention across pieces) and the mergers'
    2x2 windows are taken inside each piece. When :mod:`engine.kernels.sgemm` is available (AVX-512, checked at
    construction: :attr:`native`) every projection is one call of the native GEMM on weights packed at
    construction straight from the file's memory map (the panels are the only copy of the projections: about
    2.2 GB for the real tower, as the numpy path's float32 arrays; 4x mode leaves out the merger's), full
    attention one native call over all (piece, head) pairs, the window-attention merger's attention the same
    call with every 2x2 window a piece, and each LayerNorm one native call; all run on the native pool with at
    most ``threads`` threads and give the same bits at any thread count and for a piece alone or in a stack
    (no Python workers). Otherwise projections are fixed tiles (:data:`TILE_ROWS` x
    :data:`TILE_COLS` GEMM tiles, each with its bias add and activation applied while the tile is in cache)
    and full attention one (piece, head) pair per task. LayerNorm (:data:`ROW_TASK`-row tasks), the window
    attention and the numpy tiles run on ``threads`` Python workers, BLAS single-threaded inside each. numpy
    releases the GIL in GEMMs and ufuncs, so the workers run in parallel. Every tile is computed by the same
    calls whatever the thread count, so the result does not depend on it (bit for bit).

    Args:
        mm: a loaded :class:`~engine.arch.minicpmv.mmproj.MiniCPMVMmproj`: its vectors are used in place, its
            matrices packed (native) or dequantized to float32 (numpy) here; the tower keeps no view of the map.
        threads: worker threads (None: ``os.cpu_count()``).
        mode: ``"16x"`` or ``"4x"``; None = the file's (``clip.vision.projector.scale_factor``). HF allows
            either on the same weights (``downsample_mode``).

    Raises:
        ValueError: an unknown mode, or a stored matrix the native GEMM cannot pack.
    """

    def __init__(self, mm: MiniCPMVMmproj, threads: int | None = None, mode: str | None = None):
        self.hp: MiniCPMVHParams = mm.hparams
        self.identity = mm.identity
        self.mode = self.hp.mode if mode is None else mode
        merge_factor(self.mode)
        self.threads = threads
        self._workers = max(1, threads or os.cpu_count() or 1)
        self._native = sgemm.available()
        self._packed: dict[str, sgemm.PackedWeight] = (pack_weights(mm.weights, self.hp, self.mode == "16x")
                                                       if self._native else {})
        self._w: dict[str, np.ndarray] = mm.weights.loaded if self._native else dict(mm.weights)
        self._patch_w = None if self._native else self._w["v.patch_embd.weight"].reshape(self.hp.n_embd, -1)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def native(self) -> bool:
        """True when the projections run on the native packed-weight GEMM (:mod:`engine.kernels.sgemm`, chosen and
        packed at construction), False on the numpy tiles."""
        return self._native

    @property
    def merge(self) -> int:
        """Patches per output token side (4 in 16x mode, 2 in 4x mode)."""
        return merge_factor(self.mode)

    def encode_piece(self, pixel_values: np.ndarray, grid: tuple[int, int], cb: StageCallback | None = None,
                     cancel: threading.Event | None = None) -> np.ndarray:
        """:meth:`encode` of one piece: (gh*gw / merge**2, out_dim) float32."""
        return self.encode([pixel_values], [grid], cb, cancel)[0]

    def encode(self, pieces: list[np.ndarray], grids: list[tuple[int, int]], cb: StageCallback | None = None,
               cancel: threading.Event | None = None) -> list[np.ndarray]:
        """Run the tower and both mergers on the pieces of one image, each its own sequence (module doc).

        Args:
            pieces: per piece, (gh*gw, 3*P*P) float32 patch rows in raster order
                (:attr:`~engine.arch.minicpmv.preprocess.PreparedPieces.pieces`).
            grids: per piece, (gh, gw) patches, both multiples of :attr:`merge`.
            cb: optional stage callback (stage names in the module doc), called once per stage with the rows of
                all pieces stacked in piece order.
            cancel: checked before every block; when set, :class:`~engine.errors.GenerationCancelled` is raised.

        Returns:
            per piece, (gh*gw / merge**2, out_dim) float32, tokens in raster order of the merged grid.

        Raises:
            ValueError: a piece does not fit its grid, or a side is not a multiple of :attr:`merge`.
            GenerationCancelled: ``cancel`` was set.
        """
        hp, w = self.hp, self._w
        grids = self._checked_grids(pieces, grids)
        emit = cb or (lambda stage, il, x: None)
        quarter = self.mode == "16x"
        plan = _Plan(grids, quarter)
        python_pool = (ThreadPoolExecutor(self._workers, thread_name_prefix="minicpmv")
                       if self._workers > 1 and not self._native else nullcontext())
        with threadpool_limits(limits=1, user_api="blas"), python_pool as pool:
            self._pool = pool
            try:
                h = self._linear(np.concatenate(pieces, dtype=np.float32), "v.patch_embd")
                emit("patch_embd", -1, h)
                h += w["v.position_embd.weight"][np.concatenate([bucket_position_ids(gh, gw, hp.pos_side)
                                                                 for gh, gw in grids])]
                emit("embeddings", -1, h)
                buf = _Buffers(len(h), hp.n_embd, hp.n_ff)
                starts = plan.starts
                for il in range(hp.n_layer):
                    if cancel is not None and cancel.is_set():
                        raise GenerationCancelled("image encoding cancelled")
                    self._block(h, il, buf.view(len(h)), starts)
                    emit("layer_out", il, h)
                    if quarter and il == hp.insert_layer:
                        h = self._vit_merger(h, plan.window_order(), buf)
                        starts = plan.merged_starts
                        emit("vit_merger", -1, h)
                z = self._norm(h, "v.post_ln")
                emit("post_ln", -1, z)
                d4 = 4 * hp.n_embd
                z = self._norm(z[plan.merged_window_order()].reshape(-1, d4),
                               "mm.input_norm")
                out = self._linear(self._linear(z, "mm.up", act="gelu_erf"), "mm.down")
                emit("merger_out", -1, out)
            finally:
                self._pool = None
        return np.split(out, (starts[1:-1] // 4).tolist())

    def _checked_grids(self, pieces: list[np.ndarray], grids: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``grids`` as int pairs; ValueError unless each piece fits its grid (see :meth:`encode`)."""
        grids = [(int(g[0]), int(g[1])) for g in grids]
        if len(pieces) != len(grids) or not pieces:
            raise ValueError(f"{len(pieces)} pieces for {len(grids)} grids (expected as many, at least one)")
        for px, (gh, gw) in zip(pieces, grids, strict=True):
            if gh % self.merge or gw % self.merge or gh < 1 or gw < 1 or px.shape != (gh * gw, self.hp.patch_dim):
                raise ValueError(f"pixel_values {px.shape} do not fit grid {gh}x{gw} (expected "
                                 f"({gh * gw}, {self.hp.patch_dim}), sides positive multiples of {self.merge})")
        return grids

    # -- parallel primitives -------------------------------------------------------------------------------

    def _run(self, fn: Callable, items: list) -> None:
        if self._pool is None:
            for it in items:
                fn(it)
        else:
            for _ in self._pool.map(fn, items):
                pass

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """LayerNorm ``name`` of (n, d) rows into a new array, :data:`ROW_TASK` rows per task."""
        return self._norm_into(x, name, sgemm.empty_aligned(x.shape))

    def _norm_into(self, x: np.ndarray, name: str, out: np.ndarray) -> np.ndarray:
        """LayerNorm ``name`` of (n, d) rows into ``out`` (native: one :func:`engine.kernels.sgemm.layer_norm` call)."""
        g, b, eps = self._w[name + ".weight"], self._w[name + ".bias"], self.hp.eps
        if self._native:
            return sgemm.layer_norm(x, g, b, eps, out=out, threads=self._workers)
        self._run(lambda r: ops.layer_norm(x[r], g, b, eps, out=out[r]), _spans(len(x), ROW_TASK))
        return out

    def _linear(self, x: np.ndarray, name: str, out: np.ndarray | None = None, act: str | None = None,
                add_to: np.ndarray | None = None, add: np.ndarray | None = None) -> np.ndarray:
        """``y = act(x @ w.T + b)`` of the projection ``name`` (``name.weight``, ``name.bias``), then ``y += add``
        and ``add_to += y``. Native: one :class:`~engine.kernels.sgemm.PackedWeight` call with all of it in the
        epilogue (``add_to`` then receives the result and ``out`` is not used). numpy: :func:`_tiles` of
        :func:`engine.ops.vision_reference.linear`, each followed by the same steps while in cache.

        Args:
            x: (n, k) float32. out: optional (n, m) float32 for ``y``. act: None, "gelu_tanh" or "gelu_erf".
            add: optional (n, m) float32 added to ``y``. add_to: optional (n, m) float32 residual stream.

        Returns:
            ``y`` (``add_to`` when given on the native path), (n, m) float32.
        """
        if self._native:
            if add_to is not None:
                return self._packed[name](x, out=add_to, act=act, add=add_to, threads=self._workers)
            return self._packed[name](x, out=out, act=act, add=add, threads=self._workers)
        w, b = self._weight(name), self._w[name + ".bias"]
        out = np.empty((len(x), len(w)), dtype=np.float32) if out is None else out
        act_into = _NUMPY_ACTS[act]

        def tile(rc: tuple[slice, slice]) -> None:
            r, c = rc
            y = ops.linear(x[r], w[c], b[c], out=out[r, c])
            if act_into is not None:
                act_into(y)
            if add is not None:
                y += add[r, c]
            if add_to is not None:
                add_to[r, c] += y

        self._run(tile, _tiles(len(x), len(w)))
        return out

    def _weight(self, name: str) -> np.ndarray:
        """The (out, in) float32 weight of projection ``name`` (the patch kernel flattened)."""
        return self._patch_w if name == "v.patch_embd" else self._w[name + ".weight"]

    # -- the blocks ----------------------------------------------------------------------------------------

    def _qkv(self, a: np.ndarray, p: str, buf: _Buffers) -> None:
        """q, k, v projections of ``a`` into ``buf.qkv`` (columns q | k | v; one call, or one set of tiles)."""
        if self._native:
            self._packed[p + "attn_qkv"](a, out=buf.qkv, threads=self._workers)
            return
        w = self._w
        jobs = [(x, out, r, c) for x, out in zip("qkv", (buf.q, buf.k, buf.v), strict=True)
                for r, c in _tiles(len(a), out.shape[1])]

        def tile(job: tuple[str, np.ndarray, slice, slice]) -> None:
            x, out, r, c = job
            ops.linear(a[r], w[f"{p}attn_{x}.weight"][c], w[f"{p}attn_{x}.bias"][c], out=out[r, c])

        self._run(tile, jobs)

    def _block(self, h: np.ndarray, il: int, buf: _Buffers, starts: np.ndarray) -> None:
        """One SigLIP pre-norm block with full attention per piece (native: :func:`engine.kernels.sgemm.vit_attention`
        on the fused q|k|v rows; numpy: :func:`engine.ops.vision_reference.attention` per (piece, head) task),
        updating the residual stream ``h`` (S, D) in place; ``starts`` (n_pieces + 1,) are the pieces' first rows."""
        hp, p = self.hp, f"v.blk.{il}."
        hd = hp.head_dim
        self._norm_into(h, p + "ln1", buf.a)
        self._qkv(buf.a, p, buf)

        if self._native:
            sgemm.vit_attention(buf.qkv, starts, hp.n_head, out=buf.att, threads=self._workers)
        else:
            q, k, v = (x.reshape(len(h), hp.n_head, hd) for x in (buf.q, buf.k, buf.v))

            def head(job: tuple[slice, int]) -> None:
                r, i = job
                c = slice(i, i + 1)
                ops.attention(q[r, c], k[r, c], v[r, c], out=buf.att[r, i * hd:(i + 1) * hd])

            self._run(head, [(slice(int(s), int(e)), i) for s, e in zip(starts[:-1], starts[1:], strict=True)
                             for i in range(hp.n_head)])
        self._linear(buf.att, p + "attn_out", out=buf.tmp, add_to=h)
        self._norm_into(h, p + "ln2", buf.a)
        self._linear(buf.a, p + "ffn_up", out=buf.f, act="gelu_tanh")
        self._linear(buf.f, p + "ffn_down", out=buf.tmp, add_to=h)

    def _vit_merger(self, h: np.ndarray, order: np.ndarray, buf: _Buffers) -> np.ndarray:
        """The window-attention merger: (S, D) rows of the stack -> (S/4, D), ``order`` the stack's window order
        (:meth:`_Plan.window_order`); windows of each piece in raster order. ``buf``: the blocks' scratch."""
        p, d = "v.vit_merger.", self.hp.n_embd
        x = h[order]
        self._norm_into(x, p + "ln1", buf.a)
        self._qkv(buf.a, p, buf)
        att = buf.att
        if self._native:
            sgemm.vit_attention(buf.qkv, np.arange(0, len(h) + 1, 4), self.hp.n_head, out=att, threads=self._workers)
        else:
            def windows(r: slice) -> None:
                att[r] = window_attention(buf.q[r], buf.k[r], buf.v[r], self.hp.n_head)

            self._run(windows, _spans(len(h), ROW_TASK))
        self._linear(att, p + "attn_out", out=buf.tmp, add_to=x)
        mean = x.reshape(-1, 4, d).mean(axis=1)
        c = self._norm_into(x.reshape(-1, 4 * d), p + "ds_ln", buf.a.reshape(-1, 4 * d))
        f = self._linear(c, p + "ds_ffn_up", out=buf.f.reshape(len(c), -1), act="gelu_tanh")
        return self._linear(f, p + "ds_ffn_down", add=mean)


class _Buffers:
    """Scratch of one block over ``n`` rows: ``a`` (normed input), ``qkv`` (n, 3d) with ``q``/``k``/``v`` its column
    views, ``att``/``tmp`` (n, d), ``f`` (n, ff); :meth:`view` gives the first rows of each (the rows after the
    window-attention merger). The window-attention merger reuses them: ``a`` as (n/4, 4d) and ``f`` as (n/4, 4ff)."""

    def __init__(self, n: int, d: int, ff: int, arrays: dict[str, np.ndarray] | None = None):
        self._d, self._ff = d, ff
        self._arrays = arrays if arrays is not None else {
            **{k: sgemm.empty_aligned((n, d)) for k in ("a", "att", "tmp")},
            "qkv": sgemm.empty_aligned((n, 3 * d)), "f": sgemm.empty_aligned((n, ff))}
        for k, x in self._arrays.items():
            setattr(self, k, x)
        self.q, self.k, self.v = (self.qkv[:, i * d:(i + 1) * d] for i in range(3))

    def view(self, n: int) -> _Buffers:
        return _Buffers(n, self._d, self._ff, {k: x[:n] for k, x in self._arrays.items()})


def _gelu_tanh_into(y: np.ndarray) -> None:
    ops.gelu_tanh(y, out=y)


def _gelu_erf_into(y: np.ndarray) -> None:
    y[...] = ops.gelu_erf(y)


_NUMPY_ACTS = {None: None, "gelu_tanh": _gelu_tanh_into, "gelu_erf": _gelu_erf_into}
"""The numpy path's in-place activation of a tile, by the names :meth:`MiniCPMVTower._linear` takes."""


class PiecesTower:
    """The tower as :class:`engine.registry.VisionTower`, the interface :class:`engine.vision.encoder.ImageEncoder`
    uses: one prepared image holds all of its pieces.

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
                             prep.original_size, prep.digest, src.name, pieces=len(prep.pieces))

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
