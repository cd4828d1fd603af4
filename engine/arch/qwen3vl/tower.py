"""The Qwen3.5/3.6 vision tower and merger in numpy, and image-token counts.

One image's patch rows (merge-window order) in, ``(n_tokens, out_dim)`` LLM-width embeddings out,
rows in raster order of the merged ``(gh/2) x (gw/2)`` grid (``docs/spec/qwen3vl.md`` section 5;
transformers ``Qwen3_5VisionModel``). Each image attends only to itself.
Design: docs/design/vision-towers.md (the forward pass with its stage names).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from engine.errors import GenerationCancelled
from engine.vision.images import ImageSource, PreparedImage
from engine.kernels.cpu import threads as cpu_threads
from engine.kernels.threads import Workers, blas_thread_setter
from engine.ops import vision_reference as ops

from .mmproj import Mmproj, VisionHParams
from .preprocess import MAX_PIXELS, MIN_PIXELS, prepare_image, smart_resize

StageCallback = Callable[[str, int, np.ndarray], None]
"""``cb(stage, il, x)``: sees each named intermediate; ``il`` is the block index or -1 outside blocks.
``x`` is a live buffer that later stages overwrite: copy it to keep it."""


def image_token_count(height: int, width: int, *, patch_size: int = 16, merge: int = 2,
                      min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """Number of image-pad tokens (merger rows) an image of ``height x width`` pixels becomes.

    ``(h/32) * (w/32)`` for the :func:`~.preprocess.smart_resize` target (h, w) (docs/spec/qwen3vl.md 5.7), e.g.
    448x448 -> 196, 1024x768 -> 768 with the HF bounds.

    Raises:
        ImageError: empty or too elongated image. ValueError: inconsistent bounds.
    """
    factor = patch_size * merge
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return (h // factor) * (w // factor)


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
    parallel tasks (:class:`engine.kernels.threads.Workers`): projections split by output columns (each task reads its
    own slice of the weight matrix once, then adds its bias and applies its activation or residual add while the slice
    is hot), norms by row chunks, attention by head (RoPE of that head's q and k, then the head). Elementwise ops run in
    cache-sized row blocks into buffers reused across blocks. The position and RoPE tables of the last ``GRID_CACHE``
    grids are kept. The result is deterministic for a given thread count; thread counts differ only by float32 GEMM
    rounding (about 1e-6 relative).

    Args:
        mm: a loaded :class:`~engine.arch.qwen3vl.mmproj.Mmproj` (its float32 weights are used in place).
        threads: worker threads; None = the engine's CPU thread count (:func:`engine.kernels.cpu.threads`).
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
        self._workers = Workers(cpu_threads() if threads is None else threads, blas_thread_setter())

    @property
    def threads(self) -> int:
        """Worker threads :meth:`encode` uses (1 when numpy's BLAS offers no per-thread control)."""
        return self._workers.n

    def token_count(self, height: int, width: int, min_pixels: int = MIN_PIXELS,
                    max_pixels: int = MAX_PIXELS) -> int:
        """:func:`image_token_count` with this tower's patch and merge sizes."""
        return image_token_count(height, width, patch_size=self.hp.patch_size, merge=self.hp.merge,
                                 min_pixels=min_pixels, max_pixels=max_pixels)

    def pixel_bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The caller's resize bounds narrowed by the projector's own (:meth:`VisionHParams.pixel_bounds`)."""
        return self.hp.pixel_bounds(min_pixels, max_pixels)

    def prepare(self, source: ImageSource, min_pixels: int, max_pixels: int, max_input_pixels: int) -> PreparedImage:
        """Decode, resize and patchify one image for :meth:`encode` (:func:`.preprocess.prepare_image` with
        this tower's patch, merge, temporal patch and normalization).

        Raises:
            ImageError: unreadable, empty, too large or too elongated image.
        """
        hp = self.hp
        return prepare_image(source, patch=hp.patch_size, merge=hp.merge, temporal=hp.temporal_patch,
                             mean=hp.image_mean, std=hp.image_std, min_pixels=min_pixels, max_pixels=max_pixels,
                             max_input_pixels=max_input_pixels)

    def token_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of image tokens a (gh, gw) patch grid becomes: the merged grid, raster order."""
        return grid[0] // self.hp.merge, grid[1] // self.hp.merge

    def grid_tables(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Position rows and RoPE tables of a (gh, gw) patch grid, in merge-window order (cached).

        Returns:
            pos: (gh*gw, n_embd) float32, the interpolated learned table (docs/spec/qwen3vl.md 5.2).
            cos, sin: (gh*gw, head_dim/2) float32 (docs/spec/qwen3vl.md 5.3).
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
                (:attr:`~engine.vision.images.PreparedImage.pixel_values`, or HF ``pixel_values``).
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
        """One pre-norm block (docs/spec/qwen3vl.md 5.4), updating the residual stream ``h`` (S, D) in place."""
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
