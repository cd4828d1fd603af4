"""The Qwen3.5/3.6 vision tower on the GPU (pycuda), one image per call.

Same inputs, outputs and numerics as :class:`engine.arch.qwen3vl.tower.VisionTower` (float32). Weights
are uploaded once in their stored type (rows padded to 32); non-GEMM steps are ``native/cuda/vision.cu``.
CUDA failures raise :class:`~engine.errors.DeviceError` (the encoder falls back to the CPU); an image
over the VRAM budget raises :class:`~engine.errors.DeviceBudgetError`.
Design: docs/design/vision-towers.md.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import DeviceBudgetError, DeviceError, ModelFormatError
from engine.gguf.header import Header, file_identity, read_header
from engine.kernels.cuda_context import CudaBackend
from engine.kernels.cuda_kernels import (ACT_GELU_ERF, ACT_GELU_TANH, ACT_NONE, VISION_SOURCES, Kernels,
                           check_vision_head)
from engine.kernels.cuda_layout import GPU_TYPES, Matrix, aligned
from engine.ops import vision_reference as ops
from engine.gguf.quant import FLOAT_TYPES, row_bytes, type_name

from .mmproj import Mmproj, VisionHParams

Q = GGMLQuantizationType

PATCH = "v.patch_embd.weight"
"""Name under which the interleaved patch kernel (``v.patch_embd.weight`` + ``.weight.1``) is kept."""


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of 32: the row width of a GEMM input of n values."""
    return -(-n // 32) * 32


def activation_floats(hp: VisionHParams, s: int) -> dict[str, int]:
    """Device buffers of one image of ``s`` patches, name -> float32 count.

    patches (s, padded(patch_dim)); h (s, D) residual stream; a (s, padded(D)) norm output; qkv (s, 3D);
    att (s, padded(D)); ffn (s, padded(F)); cos, sin (s, head_dim/2); z, y (s/merge^2, padded(merged_dim))
    merger input and hidden; out (s/merge^2, out_dim). Columns past the true width stay zero.
    """
    d, n = hp.n_embd, s // (hp.merge * hp.merge)
    return {"patches": s * padded(hp.patch_dim), "h": s * d, "a": s * padded(d), "qkv": s * 3 * d,
            "att": s * padded(d), "ffn": s * padded(hp.n_ff), "cos": s * (hp.head_dim // 2),
            "sin": s * (hp.head_dim // 2), "z": n * padded(hp.merged_dim), "y": n * padded(hp.merged_dim),
            "out": n * hp.out_dim}


def activation_bytes(hp: VisionHParams, s: int) -> int:
    """Device bytes of :func:`activation_floats` (each buffer aligned)."""
    return sum(aligned(4 * n) for n in activation_floats(hp, s).values())


def _gemm_names(hp: VisionHParams) -> list[str]:
    blocks = [f"v.blk.{il}.{n}.weight" for il in range(hp.n_layer)
              for n in ("attn_qkv", "attn_out", "ffn_up", "ffn_down")]
    return [PATCH, *blocks, "mm.0.weight", "mm.2.weight"]


def _vector_names(hp: VisionHParams) -> list[str]:
    blocks = [f"v.blk.{il}.{n}" for il in range(hp.n_layer)
              for n in ("ln1.weight", "ln1.bias", "attn_qkv.bias", "attn_out.bias", "ln2.weight", "ln2.bias",
                        "ffn_up.bias", "ffn_down.bias")]
    return [*blocks, "v.post_ln.weight", "v.post_ln.bias", "mm.0.bias", "mm.2.bias"]


class CudaVisionTower(CudaBackend):
    """The vision tower of one projector file on GPU 0. Not thread-safe: one :meth:`encode` at a time.

    Args:
        mm: the loaded projector (its file is read again for the stored weight bytes).
        reserve_patches: activation buffers for images of up to this many patches are allocated at load,
            so they count in :attr:`vram_bytes` from the start (the engine passes the most patches an image
            can have); a larger image grows them when it comes, within ``budget_bytes``.
        budget_bytes: GPU memory the tower may take (weights + activations), at load and when the
            activation buffers grow; None = no limit.

    Attributes:
        hp: the tower's hyper-parameters. identity: the projector's identity (as
            :class:`~engine.arch.qwen3vl.tower.VisionTower`).
        weight_bytes: device bytes of the weights (GEMM rows and float32 vectors).
        upload_seconds: wall time of reading, padding and copying the weights to the GPU (kernel build excluded).

    Raises:
        DeviceError: no usable GPU, pycuda or nvcc, a kernel fails to build, the projector file cannot be
            read again or changed since it was loaded, the head width is above 128 or not a multiple of 4
            (checked before any GPU memory is taken), the tower does not fit ``budget_bytes``
            (:class:`~engine.errors.DeviceBudgetError`), GPU / pinned host memory runs out while loading, or
            any other exception while loading (a malformed file: the message names it); the GPU and pinned
            memory taken so far is released first, also on KeyboardInterrupt, which passes through.
    """

    GRID_CACHE = 4
    """Number of patch grids whose position rows and RoPE tables are kept on the host."""

    def __init__(self, mm: Mmproj, reserve_patches: int = 0, budget_bytes: int | None = None) -> None:
        self.hp = hp = mm.hparams
        self.identity = mm.identity
        self._mm = mm
        check_vision_head(hp.head_dim)
        reserve = max(0, int(reserve_patches))
        reserve -= reserve % (hp.merge * hp.merge)
        self._budget = budget_bytes
        self._grids: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        super().__init__()
        self._act: dict[str, int] = {}
        self._capacity = 0
        self._staging: dict[str, np.ndarray] = {}
        try:
            self._open("loading the vision tower onto the GPU", lambda: self._load(reserve))
        except DeviceError:
            raise
        except Exception as e:  # a malformed or changed file, a bug: the CPU tower still works
            raise DeviceError(f"loading the vision tower of {mm.path} onto the GPU failed: "
                              f"{type(e).__name__}: {e}") from e

    # ---- lifetime --------------------------------------------------------------------------------

    def _release(self) -> None:
        """Forget the activation buffers and drop the pinned staging buffers."""
        self._act.clear()
        self._staging.clear()

    @property
    def vram_bytes(self) -> int:
        """Device bytes held now: weights plus the activation buffers."""
        return self._dev.used

    # ---- loading ---------------------------------------------------------------------------------

    def _load(self, reserve: int) -> None:
        hp, mm = self.hp, self._mm
        try:
            changed = file_identity(mm.path) != mm.identity
            header = read_header(mm.path)
        except (OSError, ModelFormatError) as e:
            raise DeviceError(f"{mm.path}: the projector file cannot be read again for the GPU: {e}") from e
        if changed:
            raise DeviceError(f"{mm.path}: the projector file changed since it was loaded (reload the model)")
        layouts = {name: self._layout(name, header) for name in _gemm_names(hp)}
        vectors = _vector_names(hp)
        self.weight_bytes = (sum(aligned(m.nbytes) for m in layouts.values())
                             + sum(aligned(4 * mm.f32(n).size) for n in vectors))
        self._check_budget(reserve)
        self.kernels = Kernels(self._drv, VISION_SOURCES)
        t0 = time.perf_counter()
        self.mat = {name: (m, self._dev.upload(self._rows(m, header))) for name, m in layouts.items()}
        self.vec = {n: self._dev.upload(np.ascontiguousarray(mm.f32(n), dtype=np.float32)) for n in vectors}
        self.upload_seconds = time.perf_counter() - t0
        self.stream = self._drv.Stream()
        if reserve:
            self._ensure(reserve)

    def _check_budget(self, s: int) -> None:
        """Raise DeviceBudgetError when the weights plus activations for ``s`` patches exceed the budget."""
        need = self.weight_bytes + (activation_bytes(self.hp, s) if s else 0)
        if self._budget is not None and need > self._budget:
            raise DeviceBudgetError(f"the vision tower needs {need / 2**30:.2f} GiB of GPU memory (weights "
                                    f"{self.weight_bytes / 2**30:.2f} GiB, activations for {s} patches), above "
                                    f"its VRAM budget of {self._budget / 2**30:.2f} GiB")

    def _stored(self, name: str, header: Header) -> np.ndarray:
        """(rows, row_bytes) uint8 view of tensor ``name`` as the file stores it (rows = first math axis)."""
        t = header.tensors.get(name)
        want = self._mm.qtypes[name]
        if t is None or type_name(t.type_id) != want:
            raise DeviceError(f"{self._mm.path}: tensor {name!r} is no longer stored as {want}: the file changed "
                              "since it was loaded")
        return header.tensor_bytes(t).reshape(self._mm.f32(name).shape[0], -1)

    def _layout(self, name: str, header: Header) -> Matrix:
        """How GEMM weight ``name`` lives on the GPU: stored type (or F32 when the GEMM has no kernel for it,
        or the two patch halves differ in type or are quantized), inputs padded to a multiple of 32."""
        mm = self._mm
        if name == PATCH:
            rows, cols = self.hp.n_embd, self.hp.patch_dim
            stored = Q[mm.qtypes[PATCH]]
            keep = stored in FLOAT_TYPES and mm.qtypes[PATCH + ".1"] == mm.qtypes[PATCH]
        else:
            rows, cols = mm.f32(name).shape
            stored = Q[mm.qtypes[name]]
            keep = stored in GPU_TYPES
        qtype = stored if keep else Q.F32
        return Matrix(name, qtype, rows, padded(cols), row_bytes(qtype, padded(cols)), not keep)

    def _rows(self, m: Matrix, header: Header) -> np.ndarray:
        """The (rows, row_bytes) uint8 bytes of :meth:`_layout` ``m``, zero-padded past the true inputs."""
        mm, hp = self._mm, self.hp
        if m.name == PATCH:
            if m.converted:
                raw = np.stack([mm.f32(PATCH), mm.f32(PATCH + ".1")], axis=2).reshape(m.rows, -1).view(np.uint8)
            else:
                halves = [self._stored(n, header).reshape(m.rows, hp.in_channels, -1) for n in (PATCH, PATCH + ".1")]
                raw = np.stack(halves, axis=2).reshape(m.rows, -1)
        elif m.converted:
            raw = np.ascontiguousarray(mm.f32(m.name), dtype=np.float32).view(np.uint8)
        else:
            raw = self._stored(m.name, header)
        if raw.shape[1] == m.row_bytes:
            return raw
        out = np.zeros((m.rows, m.row_bytes), dtype=np.uint8)
        out[:, :raw.shape[1]] = raw
        return out

    def _ensure(self, s: int) -> None:
        """Device activation buffers and pinned staging for images of up to ``s`` patches (grown, never shrunk).

        Raises:
            DeviceBudgetError: growing them would exceed the budget (the buffers held are kept).
        """
        if s <= self._capacity:
            return
        self._check_budget(s)
        drv, hp = self._drv, self.hp
        for ptr in self._act.values():
            self._dev.free(ptr)
        self._act.clear()
        self._capacity = 0
        for name, count in activation_floats(hp, s).items():
            self._act[name] = self._dev.alloc(4 * count)
            drv.memset_d32(self._act[name], 0, count)
        n = s // (hp.merge * hp.merge)
        self._staging = {"patches": drv.pagelocked_zeros((s, padded(hp.patch_dim)), np.float32),
                         "h0": drv.pagelocked_empty((s, hp.n_embd), np.float32),
                         "cos": drv.pagelocked_empty((s, hp.head_dim // 2), np.float32),
                         "sin": drv.pagelocked_empty((s, hp.head_dim // 2), np.float32),
                         "out": drv.pagelocked_empty((n, hp.out_dim), np.float32)}
        self._capacity = s

    # ---- encoding --------------------------------------------------------------------------------

    def grid_tables(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host tables of a (gh, gw) patch grid in merge-window order (cached for :data:`GRID_CACHE` grids).

        Returns:
            h0: (gh*gw, n_embd) float32, the interpolated position rows plus the patch bias.
            cos, sin: (gh*gw, head_dim/2) float32 RoPE tables.
        """
        hit = self._grids.get((gh, gw))
        if hit is not None:
            self._grids.move_to_end((gh, gw))
            return hit
        hp, mm = self.hp, self._mm
        rows, cols = ops.merge_window_coords(gh, gw, hp.merge)
        h0 = ops.pos_embed_at(mm.f32("v.position_embd.weight"), hp.pos_side, gh, gw, rows, cols)
        h0 += mm.f32("v.patch_embd.bias")
        cos, sin = ops.rope_2d_cos_sin(rows, cols, hp.head_dim, hp.rope_theta)
        self._grids[(gh, gw)] = (h0, cos, sin)
        while len(self._grids) > self.GRID_CACHE:
            self._grids.popitem(last=False)
        return h0, cos, sin

    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
        """Run the tower and merger on one image (the contract of :meth:`engine.arch.qwen3vl.tower.VisionTower.encode`).

        Args:
            pixel_values: (gh*gw, 3*T*P*P) float32 patch rows in merge-window order.
            grid: (gh, gw) patch grid, both multiples of ``merge``.

        Returns:
            (gh*gw/merge**2, out_dim) float32, merged tokens in raster order of the merged grid (a new array).

        Raises:
            ValueError: ``pixel_values`` does not match ``grid`` or the patch size.
            DeviceBudgetError: the image needs more activation memory than the budget leaves (the tower
                stays usable for smaller images).
            DeviceError: the tower was closed, or a CUDA failure (out of GPU or pinned memory included).
        """
        hp = self.hp
        gh, gw = int(grid[0]), int(grid[1])
        s = gh * gw
        if gh % hp.merge or gw % hp.merge or pixel_values.shape != (s, hp.patch_dim):
            raise ValueError(f"pixel_values {pixel_values.shape} do not fit grid {gh}x{gw} "
                             f"(expected ({s}, {hp.patch_dim}), sides multiples of {hp.merge})")
        if self._ctx is None:
            raise DeviceError("the GPU vision tower was closed")
        h0, cos, sin = self.grid_tables(gh, gw)
        with self._guard(f"encoding a {gh}x{gw}-patch image on the GPU"):
            self._ensure(s)
            return self._forward(np.asarray(pixel_values, dtype=np.float32), s, h0, cos, sin)

    def _upload(self, stage: str, dst: str, values: np.ndarray) -> None:
        """Copy ``values`` (s rows) into the first columns of pinned staging ``stage`` and queue the copy of
        those s whole staging rows to device buffer ``dst`` on the stream."""
        rows = self._staging[stage][:len(values)]
        rows[:, :values.shape[1]] = values
        self._drv.memcpy_htod_async(self._act[dst], rows, self.stream)

    def _gemm(self, name: str, a: int, lda: int, c: int, ldc: int, m: int, accumulate: bool = False) -> None:
        w, ptr = self.mat[name]
        self.kernels.gemm(self.stream, w, ptr, a, lda, c, ldc, m, accumulate=accumulate)

    def _forward(self, pixel_values: np.ndarray, s: int, h0: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray) -> np.ndarray:
        hp, k, cs, a = self.hp, self.kernels, self.stream, self._act
        d, f, m2 = hp.n_embd, hp.n_ff, hp.merge * hp.merge
        dp, fp, mp, n = padded(d), padded(f), padded(hp.merged_dim), s // m2
        self._upload("patches", "patches", pixel_values)
        self._upload("h0", "h", h0)
        self._upload("cos", "cos", cos)
        self._upload("sin", "sin", sin)
        self._gemm(PATCH, a["patches"], padded(hp.patch_dim), a["h"], d, s, accumulate=True)
        scale = float(np.float32(1.0 / np.sqrt(hp.head_dim)))
        for il in range(hp.n_layer):
            p = f"v.blk.{il}."
            v = self.vec
            k.layer_norm(cs, a["h"], d, v[p + "ln1.weight"], v[p + "ln1.bias"], a["a"], 1, dp, s, d, hp.eps)
            self._gemm(p + "attn_qkv.weight", a["a"], dp, a["qkv"], 3 * d, s)
            k.bias_act(cs, a["qkv"], 3 * d, v[p + "attn_qkv.bias"], s, 3 * d, ACT_NONE)
            k.rope_2d(cs, a["qkv"], 3 * d, a["cos"], a["sin"], s, hp.n_head, hp.head_dim)
            k.vision_attention(cs, a["qkv"], 3 * d, a["att"], dp, s, hp.n_head, hp.head_dim, scale)
            self._gemm(p + "attn_out.weight", a["att"], dp, a["h"], d, s, accumulate=True)
            k.bias_act(cs, a["h"], d, v[p + "attn_out.bias"], s, d, ACT_NONE)
            k.layer_norm(cs, a["h"], d, v[p + "ln2.weight"], v[p + "ln2.bias"], a["a"], 1, dp, s, d, hp.eps)
            self._gemm(p + "ffn_up.weight", a["a"], dp, a["ffn"], fp, s)
            k.bias_act(cs, a["ffn"], fp, v[p + "ffn_up.bias"], s, f, ACT_GELU_TANH)
            self._gemm(p + "ffn_down.weight", a["ffn"], fp, a["h"], d, s, accumulate=True)
            k.bias_act(cs, a["h"], d, v[p + "ffn_down.bias"], s, d, ACT_NONE)
        k.layer_norm(cs, a["h"], d, self.vec["v.post_ln.weight"], self.vec["v.post_ln.bias"], a["z"], m2, mp, s, d,
                     hp.eps)
        self._gemm("mm.0.weight", a["z"], mp, a["y"], mp, n)
        k.bias_act(cs, a["y"], mp, self.vec["mm.0.bias"], n, hp.merged_dim, ACT_GELU_ERF)
        self._gemm("mm.2.weight", a["y"], mp, a["out"], hp.out_dim, n)
        k.bias_act(cs, a["out"], hp.out_dim, self.vec["mm.2.bias"], n, hp.out_dim, ACT_NONE)
        out = self._staging["out"][:n]
        self._drv.memcpy_dtoh_async(out, a["out"], cs)
        cs.synchronize()
        return out.copy()
