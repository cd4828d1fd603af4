"""The text model on the native CPU kernels: :class:`NativeQwen35Model`.

Subclasses the numpy reference :class:`~engine.arch.qwen35.model.Qwen35Model` and overrides only its
hooks (``linear``, ``delta_rule``, ``attend``, ``moe``, ``ffn``); a one-token forward runs as one native
call (:mod:`engine.arch.qwen35.cpu_step`). Weight formats are decided once at load, tensor by tensor
(:func:`prepare_weight`): kernel types (BF16 and F16 included) are read in place (the file map, or the memory
the file was read into), other float weights stay float32 or become Q8_0 on request. Design:
docs/design/native-cpu.md (what runs where, weight formats).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from engine.gguf.file import GGUFFile
from engine.kernels import cpu, cpu_moe, cpu_q4il, cpu_rl, heap
from engine.ops import reference as ops
from engine.gguf.quant import FLOAT_TYPES, dequantize, type_name
from engine.turn.state import SequenceState

from .cpu_mixers import GDNLayer, attention_prefill, gdn_prefill
from .cpu_step import NativeStep, step_unsupported
from .hparams import Qwen35HParams
from .model import Callback, Qwen35Model
from .tensors import tensor_shapes

Q = GGMLQuantizationType
FLOAT_WEIGHTS = ("f32", "q8_0")
FUSED_STAGES = frozenset({"beta", "gate", "conv_output_silu", "attn_output", "ffn_moe_logits", "ffn_moe_out",
                          "ffn_shexp"})
"""Reference stages the fused GDN step and fused MoE never materialise (a float32-expert layer, or one
watched by an expert observer, still reports its MoE stages)."""
CONVERT_CHUNK_BYTES = 16 << 20
"""float32 bytes dequantized at a time while converting a tensor."""


class FloatMatrix:
    """A float32 weight (rows, k) with the :class:`engine.kernels.cpu.Matrix` call interface (numpy GEMM)."""

    def __init__(self, w: np.ndarray) -> None:
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.rows, self.k = self.w.shape
        self.qtype = Q.F32

    def rows_slice(self, r0: int, r1: int) -> "FloatMatrix":
        """Rows [r0, r1) (a view)."""
        return FloatMatrix(self.w[r0:r1])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (m, k) float32 -> (m, rows) float32, row by row (:func:`engine.ops.reference.linear_rows`)."""
        return ops.linear_rows(x, self.w)


Weight = cpu.Matrix | FloatMatrix


