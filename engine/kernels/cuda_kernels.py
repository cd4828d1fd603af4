"""The CUDA kernels of native/cuda/*.cu, built at run time by pycuda and launched through thin typed wrappers.

Each wrapper takes device pointers as Python ints (0 = null), sizes as ints, and a pycuda stream,
and queues one launch; shapes are those documented in the .cu sources. Builds are cached on disk
by pycuda (keyed by source, options and GPU architecture) under the user cache directory, so only
the first run on a machine pays nvcc's compile time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from engine.errors import DeviceError
from engine.gguf.quant import TYPES

from .cuda_layout import TILE_ROWS, Matrix

SOURCE_DIR = Path(__file__).resolve().parents[2] / "native" / "cuda"
"""Folder of the .cu sources, also the include path of their shared header ``common.cuh``."""
PREFILL_SOURCES = ("gemm.cu", "rows.cu", "gdn.cu", "attention.cu")
"""The sources GPU prefill (:class:`engine.arch.qwen35.cuda.CudaPrefill`) builds."""
VISION_SOURCES = ("gemm.cu", "vision.cu")
"""The sources the GPU vision tower (:class:`engine.arch.qwen3vl.cuda.CudaVisionTower`) builds."""

_TYPE_SUFFIX = {t: traits.cuda_suffix for t, traits in TYPES.items() if traits.cuda_suffix is not None}
DENSE_TILE_ROWS = 64
"""Rows of one M tile of the ungrouped GEMM (qgemm_*); the grouped one (qgemm32_*) uses TILE_ROWS = 32."""
_FLASH_DIMS = (32, 64, 128, 256)
_VISION_DIMS = (16, 32, 48, 64, 80, 96, 112, 128)
"""Padded head widths of the vision attention kernels (vis_attn_<HDP> in vision.cu)."""

ACT_NONE, ACT_GELU_TANH, ACT_GELU_ERF = 0, 1, 2
"""Activation codes of :meth:`Kernels.bias_act`."""

# source -> {kernel name -> pycuda argument format} (struct codes: P pointer, i int32, q int64, f float32, d float64)
_SIGNATURES = {
    "gemm.cu": {
        **{f"{k}_{t}": "PiPPqPPiPPiiiiP" for k in ("qgemm", "qgemm32") for t in _TYPE_SUFFIX.values()},
        **{f"embed_rows_{t}": "PqPi" for t in _TYPE_SUFFIX.values()},
        **{f"gemv_{t}": "PPqPii" for t in _TYPE_SUFFIX.values()},
    },
    "rows.cu": {
        "rmsnorm_rows": "PiPPiif",
        "qk_norm_rope": "PiiPPiiidiifPqi",
        "conv1d_silu": "PPPPiii",
        "conv_state_update": "PPPiii",
        "l2norm_qk": "Piiiff",
        "gdn_gates": "PPPPPPii",
        "gated_rmsnorm": "PPPPif",
        "swiglu_rows": "PPii",
        "router_topk": "PiiPP",
        "moe_combine": "PPPiPPPi",
        "route_count": "PiP",
        "route_plan": "PPiqiPP",
        "route_scatter": "PPiiPPPP",
    },
    "gdn.cu": {"gdn_chunk_prep": "PPPPPPPiiiiiii", "gdn_chunk_scan": "PPPPPPPiiiiiii"},
    "attention.cu": {f"flash_attn_{d}": "PPPPPiiiii" for d in _FLASH_DIMS},
    "vision.cu": {
        "vis_layernorm": "PiPPPiiif",
        "vis_bias_act": "PiPiii",
        "vis_rope": "PiPPiii",
        **{f"vis_attn_{d}": "PiPiiiif" for d in _VISION_DIMS},
    },
}


def load_driver() -> Any:
    """Import pycuda's driver module and initialise CUDA.

    Returns:
        the ``pycuda.driver`` module.

    Raises:
        DeviceError: pycuda missing or unloadable (no NVIDIA driver), CUDA init failure, or no GPU.
    """
    try:
        import pycuda.driver as drv
    except ImportError as e:
        raise DeviceError(f"the GPU path needs pycuda and an NVIDIA driver: {e}") from e
    try:
        drv.init()
        count = drv.Device.count()
    except drv.Error as e:
        raise DeviceError(f"CUDA could not start: {e}") from e
    if count == 0:
        raise DeviceError("CUDA found no GPU")
    return drv


def find_nvcc() -> str:
    """Path of nvcc (``$CUDA_HOME/bin``, PATH, then /usr/local/cuda/bin).

    Raises:
        DeviceError: not found (the kernels are compiled at run time and need the CUDA toolkit).
    """
    candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")] if "CUDA_HOME" in os.environ else []
    found = shutil.which("nvcc")
    candidates += [found] if found else []
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise DeviceError("nvcc was not found (set CUDA_HOME or put the CUDA toolkit's bin on PATH): "
                      "the GPU path compiles its kernels at run time")


def cache_dir() -> str:
    """Directory of cached kernel builds (platformdirs user cache, ``deltadesk/cuda``)."""
    import platformdirs

    path = os.path.join(platformdirs.user_cache_dir("deltadesk"), "cuda")
    os.makedirs(path, exist_ok=True)
    return path


def check_vision_head(hd: int) -> None:
    """Check that :meth:`Kernels.vision_attention` has a kernel for head width ``hd``.

    Raises:
        DeviceError: ``hd`` above 128 or not a multiple of 4 (the kernel loads float4s).
    """
    if hd > _VISION_DIMS[-1] or hd % 4:
        raise DeviceError(f"the GPU vision attention handles head widths up to {_VISION_DIMS[-1]} in steps "
                          f"of 4, the tower has {hd}")


def _grid(n: int, per: int) -> int:
    return max(1, -(-n // per))


class Kernels:
    """Compiled kernels with one launch method each. Must be built with a CUDA context current."""

    def __init__(self, drv: Any, sources: tuple[str, ...]) -> None:
        """Compile (or load from the cache) ``sources`` and look up the kernels each of them defines.

        Args:
            drv: the ``pycuda.driver`` module.
            sources: file names under :data:`SOURCE_DIR` (:data:`PREFILL_SOURCES` or :data:`VISION_SOURCES`);
                only their kernels can be launched, and only they are required to build.

        Raises:
            DeviceError: a source is missing, nvcc fails (the message carries nvcc's output) or a kernel
                of these sources is missing.
        """
        from pycuda.compiler import SourceModule

        self._drv = drv
        nvcc = find_nvcc()
        cache = cache_dir()
        self._f: dict[str, Any] = {}
        for name in sources:
            path = SOURCE_DIR / name
            try:
                source = path.read_text()
            except OSError as e:
                raise DeviceError(f"CUDA kernel source {path} cannot be read: {e}") from e
            try:
                # pycuda keys its build cache on the preprocessed source, so common.cuh edits rebuild too
                module = SourceModule(source, nvcc=nvcc, options=["-O3"], no_extern_c=True, cache_dir=cache,
                                      include_dirs=[str(SOURCE_DIR)])
            except drv.Error as e:
                raise DeviceError(f"compiling {path} failed: {e}") from e
            missing = []
            for kernel, fmt in _SIGNATURES[name].items():
                try:
                    fn = module.get_function(kernel)
                except drv.Error:
                    missing.append(kernel)
                    continue
                fn.prepare(fmt)
                self._f[kernel] = fn
            if missing:
                raise DeviceError(f"CUDA kernels missing from {path}: {', '.join(missing)}")

    def _launch(self, name: str, grid: tuple[int, int], block: int, stream: Any, *args: Any) -> None:
        self._f[name].prepared_async_call((grid[0], grid[1], 1), (block, 1, 1), stream, *args)

    # ---- GEMM ----------------------------------------------------------------------------------

    def gemm(self, stream: Any, w: Matrix, w_ptr: int, a: int, lda: int, c: int, ldc: int, m: int, *,
             a_rows: int = 0, tiles: int = 0, n_tiles: int = 0, n_tiles_dev: int = 0, c_rows: int = 0,
             row_scale: int = 0, accumulate: bool = False) -> None:
        """``C[c_row(i), :w.rows] (+)= scale(i) * A[a_row(i), :w.cols] @ W^T`` for i < m (gemm.cu).

        With ``tiles`` (device (n_tiles, 3) int64), the grouped form: one M tile of at most
        :data:`~engine.kernels.cuda_layout.TILE_ROWS` rows per entry, the weight matrix of each tile at
        ``w_ptr`` + its byte offset; with ``n_tiles_dev`` (device int32), ``n_tiles`` is only an upper
        bound and the kernel reads the real count there. lda must be a multiple of 4 (float4 loads).
        """
        if lda % 4:
            raise DeviceError(f"GEMM on {w.name}: A row stride {lda} is not a multiple of 4")
        rows = n_tiles if tiles else _grid(m, DENSE_TILE_ROWS)
        if rows == 0 or m == 0:
            return
        name = f"qgemm32_{_TYPE_SUFFIX[w.qtype]}" if tiles else f"qgemm_{_TYPE_SUFFIX[w.qtype]}"
        self._launch(name, (_grid(w.rows, 128), rows), 256, stream,
                     a, lda, a_rows, w_ptr, w.row_bytes, tiles, c, ldc, c_rows, row_scale, int(accumulate),
                     m, w.rows, w.cols, n_tiles_dev)

    def gemv(self, stream: Any, w: Matrix, w_ptr: int, x: int, y: int) -> None:
        """y (w.rows,) = W @ x for one float32 row x (w.cols <= 8192): the last token's LM head."""
        if w.cols > 8192:
            raise DeviceError(f"GEMV on {w.name}: {w.cols} inputs exceed the kernel's 8192")
        self._launch(f"gemv_{_TYPE_SUFFIX[w.qtype]}", (min(_grid(w.rows, 8), 2048), 1), 256, stream, x, w_ptr,
                     w.row_bytes, y, w.rows, w.cols)

    def embed(self, stream: Any, qtype: GGMLQuantizationType, rows: int, row_bytes: int, out: int, n: int,
              k: int) -> None:
        """out (n, k) float32 = the n raw weight rows at ``rows`` (``row_bytes`` each, type qtype) dequantized."""
        self._launch(f"embed_rows_{_TYPE_SUFFIX[qtype]}", (n, 1), 256, stream, rows, row_bytes, out, k)

    # ---- rows ----------------------------------------------------------------------------------

    def rmsnorm(self, stream: Any, x: int, x_stride: int, w: int, y: int, y_stride: int, rows: int, d: int,
                eps: float) -> None:
        """``y[r] = rmsnorm(x[r]) * w`` for ``rows`` rows of ``d`` floats."""
        self._launch("rmsnorm_rows", (rows, 1), 256, stream, x, x_stride, w, y, y_stride, d, eps)

    def qk_norm_rope(self, stream: Any, x: int, x_row: int, x_head: int, w: int, pos: int, n: int, heads: int,
                     hd: int, rope_dims: int, theta: float, sections: tuple[int, ...], eps: float, y: int,
                     y_row: int, y_head: int) -> None:
        """Per-head RMSNorm then M-RoPE of ``heads`` heads of ``n`` tokens (pos: (3, n) int32)."""
        self._launch("qk_norm_rope", (n, heads), 128, stream, x, x_row, x_head, w, pos, n, hd, rope_dims,
                     float(theta), int(sections[1]), int(sections[2]), eps, y, y_row, y_head)

    def conv1d_silu(self, stream: Any, mixed: int, state_in: int, w: int, u: int, n: int, c: int, k: int) -> None:
        """Causal depthwise conv of (n, c) raw projections with the (k-1, c) state, then SiLU, into u."""
        self._launch("conv1d_silu", (_grid(c, 256), n), 256, stream, mixed, state_in, w, u, n, c, k)

    def conv_state_update(self, stream: Any, mixed: int, state_in: int, state_out: int, n: int, c: int,
                          k: int) -> None:
        """state_out = last k-1 rows of [state_in; mixed]."""
        self._launch("conv_state_update", (_grid(c, 256), k - 1), 256, stream, mixed, state_in, state_out, n, c, k)

    def l2norm_qk(self, stream: Any, u: int, n: int, c: int, nk: int, dk: int, eps: float, q_scale: float) -> None:
        """In-place L2 norm of the q and k heads of each (n, c) row; q also times q_scale."""
        self._launch("l2norm_qk", (n, 2 * nk), 32, stream, u, c, nk, dk, eps, q_scale)

    def gdn_gates(self, stream: Any, braw: int, araw: int, ssm_a: int, dt_bias: int, beta: int, g: int,
                  n: int, nv: int) -> None:
        """beta = sigmoid(braw); g = ssm_a * softplus(araw + dt_bias), (n, nv) each."""
        self._launch("gdn_gates", (_grid(n * nv, 256), 1), 256, stream, braw, araw, ssm_a, dt_bias, beta, g,
                     n * nv, nv)

    def gated_rmsnorm(self, stream: Any, o: int, w: int, z: int, y: int, rows: int, dv: int, eps: float) -> None:
        """y = rmsnorm(o) * w * silu(z) over ``rows`` rows of dv."""
        self._launch("gated_rmsnorm", (rows, 1), 32, stream, o, w, z, y, dv, eps)

    def swiglu(self, stream: Any, hg: int, act: int, rows: int, ff: int) -> None:
        """act (rows, ff) = silu(hg[:, :ff]) * hg[:, ff:]."""
        self._launch("swiglu_rows", (_grid(rows * ff, 256), 1), 256, stream, hg, act, rows, ff)

    def router_topk(self, stream: Any, logits: int, n: int, e: int, k: int, idx: int, w: int) -> None:
        """Softmax top-k routing of (n, e) logits into idx (n, k) int32 and weights (n, k)."""
        if e > 1024:
            raise DeviceError(f"router_topk handles up to 1024 experts, the model has {e}")
        self._launch("router_topk", (n, 1), 256, stream, logits, e, k, idx, w)

    def route(self, stream: Any, idx: int, w: int, n: int, k: int, e: int, stride: int, counts: int, cursor: int,
              tiles: int, n_tiles: int, a_rows: int, row_w: int, inv: int) -> int:
        """Routing tables on the GPU (rows.cu route_*): the device form of moe_stream.route_tables, expert e's
        weights at byte offset e * stride. counts / cursor: (e,) int32 scratch; n_tiles: device int32.

        Returns:
            the most tiles the routing can need (the grid size to launch the grouped GEMM with).
        """
        if e > 1024:
            raise DeviceError(f"GPU routing handles up to 1024 experts, the model has {e}")
        nk = n * k
        self._drv.memset_d32_async(counts, 0, e, stream)
        self._launch("route_count", (_grid(nk, 256), 1), 256, stream, idx, nk, counts)
        self._launch("route_plan", (1, 1), 1024, stream, counts, cursor, e, stride, TILE_ROWS, tiles, n_tiles)
        self._launch("route_scatter", (_grid(nk, 256), 1), 256, stream, idx, w, nk, k, cursor, a_rows, row_w, inv)
        return nk // TILE_ROWS + min(e, nk)

    def moe_combine(self, stream: Any, h: int, outs: int, inv: int, n: int, k: int, sh: int, y: int,
                    w_shgate: int, d: int) -> None:
        """h[t] += routed expert rows of t (+ gated shared expert when sh != 0)."""
        self._launch("moe_combine", (n, 1), 256, stream, h, outs, inv, k, sh, y, w_shgate, d)

    # ---- Gated DeltaNet and attention ----------------------------------------------------------

    def gdn_chunked(self, stream: Any, u: int, beta: int, g: int, cw: int, cu: int, cp: int, cg: int,
                    state: int, o: int, n: int, c: int, nk: int, nv: int, dk: int, dv: int) -> None:
        """Chunked gated delta rule over n tokens (gdn.cu): o (n, nv, dv), state (nv, dk, dv) updated."""
        if dk > 128:
            raise DeviceError(f"the GPU delta-net kernels handle head_k_dim <= 128, the model has {dk}")
        nc = _grid(n, 64)
        args = (n, c, nk, nv, dk, dv, nc)
        self._launch("gdn_chunk_prep", (nc, nv), 256, stream, u, beta, g, cw, cu, cp, cg, *args)
        self._launch("gdn_chunk_scan", (_grid(dv, 32), nv), 256, stream, u, cw, cu, cp, cg, state, o, *args)

    def flash_attention(self, stream: Any, q: int, qg: int, kc: int, vc: int, out: int, n: int, pos0: int,
                        n_head: int, n_kv: int, hd: int) -> None:
        """Gated causal GQA attention of n new tokens at cache rows pos0.. (attention.cu)."""
        group = n_head // n_kv
        if hd not in _FLASH_DIMS or group > 64:
            raise DeviceError(f"the GPU attention kernel handles head_dim in {_FLASH_DIMS} and up to 64 q heads "
                              f"per kv head, the model has {hd} and {group}")
        tq = 64 // group
        self._launch(f"flash_attn_{hd}", (_grid(n, tq), n_kv), 256, stream, q, qg, kc, vc, out, n, pos0,
                     n_head, n_kv, group)

    # ---- vision tower (vision.cu) ----------------------------------------------------------------

    def layer_norm(self, stream: Any, x: int, x_ld: int, w: int, b: int, y: int, y_group: int, y_ld: int,
                   rows: int, d: int, eps: float) -> None:
        """LayerNorm with weight and bias of ``rows`` rows of ``d`` floats (x row stride ``x_ld``); row r is
        written at float offset ``(r // y_group) * y_ld + (r % y_group) * d`` of y (y_group = merge**2 builds
        the merger's concatenated rows, 1 gives plain rows)."""
        self._launch("vis_layernorm", (rows, 1), 256, stream, x, x_ld, w, b, y, y_group, y_ld, d, float(eps))

    def bias_act(self, stream: Any, x: int, ld: int, b: int, rows: int, n: int, act: int) -> None:
        """In place ``x[r, :n] = act(x[r, :n] + b)`` for r < rows (row stride ld); act is :data:`ACT_NONE`,
        :data:`ACT_GELU_TANH` or :data:`ACT_GELU_ERF`."""
        self._launch("vis_bias_act", (min(_grid(rows * n, 256), 8192), 1), 256, stream, x, ld, b, rows, n, act)

    def rope_2d(self, stream: Any, qkv: int, ld: int, cos: int, sin: int, s: int, heads: int, hd: int) -> None:
        """2-D vision RoPE in place on the q and k heads of ``s`` fused qkv rows (row stride ld);
        cos, sin: (s, hd/2) float32."""
        self._launch("vis_rope", (min(_grid(s * heads * hd, 256), 8192), 1), 256, stream, qkv, ld, cos, sin, s,
                     heads, hd)

    def vision_attention(self, stream: Any, qkv: int, ld: int, out: int, out_ld: int, s: int, heads: int, hd: int,
                         scale: float) -> None:
        """Non-causal attention over the ``s`` tokens of one image, q/k/v read from the fused qkv rows (row
        stride ld, q at column 0, k at heads*hd, v at 2*heads*hd); out (s, heads*hd) with row stride out_ld.

        Raises:
            DeviceError: head width above 128 or not a multiple of 4.
        """
        check_vision_head(hd)
        hdp = -(-hd // 16) * 16
        self._launch(f"vis_attn_{hdp}", (_grid(s, 32), heads), 128, stream, qkv, ld, out, out_ld, s, heads, hd,
                     float(scale))
