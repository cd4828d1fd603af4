"""The Qwen3.5/3.6 vision tower and merger in numpy, image-token counts, M-RoPE positions, and an
embedding cache. One image in, ``(n_tokens, out_dim)`` LLM-width embeddings out.

Forward (``shared/spec/vision.md`` A5; ``shared/spec/reference.md`` section 5 "Vision tower"), S patches
of one image in merge-window order, D = ``n_embd``::

    h   = patches @ [W_t0 | W_t1]^T + b                       patch_embd   (S, D)
    h  += bilinear_align_corners(pos_table)[rows, cols]       inp_embd     (S, D)
    for each block:                                           (stage names carry the block index)
        q, k, v = split(LN1(h) @ Wqkv^T + bqkv); rope_2d(q, k)
        h += attention(q, k, v) @ Wo^T + bo                   attn_out
        h += fc2(gelu_tanh(fc1(LN2(h))))                      layer_out
    z   = LN_post(h).reshape(S/4, 4D)                         post_ln      (S/4, 4D)
    out = mm.2(gelu_erf(mm.0(z)))                             merger_out   (S/4, out_dim)

Output rows are the merged grid ``(gh/2) x (gw/2)`` in raster order, the order of the image-pad
tokens in the prompt. Each image attends only to itself.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..backends.cpu import threads as cpu_threads
from ..errors import DeviceBudgetError, DeviceError, GenerationCancelled
from ..images import (MAX_INPUT_PIXELS, MAX_PIXELS, MIN_PIXELS, ImageSource, prepare_image, read_source,
                      smart_resize)
from ..mmproj import Mmproj, VisionHParams
from ..ops import vision_reference as ops

log = logging.getLogger(__name__)

StageCallback = Callable[[str, int, np.ndarray], None]
"""``cb(stage, il, x)``: sees each named intermediate; ``il`` is the block index or -1 outside blocks.
``x`` is a live buffer that later stages overwrite: copy it to keep it."""


def image_token_count(height: int, width: int, *, patch_size: int = 16, merge: int = 2,
                      min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """Number of image-pad tokens (merger rows) an image of ``height x width`` pixels becomes.

    ``(h/32) * (w/32)`` for the :func:`~engine.images.smart_resize` target (h, w) (spec A5.7), e.g.
    448x448 -> 196, 1024x768 -> 768 with the HF bounds.

    Raises:
        ImageError: empty or too elongated image. ValueError: inconsistent bounds.
    """
    factor = patch_size * merge
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return (h // factor) * (w // factor)


def _blas_thread_setter() -> Callable[[int], int] | None:
    """OpenBLAS's ``openblas_set_num_threads_local(n) -> previous``, which sets the BLAS thread count of
    the calling thread only, from the OpenBLAS that numpy's wheels bundle (scipy-openblas >= 0.3.27,
    under ``numpy.libs`` or ``numpy/.dylibs``; loading it again returns the instance numpy uses).
    None when numpy uses another BLAS or an older OpenBLAS."""
    base = os.path.dirname(os.path.abspath(np.__file__))
    for path in sorted(glob.glob(os.path.join(base + ".libs", "*openblas*"))
                       + glob.glob(os.path.join(base, ".dylibs", "*openblas*"))):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


class _Workers:
    """Runs independent tasks on the calling thread plus ``n - 1`` helper threads, each task once.

    Tasks are pulled one at a time from a shared counter, so a core slowed by another process simply
    takes fewer of them. Inside :meth:`run` every participating thread runs BLAS single-threaded
    (``set_blas_threads``), so the parallelism is ours: many small GEMMs (attention) and the
    elementwise numpy passes, which are single-threaded anyway, use every core. Without a BLAS
    thread control there is one worker: the caller, with BLAS threaded as configured.

    Args:
        n: worker count wanted (the caller included), >= 1.
        set_blas_threads: :func:`_blas_thread_setter`'s function, or None.
    """

    def __init__(self, n: int, set_blas_threads: Callable[[int], int] | None):
        self.n = max(1, int(n)) if set_blas_threads is not None else 1
        self._set_blas = set_blas_threads
        self._pool = (ThreadPoolExecutor(self.n - 1, thread_name_prefix="vision",
                                         initializer=set_blas_threads, initargs=(1,)) if self.n > 1 else None)

    def run(self, task: Callable[[int], None], n_tasks: int) -> None:
        """Call ``task(i)`` for every i in ``range(n_tasks)``, in parallel; returns when all are done.

        Raises:
            whatever a task raised (the first seen by the caller; the other workers finish first).
        """
        counter = itertools.count()

        def drain() -> None:
            i = next(counter)
            while i < n_tasks:
                task(i)
                i = next(counter)

        if self._pool is None or n_tasks == 1:
            drain()
            return
        helpers = [self._pool.submit(drain) for _ in range(min(self.n, n_tasks) - 1)]
        prev = self._set_blas(1)
        try:
            drain()
        finally:
            self._set_blas(prev)
            errors = [f.exception() for f in helpers]
        for err in errors:
            if err is not None:
                raise err


class _Buffers:
    """Per-call activation buffers of :meth:`VisionTower.encode`, reused by every block (no page
    faults after the first block). S patches, D = n_embd, F = n_ff, H heads of d: all float32.

    Attributes:
        a: (S, D) norm output, then the attention / FFN projection output.
        qkv: (S, 3D) fused projection. q, k: (S, H, d) rotated queries and keys.
        att: (S, D) attention output. ffn: (S, F) FFN hidden.
    """

    def __init__(self, s: int, hp: VisionHParams):
        d, f = hp.n_embd, hp.n_ff
        self.a = np.empty((s, d), dtype=np.float32)
        self.qkv = np.empty((s, 3 * d), dtype=np.float32)
        self.q = np.empty((s, hp.n_head, hp.head_dim), dtype=np.float32)
        self.k = np.empty((s, hp.n_head, hp.head_dim), dtype=np.float32)
        self.att = np.empty((s, d), dtype=np.float32)
        self.ffn = np.empty((s, f), dtype=np.float32)


class VisionTower:
    """The tower of one projector file, float32 numpy, one image per call.

    Every projection is float32 GEMMs on the file's dequantized weights (no copies). The work runs as
    parallel tasks (:class:`_Workers`): projections split by output columns (each task reads its own
    slice of the weight matrix once, then adds its bias and applies its activation or residual add
    while the slice is hot), norms by row chunks, attention by head (RoPE of that head's q and k,
    then the head). Elementwise ops run in cache-sized row blocks into buffers reused across blocks.
    The position and RoPE tables of the last ``GRID_CACHE`` grids are kept. The result is deterministic
    for a given thread count; thread counts differ only by float32 GEMM rounding (about 1e-6 relative).

    Args:
        mm: a loaded :class:`~engine.mmproj.Mmproj` (its float32 weights are used in place).
        threads: worker threads; None = the engine's CPU thread count (:func:`engine.backends.cpu.threads`).
    """

    GRID_CACHE = 4
    """Number of patch grids whose interpolated position rows and RoPE tables are kept (bytes: S*D*4 each)."""

    COLS_PER_TASK = 768
    """Target output columns of one projection task; at least two tasks per worker are made, so a
    worker slowed by another process hands its share to the others."""

    def __init__(self, mm: Mmproj, threads: int | None = None):
        self.hp: VisionHParams = mm.hparams
        self.identity = mm.identity
        self._w = mm.weights
        d = self.hp.n_embd
        w0 = mm.f32("v.patch_embd.weight")
        w1 = mm.f32("v.patch_embd.weight.1")
        # Conv3d kernel (D, C, T, P, P) flattened like a patch row (c, t, ky, kx).
        self._patch_w = np.ascontiguousarray(np.stack([w0, w1], axis=2).reshape(d, -1))
        self._grids: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._grids_lock = threading.Lock()
        self._workers = _Workers(cpu_threads() if threads is None else threads, _blas_thread_setter())

    @property
    def threads(self) -> int:
        """Worker threads :meth:`encode` uses (1 when numpy's BLAS offers no per-thread control)."""
        return self._workers.n

    def token_count(self, height: int, width: int, min_pixels: int = MIN_PIXELS,
                    max_pixels: int = MAX_PIXELS) -> int:
        """:func:`image_token_count` with this tower's patch and merge sizes."""
        return image_token_count(height, width, patch_size=self.hp.patch_size, merge=self.hp.merge,
                                 min_pixels=min_pixels, max_pixels=max_pixels)

    def grid_tables(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Position rows and RoPE tables of a (gh, gw) patch grid, in merge-window order (cached).

        Returns:
            pos: (gh*gw, n_embd) float32, the interpolated learned table (spec A5.2).
            cos, sin: (gh*gw, head_dim/2) float32 (spec A5.3).
            All three are read-only.
        """
        with self._grids_lock:
            hit = self._grids.get((gh, gw))
            if hit is not None:
                self._grids.move_to_end((gh, gw))
                return hit
        hp = self.hp
        rows, cols = ops.merge_window_coords(gh, gw, hp.merge)
        pos = ops.pos_embed_at(self._w["v.position_embd.weight"], hp.pos_side, gh, gw, rows, cols)
        cos, sin = ops.rope_2d_cos_sin(rows, cols, hp.head_dim, hp.rope_theta)
        for a in (pos, cos, sin):
            a.flags.writeable = False
        with self._grids_lock:
            self._grids[(gh, gw)] = (pos, cos, sin)
            while len(self._grids) > self.GRID_CACHE:
                self._grids.popitem(last=False)
        return pos, cos, sin

    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int], cb: StageCallback | None = None,
               cancel: threading.Event | None = None) -> np.ndarray:
        """Run the tower and merger on one image.

        Args:
            pixel_values: (gh*gw, 3*T*P*P) float32 patch rows in merge-window order
                (:attr:`~engine.images.PreparedImage.pixel_values`, or HF ``pixel_values``).
            grid: (gh, gw) patch grid, both multiples of ``merge``.
            cb: optional stage callback (module doc lists the stage names).
            cancel: checked between blocks; when set, :class:`~engine.errors.GenerationCancelled` is raised.

        Returns:
            (gh*gw/merge**2, out_dim) float32, merged tokens in raster order of the merged grid.

        Raises:
            ValueError: ``pixel_values`` does not match ``grid`` or the patch size.
            GenerationCancelled: ``cancel`` was set.
        """
        hp, w = self.hp, self._w
        gh, gw = int(grid[0]), int(grid[1])
        s = gh * gw
        if gh % hp.merge or gw % hp.merge or pixel_values.shape != (s, hp.patch_dim):
            raise ValueError(f"pixel_values {pixel_values.shape} do not fit grid {gh}x{gw} "
                             f"(expected ({s}, {hp.patch_dim}), sides multiples of {hp.merge})")
        emit = cb or (lambda stage, il, x: None)
        pos, cos, sin = self.grid_tables(gh, gw)
        h = np.empty((s, hp.n_embd), dtype=np.float32)
        self._linear(np.asarray(pixel_values, dtype=np.float32), self._patch_w, w["v.patch_embd.bias"], h)
        emit("patch_embd", -1, h)
        h += pos
        emit("inp_embd", -1, h)
        buf = _Buffers(s, hp)
        for il in range(hp.n_layer):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("image encoding cancelled")
            self._block(h, il, cos, sin, buf, emit)
        self._layer_norm(h, "v.post_ln", buf.a)
        z = buf.a.reshape(s // (hp.merge * hp.merge), hp.merged_dim)
        emit("post_ln", -1, z)
        y = np.empty((len(z), w["mm.0.weight"].shape[0]), dtype=np.float32)
        self._linear(z, w["mm.0.weight"], w["mm.0.bias"], y, lambda part, c: np.copyto(part, ops.gelu_erf(part)))
        out = np.empty((len(z), hp.out_dim), dtype=np.float32)
        self._linear(y, w["mm.2.weight"], w["mm.2.bias"], out)
        emit("merger_out", -1, out)
        return out

    def _linear(self, x: np.ndarray, wt: np.ndarray, b: np.ndarray, out: np.ndarray,
                epilogue: Callable[[np.ndarray, slice], object] | None = None) -> None:
        """``out = x @ wt.T + b`` as tasks over column slices c of ``out``, each then calling
        ``epilogue(out[:, c], c)`` (activation, residual add) while its slice is in cache.

        Args:
            x: (n, in) float32. wt: (out, in) float32. b: (out,) float32. out: (n, out) float32.
        """
        n_out = wt.shape[0]
        workers = self._workers.n
        n_tasks = 1 if workers == 1 else workers * max(2, round(n_out / (self.COLS_PER_TASK * workers)))
        bounds = np.linspace(0, n_out, n_tasks + 1).astype(int)

        def task(i: int) -> None:
            c = slice(int(bounds[i]), int(bounds[i + 1]))
            part = ops.linear(x, wt[c], b[c], out=out[:, c])
            if epilogue is not None:
                epilogue(part, c)

        self._workers.run(task, n_tasks)

    def _layer_norm(self, x: np.ndarray, name: str, out: np.ndarray) -> None:
        """``out = LN(x)`` with the weights ``<name>.weight`` / ``<name>.bias``, as row-chunk tasks."""
        w, n = self._w, len(x)
        n_tasks = 1 if self._workers.n == 1 else 2 * self._workers.n
        bounds = np.linspace(0, n, n_tasks + 1).astype(int)

        def task(i: int) -> None:
            r = slice(int(bounds[i]), int(bounds[i + 1]))
            ops.layer_norm(x[r], w[name + ".weight"], w[name + ".bias"], self.hp.eps, out=out[r])

        self._workers.run(task, n_tasks)

    def _block(self, h: np.ndarray, il: int, cos: np.ndarray, sin: np.ndarray, buf: _Buffers,
               emit: StageCallback) -> None:
        """One pre-norm block (spec A5.4), updating the residual stream ``h`` (S, D) in place."""
        hp, w, p, hd = self.hp, self._w, f"v.blk.{il}.", self.hp.head_dim
        qkv = buf.qkv.reshape(-1, 3, hp.n_head, hd)

        def residual(part: np.ndarray, c: slice) -> None:
            np.add(h[:, c], part, out=h[:, c])

        def attend(head: int) -> None:
            c = slice(head, head + 1)
            q = ops.apply_rope(qkv[:, 0, c], cos, sin, out=buf.q[:, c])
            k = ops.apply_rope(qkv[:, 1, c], cos, sin, out=buf.k[:, c])
            ops.attention(q, k, qkv[:, 2, c], out=buf.att[:, head * hd:(head + 1) * hd])

        self._layer_norm(h, p + "ln1", buf.a)
        self._linear(buf.a, w[p + "attn_qkv.weight"], w[p + "attn_qkv.bias"], buf.qkv)
        self._workers.run(attend, hp.n_head)
        self._linear(buf.att, w[p + "attn_out.weight"], w[p + "attn_out.bias"], buf.a, residual)
        emit("attn_out", il, h)
        self._layer_norm(h, p + "ln2", buf.a)
        self._linear(buf.a, w[p + "ffn_up.weight"], w[p + "ffn_up.bias"], buf.ffn,
                     lambda part, c: ops.gelu_tanh(part, out=part))
        self._linear(buf.ffn, w[p + "ffn_down.weight"], w[p + "ffn_down.bias"], buf.a, residual)
        emit("layer_out", il, h)


def mrope_positions(token_ids: Sequence[int] | np.ndarray, image_grids: Sequence[tuple[int, int]],
                    image_pad_id: int, vision_start_id: int, start: int = 0) -> np.ndarray:
    """M-RoPE (t, h, w) positions of a token sequence holding whole images (HF ``get_rope_index``).

    Text token: (p, p, p), p + 1 per token. An image whose first pad token would be at P, merged grid
    H' x W' (row-major pads): token (i, j) at (P, P + i, P + j); the token after it gets
    P + max(H', W') (spec A6, reference.md section 5 item 7). The next position after the sequence
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
        grid: merged (rows, cols); ``rows * cols == n_tokens``; feed to :func:`mrope_positions`.
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
    raises closes it, and that image and every later one are encoded by the CPU :class:`VisionTower`
    (``device_note`` says why, and the failure is logged as a warning). A
    :class:`~engine.errors.DeviceBudgetError` (an image too large for the tower's VRAM budget) sends only
    that image to the CPU, with a logged warning; the GPU tower stays.

    Args:
        mm: the loaded projector.
        min_pixels, max_pixels: default area bounds of the resized image (HF's by default; lower
            ``max_pixels`` to bound CPU time: S = pixels / 256 patches, attention cost ~ S^2), narrowed
            by the projector's own (:meth:`engine.mmproj.VisionHParams.pixel_bounds`).
        cache_bytes: embedding cache size.
        max_input_pixels: decode guard (see :func:`engine.images.open_image`).
        gpu: a GPU tower of the same projector with ``encode(pixel_values, grid) -> (n, out_dim) float32``
            and ``close()`` (:class:`engine.backends.cuda_vision.CudaVisionTower`), or None for the CPU.
        device_note: why images are encoded on the CPU although a GPU was looked for, or "".
    """

    def __init__(self, mm: Mmproj, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                 cache_bytes: int = 256 << 20, max_input_pixels: int = MAX_INPUT_PIXELS, gpu: Any = None,
                 device_note: str = ""):
        self.tower = VisionTower(mm)
        self.gpu = gpu
        self.device_note = device_note
        self._asked_min_pixels = int(min_pixels)
        self.min_pixels, self.max_pixels = mm.hparams.pixel_bounds(min_pixels, max_pixels)
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
            source: file path, file bytes, :class:`~engine.images.ImageData` or Pillow image.
            max_pixels: overrides the default area bound for this image, within the projector's own
                (``min_pixels`` is lowered to it when above).
            cancel: checked between tower blocks on the CPU; on the GPU only before the image (one launch sequence).

        Returns:
            :class:`EncodedImage`.

        Raises:
            ImageError: bad image (see :func:`engine.images.prepare_image`).
            GenerationCancelled: ``cancel`` was set.
            ValueError: ``max_pixels`` below ``factor**2`` (1024).
        """
        t0 = time.perf_counter()
        hp = self.tower.hp
        min_px, max_px = hp.pixel_bounds(self._asked_min_pixels,
                                         self.max_pixels if max_pixels is None else max_pixels)
        src = read_source(source)
        key = (self.tower.identity, src.digest, min_px, max_px)
        hit = self.cache.get(key)
        if hit is not None:
            return replace(hit, from_cache=True, seconds=time.perf_counter() - t0)
        prep = prepare_image(src, patch=hp.patch_size, merge=hp.merge, temporal=hp.temporal_patch,
                             mean=hp.image_mean, std=hp.image_std, min_pixels=min_px, max_pixels=max_px,
                             max_input_pixels=self.max_input_pixels)
        emb = self._run_tower(prep.pixel_values, prep.grid, cancel)
        emb.flags.writeable = False
        item = EncodedImage(emb, (prep.grid[0] // hp.merge, prep.grid[1] // hp.merge), prep.size,
                            prep.original_size, prep.digest, False, time.perf_counter() - t0)
        self.cache.put(key, item)
        return item