def to_q8_0(raw: np.ndarray, qtype: GGMLQuantizationType, k: int) -> np.ndarray:
    """Convert raw rows of any supported type to Q8_0 blocks, a bounded number of rows at a time.

    Args: raw (rows, row_bytes) uint8 of ``qtype``; k values per row (a multiple of 32).
    Returns: (rows, k // 32 * 34) uint8, a new array.
    Raises: UnsupportedModelError for a type :func:`engine.gguf.quant.dequantize` cannot read.
    """
    rows = raw.shape[0]
    out = np.empty((rows, k // cpu.QK * cpu.Q8_0_BYTES), dtype=np.uint8)
    step = max(1, CONVERT_CHUNK_BYTES // (4 * k))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = cpu.quantize_q8_0(dequantize(raw[r0:r1], qtype, (r1 - r0, k)))
    return out


# stored type -> (the in-place repack into its row-grouped layout, the longest rows it takes)
_REPACKS = {**{t: (functools.partial(cpu_q4il.interleave, qtype=t), cpu_q4il.MAX_ROW_BYTES[t])
               for t in cpu_q4il.TYPES},
            **{t: (functools.partial(cpu_rl.pack, qtype=t), cpu_rl.MAX_ROW_BYTES[t]) for t in cpu_rl.TYPES}}


def interleaves(gguf: GGUFFile, name: str) -> bool:
    """True when ``name`` is rewritten at load into its type's row-grouped layout (:data:`engine.kernels.cpu.LAYOUTS`:
    the 8-row interleave of Q4_0, MXFP4 and Q4_K, :mod:`engine.kernels.cpu_q4il`; Q2_K's and Q3_K's 4 rows as lanes,
    :mod:`engine.kernels.cpu_rl`):
    a projection whose bytes are the private copy of ``weights="ram"`` (:meth:`GGUFFile.writable_raw`), on the
    avx512vnni level (whose decode GEMV reads the layout; the others would unpack it on every product), not the
    token embedding (its rows are read as stored), rows no longer than the layout takes, and for stacked experts,
    experts of whole row groups."""
    info = gguf.info(name)
    if info.qtype not in _REPACKS or cpu.isa() != "avx512vnni" or name == "token_embd.weight":
        return False
    group = cpu.layout_rows(cpu.LAYOUTS[info.qtype])
    return ((len(info.ne) < 3 or info.ne[1] % group == 0) and gguf.writable_raw(name) is not None
            and gguf.raw(name).flags.c_contiguous and gguf.raw(name).shape[1] <= _REPACKS[info.qtype][1])


def prepare_weight(gguf: GGUFFile, name: str, float_weights: str = "f32", repack: bool = True) -> tuple[Weight, str]:
    """A projection weight (2-D, or 3-D stacked experts as rows) in the form the kernels read; ``repack``: rewrite
    it in place into its row-grouped layout where :func:`interleaves` allows.

    Returns: (the weight, the rule applied, e.g. "Q4_0 mapped", "Q4_0 resident" (file read into memory),
    "Q4_0 resident interleaved" (rewritten in place, :func:`interleaves`; MXFP4, Q4_K, Q2_K and Q3_K likewise),
    "Q6_K -> Q8_0", "F16 -> f32");
    see the module docstring for the rules and their bytes.
    """
    info = gguf.info(name)
    k = info.ne[0]
    raw = gguf.raw(name)
    qtype = info.qtype
    stored = type_name(qtype)
    if qtype in cpu.KERNEL_TYPES and k % cpu.QK == 0 and (qtype not in FLOAT_TYPES or float_weights == "f32"):
        where = gguf.residence(raw) if raw.flags.c_contiguous else ""
        if repack and interleaves(gguf, name):
            _REPACKS[qtype][0](gguf.writable_raw(name))
            return cpu.Matrix(raw, k, qtype, interleaved=True), f"{stored} {where} interleaved"
        return cpu.Matrix(np.ascontiguousarray(raw), k, qtype), f"{stored} {where or 'copied'}"
    if qtype in FLOAT_TYPES and float_weights == "f32":
        return FloatMatrix(dequantize(raw, qtype, (raw.shape[0], k))), f"{stored} -> f32"
    return cpu.Matrix(to_q8_0(raw, qtype, k), k, Q.Q8_0), f"{stored} -> Q8_0"


def projection_names(hp: Qwen35HParams, gguf: GGUFFile) -> list[str]:
    """Every weight the model multiplies by (projections, experts, LM head), in file order."""
    skip = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "token_embd.weight")
    names = [n for n, ne in tensor_shapes(hp).items()
             if len(ne) >= 2 and not n.endswith(skip) and gguf.has(n)]
    if not gguf.has("output.weight"):
        names.append("token_embd.weight")
    return names


class NativeQwen35Model(Qwen35Model):
    """:class:`~engine.arch.qwen35.model.Qwen35Model` with its projections, one-token mixers and MoE on the
    native CPU kernels (see the module docstring). Same ``forward`` contract and state.

    Args:
        hp: hyper-parameters. gguf: the open file (its tensors are used in place where possible).
        float_weights: "f32" (F16/BF16 read as stored, F32 as float32: exact) or "q8_0" (converted).
        repack: rewrite Q4_0, MXFP4, Q4_K, Q2_K and Q3_K weights read into memory into their layouts
            (:func:`interleaves`);
            False when another reader of the file's bytes (GPU prefill's upload) may come after the model.
    Attributes:
        weight_rules: rule -> (tensor count, bytes used by the kernels), e.g. {"Q4_0 mapped": (61, ...)}.
        step: the one-call decode step (:class:`~engine.arch.qwen35.cpu_step.NativeStep`), or None when
            the model has something it does not take; step_fallback: why not (None when it runs).
    Raises:
        ValueError: unknown ``float_weights``. UnsupportedModelError: a weight of an unsupported type.
    The kernels' ISA level and thread count are process-wide (:func:`engine.kernels.cpu.set_isa`,
    :func:`~engine.kernels.cpu.set_threads`); level "numpy" runs every kernel's numpy twin.
    """

    def __init__(self, hp: Qwen35HParams, gguf: GGUFFile, float_weights: str = "f32", repack: bool = True) -> None:
        if float_weights not in FLOAT_WEIGHTS:
            raise ValueError(f"float_weights must be one of {FLOAT_WEIGHTS}, got {float_weights!r}")
        super().__init__(hp, gguf)
        heap.keep_large_buffers()
        self.mats: dict[str, Weight] = {}
        self.weight_rules: dict[str, tuple[int, int]] = {}
        for name in projection_names(hp, gguf):
            mat, rule = prepare_weight(gguf, name, float_weights, repack)
            self.mats[name] = mat
            count, nbytes = self.weight_rules.get(rule, (0, 0))
            self.weight_rules[rule] = (count + 1, nbytes + (mat.raw.nbytes if isinstance(mat, cpu.Matrix)
                                                             else mat.w.nbytes))
        self.gdn = {il: self._gdn_layer(il) for il in range(hp.n_layer) if hp.is_recurrent(il)}
        self.fused_moe = {il: m for il in range(hp.n_layer) if hp.is_moe and (m := self._fused_moe(il))}
        self.step_fallback = step_unsupported(self)
        self.step = NativeStep(self) if self.step_fallback is None else None

    def _gdn_layer(self, il: int) -> GDNLayer:
        hp, p = self.hp, f"blk.{il}."
        return GDNLayer(hp.num_k_heads, hp.num_v_heads, hp.head_k_dim, hp.head_v_dim,
                        self.w(p + "ssm_conv1d.weight"), self.w(p + "ssm_dt.bias"), self.w(p + "ssm_a"),
                        self.w(p + "ssm_norm.weight"), hp.rms_eps)

    def _fused_moe(self, il: int) -> cpu_moe.PreparedMoE | None:
        """The layer's fused one-token MoE, or None when an expert weight is float32."""
        p = f"blk.{il}."
        parts = ["gate_exps", "up_exps", "down_exps"]
        shared = self.weights.has(p + "ffn_gate_shexp.weight")
        mats = [self.mats[f"{p}ffn_{x}.weight"] for x in parts + (["gate_shexp", "up_shexp", "down_shexp"]
                                                                    if shared else [])]
        if not all(isinstance(m, cpu.Matrix) for m in mats):
            return None
        raws = [m.raw for m in mats] + [None] * (6 - len(mats))
        fields = ["gate", "up", "down", "sh_gate", "sh_up", "sh_down"]
        return cpu_moe.PreparedMoE(cpu_moe.MoEWeights(
            router=self.w(p + "ffn_gate_inp.weight"), gate=raws[0], up=raws[1], down=raws[2],
            n_used=self.hp.n_expert_used, qtypes={f: m.traits for f, m in zip(fields, mats)},
            sh_gate=raws[3], sh_up=raws[4], sh_down=raws[5],
            sh_gate_inp=self.w(p + "ffn_gate_inp_shexp.weight") if shared else None))

    def forward(self, tokens: np.ndarray, state: SequenceState, embeddings: np.ndarray | None = None,
                positions: np.ndarray | None = None, all_logits: bool = False,
                cb: Callback | None = None) -> np.ndarray:
        """:meth:`Qwen35Model.forward`: one token in one native call (:class:`~engine.arch.qwen35.cpu_step.NativeStep`)
        when the step takes it, else the hooks with numpy's BLAS held to one thread. Both give the same bits.

        Here BLAS only does small products (float32 weights, row by row; the projections run on the
        native kernels with their own pool). Waking OpenBLAS's threads for each small product cost
        ~15 ms apiece on a 2-core VM: a 128-token prefill of the 35B-A3B slice took 15.4 s with BLAS
        threads and 2.2 s without.
        """
        if self.step is not None and self.step.takes(np.size(tokens), cb):
            return self.step.forward(tokens, state, embeddings, positions)
        with threadpool_limits(1, user_api="blas"):
            return super().forward(tokens, state, embeddings, positions, all_logits, cb)

    def forward_batch(self, tokens: np.ndarray, states: list[SequenceState],
                      positions: list[np.ndarray | None]) -> np.ndarray:
        """:meth:`Qwen35Model.forward_batch`: one row in the one-call native step, N rows in one batched native
        call (:meth:`~engine.arch.qwen35.cpu_step.NativeStep.forward_batch`) where the step takes the model, else
        through the hooks (the native GEMM over all rows, experts grouped over the batch) with numpy's BLAS held
        to one thread. All give the same bits."""
        if self.step is not None and self.step.takes(1, None):
            tokens, pos = self.batch_inputs(tokens, states, positions)
            if len(states) == 1:
                return self.step.forward(tokens, states[0], positions=positions[0])
            return self.step.forward_batch(tokens, states, pos)
        with threadpool_limits(1, user_api="blas"):
            return super().forward_batch(tokens, states, positions)

    # ---- hooks of the reference forward pass ---------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """:meth:`Qwen35Model.embed` with a prompt's rows gathered and dequantized in one call
        (:meth:`GGUFFile.rows`), not one numpy call a token: the same values. Raises: as the base method."""
        if "token_embd.weight" in self._w:
            return super().embed(tokens)
        return self.weights.rows("token_embd.weight", self.token_ids(tokens))

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """``x W^T`` on the kernels: x (n, in) float32 -> (n, out) float32."""
        return self.mats[name](x)

    def linears(self, x: np.ndarray, names: list[str]) -> list[np.ndarray]:
        """:meth:`Qwen35Model.linears` with quantized weights of one k in one native call
        (:func:`engine.kernels.cpu.matmul_many`: x prepared once, one pool job): the bits of :meth:`linear`."""
        mats = [self.mats[name] for name in names]
        if all(isinstance(mat, cpu.Matrix) for mat in mats):
            return cpu.matmul_many(mats, x)
        return [mat(x) for mat in mats]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """:meth:`Qwen35Model.norm` in C over the rows on the pool (:func:`engine.kernels.cpu.rmsnorm_rows`):
        the same bits."""
        return cpu.rmsnorm_rows(x, self.w(name), self.hp.rms_eps)

    def delta_rule(self, il: int, mixed: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                   state: SequenceState, cb: Callback) -> np.ndarray:
        """The fused C step (:func:`~engine.arch.qwen35.cpu_mixers.gdn_decode`), token by token."""
        return gdn_prefill(self.gdn[il], mixed, z, b, a, state.conv[il], state.ssm[il])

    def attend(self, q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """C attention over the cache in tiles of queries (:func:`~engine.arch.qwen35.cpu_mixers.attention_prefill`),
        each query with the bits one-query decode gives it."""
        return attention_prefill(q, gate, k, v)

    def moe(self, il: int, y: np.ndarray, cb: Callback) -> np.ndarray:
        """Routed experts + shared expert: one fused call (:func:`engine.kernels.cpu_moe.moe_ffn` for one
        token, :func:`~engine.kernels.cpu_moe.moe_prefill` grouped by expert for n, the same bits per
        token), else expert-wise products (also while an expert observer is attached: the fused
        calls form no per-expert outputs)."""
        if il in self.fused_moe and self.observer is None:
            if len(y) == 1:
                one = cpu_moe.moe_ffn(y[0], self.fused_moe[il])
                result = cpu_moe.MoEResult(one.out[None], one.experts[None], one.weights[None])
            else:
                result = cpu_moe.moe_prefill(y, self.fused_moe[il])
            cb("ffn_moe_topk", il, result.experts)
            cb("ffn_moe_weights_norm", il, result.weights)
            return result.out
        p = f"blk.{il}."
        logits = ops.linear_rows(y, self.w(p + "ffn_gate_inp.weight"))
        idx, weights = ops.topk_route(logits, self.hp.n_expert_used)
        cb("ffn_moe_topk", il, idx)
        cb("ffn_moe_weights_norm", il, weights)
        ff, d = self.hp.n_ff_exp, self.hp.n_embd
        gate, up, down = (self.mats[f"{p}ffn_{x}_exps.weight"] for x in ("gate", "up", "down"))
        out = np.zeros_like(y)
        norms = np.zeros(idx.shape) if self.observer is not None else None
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            e0, e1 = int(e) * ff, (int(e) + 1) * ff
            h = _swiglu(y[rows], gate.rows_slice(e0, e1), up.rows_slice(e0, e1),
                        down.rows_slice(int(e) * d, (int(e) + 1) * d))
            if norms is not None:
                norms[rows, slot] = np.linalg.norm(h.astype(np.float64), axis=-1)
            out[rows] += weights[rows, slot, None] * h
        if self.observer is not None:
            self.observer.routed(il, logits, idx, norms)
        cb("ffn_moe_out", il, out)
        if self.weights.has(p + "ffn_gate_shexp.weight"):
            sh = _swiglu(y, *(self.mats[f"{p}ffn_{x}_shexp.weight"] for x in ("gate", "up", "down")))
            sh = sh * ops.sigmoid(ops.linear_rows(y, self.w(p + "ffn_gate_inp_shexp.weight")[None]))
            cb("ffn_shexp", il, sh)
            out = out + sh
        return out

    def ffn(self, il: int, y: np.ndarray) -> np.ndarray:
        """Dense SwiGLU FFN of ``qwen35`` files on the kernels: (n, d) -> (n, d); the gate in C
        (:func:`engine.kernels.cpu.silu_mul`, as the native decode step computes it)."""
        gate, up, down = (self.mats[f"blk.{il}.ffn_{x}.weight"] for x in ("gate", "up", "down"))
        return down(cpu.silu_mul(gate(y), up(y)))


def _swiglu(x: np.ndarray, gate: Callable, up: Callable, down: Callable) -> np.ndarray:
    """``down(silu(gate(x)) * up(x))`` for x (n, d) float32."""
    return down(ops.silu(gate(x)) * up(x))
