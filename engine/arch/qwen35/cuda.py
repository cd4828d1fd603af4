"""GPU prefill for Qwen3.5/3.6 hybrid models, routed experts streamed from pinned host RAM under a VRAM
budget; decode then continues on the CPU from the state this fills.

:class:`CudaPrefill` plans placement once per model and uploads weights in their stored type;
``prefill(tokens, state)`` runs layer by layer with the reference's numerics and copies the state back.
Device failures raise :class:`~engine.errors.DeviceError` (callers fall back to CPU prefill).
Design: docs/design/gpu-prefill.md.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine.kernels.cuda_buffers import Activations, Copier, CopyTask
from engine.kernels.cuda_context import CudaBackend
from engine.kernels.cuda_kernels import PREFILL_SOURCES, Kernels
from engine.kernels.cuda_layout import GPU_TYPES, TILE_ROWS, Matrix
from engine.gguf.quant import dequantize
from engine.kernels.moe_stream import (ExpertLayout, LayerTelemetry, Placement, PrefillTelemetry, copy_runs,
                                       route_tables, use_selective)
from engine.turn.kv_types import kv_store, kv_widen
from engine.turn.state import SequenceState

from .cuda_plan import activation_groups, stored_rows, pass_tokens, plan_file
from .hparams import Qwen35HParams
from .model import Callback

DEFAULT_MARGIN = 512 << 20
"""Default budget = free VRAM at load minus max(this, 5% of the card)."""

PLAN_TOKENS = 4096
"""Prompt length whose activations and KV cache the placement reserves before giving VRAM to experts."""

STAGES = ("inp_embd", "attn_norm", "attn_residual", "attn_post_norm", "l_out", "result_norm", "result_output")
"""The reference forward's stage names (:meth:`~engine.arch.qwen35.model.Qwen35Model.forward`) a pass reports to
``cb``: the values held between kernels; the mixers' and experts' insides stay on the GPU."""


class CudaPrefill(CudaBackend):
    """GPU prefill of one model file.

    Args:
        hp: the model's hyper-parameters (``gguf_file.hparams``).
        gguf_file: an open :class:`engine.gguf.file.GGUFFile` (``.raw``, ``.f32``, ``.info``, ``.has``).
        budget_bytes: VRAM budget; default free memory at load minus max(512 MiB, 5%).
        plan_tokens: prompt length reserved for when deciding how many expert layers stay resident.

    Attributes:
        plan: the :class:`~engine.kernels.moe_stream.Placement` (``plan.text()`` for the log).
        last_telemetry: :class:`~engine.kernels.moe_stream.PrefillTelemetry` of the last prefill, or None.

    Raises:
        DeviceError: no usable GPU, pycuda or nvcc, a kernel fails to build, the budget is too small for
            the resident weights (:class:`~engine.errors.DeviceBudgetError`), or GPU / pinned host memory runs
            out while loading. The GPU and pinned memory taken so far is released before any exception
            (KeyboardInterrupt included) leaves.
    """

    OOM_HINT = " (lower the VRAM budget or use CPU prefill)"

    def __init__(self, hp: Qwen35HParams, gguf_file: Any, budget_bytes: int | None = None,
                 plan_tokens: int = PLAN_TOKENS) -> None:
        super().__init__()
        self.hp = hp
        self.file = gguf_file
        self.last_telemetry: PrefillTelemetry | None = None
        self._cb: Callback | None = None
        self._pinned: dict[int, np.ndarray] = {}
        self._open("loading the model onto the GPU", lambda: self._load(budget_bytes, plan_tokens))

    def _release(self) -> None:
        """Stop the copy worker and drop the pinned expert and staging buffers."""
        if getattr(self, "_copier", None) is not None:
            self._copier.close()
            self._copier = None
        self._pinned.clear()
        getattr(self, "staging", {}).clear()

    # ---- loading ---------------------------------------------------------------------------------

    def _load(self, budget_bytes: int | None, plan_tokens: int) -> None:
        drv, hp, f = self._drv, self.hp, self.file
        free, total = drv.mem_get_info()
        budget = budget_bytes if budget_bytes is not None else free - max(DEFAULT_MARGIN, total // 20)
        planned = plan_file(hp, f, budget, plan_tokens)
        self.plan: Placement = planned.plan
        self.layouts: dict[int, ExpertLayout] = planned.layouts
        matrices, vectors, head = planned.matrices, planned.vectors, planned.head
        self.kernels = Kernels(drv, PREFILL_SOURCES)
        self.head = matrices[head]
        self.mat: dict[str, tuple[Matrix, int]] = {}
        for name, m in matrices.items():
            data = stored_rows(f, name, m.qtype)
            self.mat[name] = (m, self._dev.upload(data))
        self.vec = {n: self._dev.upload(np.asarray(f.f32(n), dtype=np.float32)) for n in vectors}
        self.conv_state: dict[int, int] = {}
        self.ssm_state: dict[int, int] = {}
        for il in range(hp.n_layer):
            if hp.is_recurrent(il):
                self.conv_state[il] = self._dev.alloc((hp.conv_kernel - 1) * hp.conv_dim * 4)
                self.ssm_state[il] = self._dev.alloc(hp.num_v_heads * hp.head_k_dim * hp.head_v_dim * 4)
        self.experts: dict[int, int] = {}
        for il in self.plan.resident_experts:
            self.experts[il] = self._dev.upload(self._pack_experts(il, np.empty(self.layouts[il].nbytes, np.uint8)))
        for il in self.plan.streamed_experts:
            self._pinned[il] = self._pack_experts(il, drv.pagelocked_empty(self.layouts[il].nbytes, np.uint8))
        self.slots = [self._dev.alloc(self.plan.slot_bytes) for _ in range(self.plan.n_slots)]
        self.compute = drv.Stream()
        self.copy_stream = drv.Stream()
        self._copier = Copier(drv, self._ctx)
        self.kv: dict[int, tuple[int, int]] = {}
        self.kv_rows = 0
        self.act: Activations | None = None
        self.staging: dict[str, np.ndarray] = {}

    def _pack_experts(self, il: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (nbytes,) uint8 with layer ``il``'s experts, each ``[gate rows | up rows | down rows]``
        (rows of a type the layout maps to Q8_0 converted on the way: :func:`stored_rows`)."""
        lay, f = self.layouts[il], self.file
        view = out.reshape(lay.n_expert, lay.stride)
        half = lay.n_ff * lay.gu_row_bytes
        p = f"blk.{il}.ffn_"
        view[:, :half] = stored_rows(f, p + "gate_exps.weight", lay.gu_qtype).reshape(lay.n_expert, half)
        view[:, half:2 * half] = stored_rows(f, p + "up_exps.weight", lay.gu_qtype).reshape(lay.n_expert, half)
        view[:, 2 * half:] = stored_rows(f, p + "down_exps.weight", lay.down_qtype).reshape(lay.n_expert, -1)
        return out

    # ---- prefill ---------------------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray, state: SequenceState, positions: np.ndarray | None = None,
                cb: Callback | None = None) -> np.ndarray:
        """Run ``tokens`` through the model on the GPU, continuing ``state`` (in place, like ``Qwen35Model.forward``).

        Args:
            tokens: (n,) int token ids, n >= 1.
            state: the sequence state; ``state.pos`` is the cache row of ``tokens[0]`` and advances by n.
                Its conv, delta-rule and KV rows ``[:pos]`` are uploaded first and the new values copied back.
            positions: (3, n) int t/h/w M-RoPE positions; default ``state.pos + arange(n)`` for all three.
            cb: ``cb(stage, il, x)`` with the reference's names of the values a pass holds between kernels
                (:data:`STAGES`; each pass reports its own rows). Every report waits for the GPU.

        Returns:
            (n_vocab,) float32 logits of the last token.

        Raises:
            ContextFullError: ``state.pos + n`` exceeds the state's capacity.
            ValueError: empty prompt, a token id outside the vocabulary, or bad ``positions``.
            DeviceError: a CUDA failure (out of memory included); ``state`` is then unchanged.
        """
        tokens, positions = state.chunk_inputs(tokens, positions, self.hp.n_vocab)
        n = tokens.shape[0]
        self._cb = cb
        try:
            with self._guard(f"prefilling {n} tokens"):
                return self._prefill(tokens, state, np.ascontiguousarray(positions, dtype=np.int32))
        finally:
            self._cb = None

    def _prefill(self, tokens: np.ndarray, state: SequenceState, positions: np.ndarray) -> np.ndarray:
        hp = self.hp
        t_wall = time.perf_counter()
        n, p0 = tokens.shape[0], state.pos
        n_pass = pass_tokens(hp, n, p0 + n, self.plan.budget - self.plan.fixed_bytes)
        self._prepare(n_pass, p0 + n)
        self._upload_state(state)
        mode = "resident"
        if self.plan.streamed_experts:
            mode = "selective" if use_selective(hp.n_expert, hp.n_expert_used, n_pass) else "streamed"
        tel = PrefillTelemetry(n_tokens=n, passes=0, mode=mode, wall_ms=0.0, gpu_ms=0.0, h2d_bytes=0, h2d_ms=0.0,
                               vram_budget=self.plan.budget, vram_used=0, vram_free=0,
                               layers=[LayerTelemetry(il, "gdn" if hp.is_recurrent(il) else "attention",
                                                      self._expert_mode(il, mode)) for il in range(hp.n_layer)])
        self._events: list[tuple[int, str, Any, Any, int]] = []
        self._tasks: list[CopyTask] = []
        self._slot_free: list[Any] = [None] * self.plan.n_slots
        first = last = None
        for a in range(0, n, n_pass):
            b = min(n, a + n_pass)
            e0, last = self._pass(tokens[a:b], positions[:, a:b], p0 + a, b == n, mode)
            first = e0 if first is None else first
            tel.passes += 1
        for task in self._tasks:
            task.wait()
        self.compute.synchronize()
        self.copy_stream.synchronize()
        logits = self.staging["logits"].copy()
        self._download_state(state, p0, p0 + n)
        self._finish_telemetry(tel, first, last, t_wall)
        return logits

    def _upload_state(self, state: SequenceState) -> None:
        """The state's KV rows ``[:pos]`` (widened to float32 from an F16 or Q8_0 cache, exactly) and every GDN layer's
        conv window and delta-rule state, to the GPU."""
        drv, p0 = self._drv, state.pos
        for il, (kp, vp) in self.kv.items():
            if p0:
                drv.memcpy_htod(kp, np.ascontiguousarray(kv_widen(state.k[il][:p0])))
                drv.memcpy_htod(vp, np.ascontiguousarray(kv_widen(state.v[il][:p0])))
        for il in self.conv_state:
            drv.memcpy_htod(self.conv_state[il], np.ascontiguousarray(state.conv[il], dtype=np.float32))
            drv.memcpy_htod(self.ssm_state[il], np.ascontiguousarray(state.ssm[il], dtype=np.float32))

    def _download_state(self, state: SequenceState, p0: int, end: int) -> None:
        """The new KV rows ``[p0, end)`` (rounded into an F16 or Q8_0 cache as the CPU path rounds them) and the
        recurrent state back into ``state``; ``state.pos`` = end."""
        drv, hp = self._drv, self.hp
        for il, (kp, vp) in self.kv.items():
            row = hp.n_head_kv * hp.head_dim * 4
            for cache, ptr in ((state.k[il], kp), (state.v[il], vp)):
                rows = np.empty((end - p0, hp.n_head_kv, hp.head_dim), np.float32)
                drv.memcpy_dtoh(rows, ptr + p0 * row)
                kv_store(cache, p0, rows)
        # recurrent state lands in temporaries first: a copy failing half way leaves ``state`` as it was
        conv = {il: np.empty_like(state.conv[il]) for il in self.conv_state}
        ssm = {il: np.empty_like(state.ssm[il]) for il in self.ssm_state}
        for il in self.conv_state:
            drv.memcpy_dtoh(conv[il], self.conv_state[il])
            drv.memcpy_dtoh(ssm[il], self.ssm_state[il])
        for il in self.conv_state:
            state.conv[il][...] = conv[il]
            state.ssm[il][...] = ssm[il]
        state.pos = end

    def _finish_telemetry(self, tel: PrefillTelemetry, first: Any, last: Any, t_wall: float) -> None:
        """Per-layer compute / copy times and bytes from the recorded events, totals, VRAM; kept as last_telemetry."""
        tel.add_events([(il, kind, ea.time_till(eb), nbytes) for il, kind, ea, eb, nbytes in self._events],
                       {il: lay.stride for il, lay in self.layouts.items()})
        tel.gpu_ms = first.time_till(last)
        tel.vram_used = self._dev.used
        tel.vram_free = self._drv.mem_get_info()[0]
        tel.wall_ms = (time.perf_counter() - t_wall) * 1e3
        self.last_telemetry = tel

    def _expert_mode(self, il: int, mode: str) -> str:
        if not self.hp.is_moe:
            return "dense"
        return "resident" if il in self.experts else mode

    def _prepare(self, n_pass: int, end: int) -> None:
        """Size the activation arena, the KV caches and the pinned staging buffers for this prefill."""
        drv, hp = self._drv, self.hp
        if self.act is None or self.act.capacity < n_pass:
            if self.act is not None:
                self._dev.free(self.act.base)
                self.act = None
            self.act = Activations(self._dev, activation_groups(hp, n_pass), n_pass)
        if self.kv_rows < end:
            for kp, vp in self.kv.values():
                self._dev.free(kp)
                self._dev.free(vp)
            row = hp.n_head_kv * hp.head_dim * 4
            self.kv = {il: (self._dev.alloc(end * row), self._dev.alloc(end * row))
                       for il in range(hp.n_layer) if not hp.is_recurrent(il)}
            self.kv_rows = end
        nk = n_pass * hp.n_expert_used
        sizes = {"emb": (n_pass * hp.n_embd * 4, np.uint8), "pos": (3 * n_pass, np.int32),
                 "logits": (hp.n_vocab, np.float32), "tidx": (nk, np.int32), "tw": (nk, np.float32),
                 "a_rows": (nk, np.int32), "row_w": (nk, np.float32), "inv": (nk, np.int32),
                 "tiles": ((nk // TILE_ROWS + hp.n_expert + 1) * 3, np.int64)}
        for name, (count, dtype) in sizes.items():
            have = self.staging.get(name)
            if have is None or have.size < count:
                self.staging[name] = drv.pagelocked_empty(max(count, 1), dtype)

    def _upload_async(self, dst: int, name: str, values: np.ndarray) -> None:
        """Copy ``values`` through pinned staging buffer ``name`` to ``dst`` on the compute stream."""
        stage = self.staging[name]
        buf = stage[:values.nbytes // stage.itemsize]
        buf.view(np.uint8)[...] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        self._drv.memcpy_htod_async(dst, buf, self.compute)

    def _embed(self, tokens: np.ndarray) -> None:
        """h = token embeddings: raw rows gathered on the host, dequantized by a kernel (types with one),
        else dequantized on the host."""
        info = self.file.info("token_embd.weight")
        rows = self.file.raw("token_embd.weight")[tokens]
        a, n, d = self.act.ptr, tokens.shape[0], self.hp.n_embd
        if info.qtype in GPU_TYPES:
            self._upload_async(a["emb"], "emb", rows)
            self.kernels.embed(self.compute, info.qtype, a["emb"], rows.shape[1], a["h"], n, d)
        else:
            self._upload_async(a["h"], "emb", dequantize(rows, info.qtype, (n, d)))

    def _report(self, stage: str, il: int, ptr: int, rows: int, cols: int) -> None:
        """Hand the (rows, cols) float32 activation at ``ptr`` to the stage callback, when there is one."""
        if self._cb is None:
            return
        self.compute.synchronize()
        host = np.empty((rows, cols), dtype=np.float32)
        self._drv.memcpy_dtoh(host, ptr)
        self._cb(stage, il, host)

    def _record(self, stream: Any) -> Any:
        ev = self._drv.Event()
        ev.record(stream)
        return ev

    def _pass(self, tokens: np.ndarray, positions: np.ndarray, p0: int, last: bool, mode: str) -> tuple[Any, Any]:
        """One pass over all layers for ``tokens`` at cache rows p0.. ; returns the first and last compute events."""
        hp, k, cs = self.hp, self.kernels, self.compute
        a, n, d = self.act.ptr, tokens.shape[0], hp.n_embd
        self._embed(tokens)
        self._report("inp_embd", -1, a["h"], n, d)
        self._upload_async(a["pos"], "pos", positions)
        start = self._record(cs)

        order = [il for il in self.plan.streamed_experts]
        self._slot_of: dict[int, int] = {}
        self._copied: dict[int, Any] = {}
        self._slot_turn = 0
        if mode == "streamed":
            self._slot_of = {il: j % len(self.slots) for j, il in enumerate(order)}
            for il in order[:len(self.slots)]:
                self._copy_layer(il)

        for il in range(hp.n_layer):
            p = f"blk.{il}."
            ev0 = self._record(cs)
            k.rmsnorm(cs, a["h"], d, self.vec[p + "attn_norm.weight"], a["x"], d, n, d, hp.rms_eps)
            self._report("attn_norm", il, a["x"], n, d)
            if hp.is_recurrent(il):
                self._gated_delta_net(il, n)
            else:
                self._attention(il, n, p0)
            self._report("attn_residual", il, a["h"], n, d)
            k.rmsnorm(cs, a["h"], d, self.vec[p + "post_attention_norm.weight"], a["x"], d, n, d, hp.rms_eps)
            self._report("attn_post_norm", il, a["x"], n, d)
            if hp.is_moe:
                self._moe(il, n, mode, order)
            else:
                self._ffn(il, n)
            self._report("l_out", il, a["h"], n, d)
            self._events.append((il, "compute", ev0, self._record(cs), 0))

        if last:
            k.rmsnorm(cs, a["h"] + (n - 1) * d * 4, d, self.vec["output_norm.weight"], a["last"], d, 1, d, hp.rms_eps)
            self._report("result_norm", -1, a["last"], 1, d)
            m, ptr = self.mat[self.head.name]
            k.gemv(cs, m, ptr, a["last"], a["logits"])
            self._report("result_output", -1, a["logits"], 1, hp.n_vocab)
            self._drv.memcpy_dtoh_async(self.staging["logits"][:hp.n_vocab], a["logits"], cs)
        end = self._record(cs)
        cs.synchronize()
        return start, end

    # ---- mixers ----------------------------------------------------------------------------------

    def _gemm(self, name: str, a: int, lda: int, c: int, ldc: int, m: int, accumulate: bool = False) -> None:
        w, ptr = self.mat[name]
        self.kernels.gemm(self.compute, w, ptr, a, lda, c, ldc, m, accumulate=accumulate)

    def _gated_delta_net(self, il: int, n: int) -> None:
        """docs/spec/qwen35.md 3.2: h += W_out gated_norm(delta_rule(conv(W_qkv x)), W_z x)."""
        hp, k, cs, a = self.hp, self.kernels, self.compute, self.act.ptr
        p, d, C, vd, nv = f"blk.{il}.", hp.n_embd, hp.conv_dim, hp.value_dim, hp.num_v_heads
        self._gemm(p + "attn_qkv.weight", a["x"], d, a["mixed"], C, n)
        self._gemm(p + "attn_gate.weight", a["x"], d, a["z"], vd, n)
        self._gemm(p + "ssm_beta.weight", a["x"], d, a["braw"], nv, n)
        self._gemm(p + "ssm_alpha.weight", a["x"], d, a["araw"], nv, n)
        k.gdn_gates(cs, a["braw"], a["araw"], self.vec[p + "ssm_a"], self.vec[p + "ssm_dt.bias"], a["beta"], a["g"],
                    n, nv)
        k.conv1d_silu(cs, a["mixed"], self.conv_state[il], self.vec[p + "ssm_conv1d.weight"], a["u"], n, C,
                      hp.conv_kernel)
        k.conv_state_update(cs, a["mixed"], self.conv_state[il], a["conv_new"], n, C, hp.conv_kernel)
        self._drv.memcpy_dtod_async(self.conv_state[il], a["conv_new"], (hp.conv_kernel - 1) * C * 4, cs)
        k.l2norm_qk(cs, a["u"], n, C, hp.num_k_heads, hp.head_k_dim, hp.rms_eps,
                    float(np.float32(hp.head_k_dim ** -0.5)))
        k.gdn_chunked(cs, a["u"], a["beta"], a["g"], a["cw"], a["cu"], a["cp"], a["cg"], self.ssm_state[il], a["o"],
                      n, C, hp.num_k_heads, nv, hp.head_k_dim, hp.head_v_dim)
        k.gated_rmsnorm(cs, a["o"], self.vec[p + "ssm_norm.weight"], a["z"], a["y"], n * nv, hp.head_v_dim, hp.rms_eps)
        self._gemm(p + "ssm_out.weight", a["y"], vd, a["h"], d, n, accumulate=True)

    def _attention(self, il: int, n: int, p0: int) -> None:
        """docs/spec/qwen35.md 3.1: h += W_o (softmax(q k^T) v * sigmoid(gate)); K (normed, rotated) and V land
        in the cache."""
        hp, k, cs, a = self.hp, self.kernels, self.compute, self.act.ptr
        p, d, hd, nh, nkv = f"blk.{il}.", hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
        kc, vc = self.kv[il]
        row = nkv * hd
        self._gemm(p + "attn_q.weight", a["x"], d, a["qg"], 2 * nh * hd, n)
        self._gemm(p + "attn_k.weight", a["x"], d, a["kraw"], row, n)
        self._gemm(p + "attn_v.weight", a["x"], d, vc + p0 * row * 4, row, n)
        k.qk_norm_rope(cs, a["qg"], 2 * nh * hd, 2 * hd, self.vec[p + "attn_q_norm.weight"], a["pos"], n, nh, hd,
                       hp.rope_dims, hp.rope_theta, hp.rope_sections, hp.rms_eps, a["q"], nh * hd, hd)
        k.qk_norm_rope(cs, a["kraw"], row, hd, self.vec[p + "attn_k_norm.weight"], a["pos"], n, nkv, hd,
                       hp.rope_dims, hp.rope_theta, hp.rope_sections, hp.rms_eps, kc + p0 * row * 4, row, hd)
        k.flash_attention(cs, a["q"], a["qg"], kc, vc, a["att"], n, p0, nh, nkv, hd)
        self._gemm(p + "attn_output.weight", a["att"], nh * hd, a["h"], d, n, accumulate=True)

    # ---- feed-forward ----------------------------------------------------------------------------

    def _ffn(self, il: int, n: int) -> None:
        """Dense SwiGLU (qwen35): h += W_down(silu(W_gate x) * W_up x)."""
        hp, a = self.hp, self.act.ptr
        p, d, ff = f"blk.{il}.", hp.n_embd, hp.n_ff
        self._gemm(p + "ffn_gate.weight", a["x"], d, a["hg"], 2 * ff, n)
        self._gemm(p + "ffn_up.weight", a["x"], d, a["hg"] + ff * 4, 2 * ff, n)
        self.kernels.swiglu(self.compute, a["hg"], a["act"], n, ff)
        self._gemm(p + "ffn_down.weight", a["act"], ff, a["h"], d, n, accumulate=True)

    def _copy_layer(self, il: int) -> None:
        """Queue the copy of all of layer ``il``'s experts into its stream buffer (waits until the buffer is free)."""
        slot = self._slot_of[il]
        self._copy_runs(il, slot, [(0, self.hp.n_expert)])

    def _copy_runs(self, il: int, slot: int, runs: list[tuple[int, int]]) -> None:
        """Queue (on the copy worker) copies of expert runs (first, count) of layer ``il`` into buffer ``slot``,
        packed in order, after the buffer's last reader is done."""
        drv, xs, stride = self._drv, self.copy_stream, self.layouts[il].stride
        free, host, dst = self._slot_free[slot], self._pinned[il], self.slots[slot]
        ev0, ev1 = drv.Event(), drv.Event()

        def issue() -> None:
            if free is not None:
                xs.wait_for_event(free)
            ev0.record(xs)
            at = dst
            for first, count in runs:
                drv.memcpy_htod_async(at, host[first * stride:(first + count) * stride], xs)
                at += count * stride
            ev1.record(xs)

        task = self._copier.submit(issue)
        self._tasks.append(task)
        self._copied[il] = (task, ev1)
        self._events.append((il, "copy", ev0, ev1, sum(c for _, c in runs) * stride))

    def _shared_expert(self, p: str, n: int) -> Any:
        """Queue the shared expert's SwiGLU of ``x`` into ``sh`` and return that buffer (0 without a shared expert)."""
        hp, a = self.hp, self.act.ptr
        if not hp.n_ff_shexp:
            return 0
        d, fs = hp.n_embd, hp.n_ff_shexp
        self._gemm(p + "ffn_gate_shexp.weight", a["x"], d, a["hs"], 2 * fs, n)
        self._gemm(p + "ffn_up_shexp.weight", a["x"], d, a["hs"] + fs * 4, 2 * fs, n)
        self.kernels.swiglu(self.compute, a["hs"], a["acts"], n, fs)
        self._gemm(p + "ffn_down_shexp.weight", a["acts"], fs, a["sh"], d, n)
        return a["sh"]

    def _selective_routes(self, il: int, n: int) -> tuple[int, int]:
        """Selective streaming: copy only the experts the router chose into the next slot and upload the
        host-built routing tables. Returns (slot, tile count)."""
        hp, a, lay = self.hp, self.act.ptr, self.layouts[il]
        E, top, nk = hp.n_expert, hp.n_expert_used, n * hp.n_expert_used
        idx = self.staging["tidx"][:nk].reshape(n, top)
        used = np.unique(idx)
        offsets = np.zeros(E, dtype=np.int64)
        offsets[used] = np.arange(used.size, dtype=np.int64) * lay.stride
        slot = self._slot_turn % len(self.slots)
        self._slot_turn += 1
        self._copy_runs(il, slot, copy_runs(used))
        tables = route_tables(idx, self.staging["tw"][:nk].reshape(n, top), E, offsets)
        for name in ("a_rows", "row_w", "inv", "tiles"):
            self._upload_async(a[name], name, getattr(tables, name))
        return slot, tables.tiles.shape[0]

    def _moe(self, il: int, n: int, mode: str, order: list[int]) -> None:
        """docs/spec/qwen35.md 3.3: h += sum of the top-k routed experts (weighted) + the gated shared expert.

        Routing tables are built on the GPU (no host round trip), except in selective mode, where the
        host needs the selected experts to copy them and builds the tables itself.
        """
        hp, k, cs, a, drv = self.hp, self.kernels, self.compute, self.act.ptr, self._drv
        p, d, E, top, ff = f"blk.{il}.", hp.n_embd, hp.n_expert, hp.n_expert_used, hp.n_ff_exp
        lay = self.layouts[il]
        nk = n * top
        resident = il in self.experts
        selective = mode == "selective" and not resident
        self._gemm(p + "ffn_gate_inp.weight", a["x"], d, a["rlog"], E, n)
        k.router_topk(cs, a["rlog"], n, E, top, a["tidx"], a["tw"])
        if selective:
            drv.memcpy_dtoh_async(self.staging["tidx"][:nk], a["tidx"], cs)
            drv.memcpy_dtoh_async(self.staging["tw"][:nk], a["tw"], cs)
            routed = self._record(cs)

        sh = self._shared_expert(p, n)  # queued before the host waits for a selective routing: the GPU stays busy

        slot, n_tiles_dev = -1, 0
        if selective:
            routed.synchronize()
            slot, n_tiles = self._selective_routes(il, n)
        else:
            if not resident:
                slot = self._slot_of[il]
            n_tiles = k.route(cs, a["tidx"], a["tw"], n, top, E, lay.stride, a["rcount"], a["rcursor"], a["tiles"],
                              a["rntiles"], a["a_rows"], a["row_w"], a["inv"])
            n_tiles_dev = a["rntiles"]
        base = self.experts[il] if resident else self.slots[slot]

        if slot >= 0:
            task, copied = self._copied[il]
            task.wait()
            cs.wait_for_event(copied)
        gu = Matrix(p + "ffn_gate_up_exps", lay.gu_qtype, 2 * ff, d, lay.gu_row_bytes, False)
        down = Matrix(p + "ffn_down_exps", lay.down_qtype, d, ff, lay.down_row_bytes, False)
        k.gemm(cs, gu, base, a["x"], d, a["hg"], 2 * ff, nk, a_rows=a["a_rows"], tiles=a["tiles"], n_tiles=n_tiles,
               n_tiles_dev=n_tiles_dev)
        k.swiglu(cs, a["hg"], a["act"], nk, ff)
        k.gemm(cs, down, base + lay.gu_bytes, a["act"], ff, a["outs"], d, nk, tiles=a["tiles"], n_tiles=n_tiles,
               n_tiles_dev=n_tiles_dev, row_scale=a["row_w"])
        if slot >= 0:
            self._slot_free[slot] = self._record(cs)
            if mode == "streamed":
                j = order.index(il) + len(self.slots)
                if j < len(order):
                    self._copy_layer(order[j])
        k.moe_combine(cs, a["h"], a["outs"], a["inv"], n, top, sh, a["x"],
                      self.vec[p + "ffn_gate_inp_shexp.weight"] if sh else 0, d)
