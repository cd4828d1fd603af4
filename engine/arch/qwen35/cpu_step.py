"""The decode step in one native call per token: :class:`NativeStep` (native/cpu/runtime/step.c, ``dd_step``),
and per batched step of N sequences (``dd_step_batch``, :meth:`NativeStep.forward_batch`).

Runs every layer, the final norm and the LM head in C with the GIL released; Python checks inputs,
looks up the embedding rows and the RoPE tables. Bit-identical to the per-hook forward of
``NativeQwen35Model`` (tests/test_native_step.py, tests/test_batch_decode.py). Not taken: float32 projections
(:func:`step_unsupported`), several tokens of one sequence, a stage callback, an observer
(:meth:`NativeStep.takes`). Design: docs/design/native-cpu.md, docs/design/batched-decode.md.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import numpy as np

from engine.kernels import cpu
from engine.ops import reference as ops
from engine.turn.kv_types import kv_row_shape
from engine.turn.state import SequenceState, kv_dtype



class StepModel(Protocol):
    """What the step reads of a :class:`~engine.arch.qwen35.cpu.NativeQwen35Model` (its weights, prepared
    layers, hyper-parameters), named here so that the step does not import the model it serves."""

    hp: Any
    mats: dict[str, Any]
    output_name: str
    gdn: dict[int, Any]
    fused_moe: dict[int, Any]
    observer: Any

    def w(self, name: str) -> np.ndarray:
        """The float32 weight ``name``."""

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """The embedding rows of ``tokens``."""

STAGES = ("inp_embd", "result_output")
"""The reference forward's stage names :meth:`NativeStep.forward` reports: its input row and its logits (the
layers run inside one C call; the hooks path, bit-identical to it, names every stage in between)."""
STATE_CACHE = 16
"""Sequences whose ``dd_step_state`` tables :class:`NativeStep` keeps between calls at least (a batched step
keeps its whole batch's, so a batch of any size reuses them step after step)."""

_GDN_MATS = (("qkv", "attn_qkv"), ("z", "attn_gate"), ("beta", "ssm_beta"), ("alpha", "ssm_alpha"),
             ("ssm_out", "ssm_out"))
_ATTN_MATS = (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"))
_DENSE_MATS = (("ffn_gate", "ffn_gate"), ("ffn_up", "ffn_up"), ("ffn_down", "ffn_down"))


def _layer_mats(model: StepModel, il: int) -> list[tuple[str, str]]:
    """(struct field, GGUF weight name) of every product of layer ``il`` the step makes outside the MoE call."""
    p = f"blk.{il}."
    mats = _GDN_MATS if model.hp.is_recurrent(il) else _ATTN_MATS
    if not model.hp.is_moe:
        mats = mats + _DENSE_MATS
    return [(field, f"{p}{name}.weight") for field, name in mats]


def step_unsupported(model: StepModel) -> str | None:
    """Why the one-call step cannot run ``model`` (then its per-hook path decodes), or None if it can."""
    if not cpu.available():
        return "the native CPU kernels are not built"
    names = [name for il in range(model.hp.n_layer) for _, name in _layer_mats(model, il)] + [model.output_name]
    for name in names:
        if not isinstance(model.mats[name], cpu.Matrix):
            return f"{name} is kept as float32 (numpy BLAS product)"
    for il in range(model.hp.n_layer):
        if model.hp.is_moe and il not in model.fused_moe:
            return f"layer {il}'s experts are kept as float32"
    return None


class NativeStep:
    """The ``dd_step_model`` of one :class:`~engine.arch.qwen35.cpu.NativeQwen35Model`, built once at load:
    pointers into the memory-mapped weights (the model's :class:`engine.kernels.cpu.Matrix` objects),
    the float32 norm weights, the layers' prepared GDN and MoE structs.

    Args: model: a model :func:`step_unsupported` accepts. Raises ValueError otherwise.
    """

    def __init__(self, model: StepModel) -> None:
        reason = step_unsupported(model)
        if reason is not None:
            raise ValueError(f"the native decode step cannot run this model: {reason}")
        hp = model.hp
        self._model, self.hp = weakref.ref(model), hp   # the model holds its step: no reference cycle
        ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
        self._keep: list[Any] = []
        layers = ffi.new("dd_step_layer[]", hp.n_layer)
        for il in range(hp.n_layer):
            c, p = layers[il], f"blk.{il}."
            c.kind = lib.DD_LAYER_GDN if hp.is_recurrent(il) else lib.DD_LAYER_ATTN
            c.attn_norm = self._floats(model.w(p + "attn_norm.weight"))
            c.post_norm = self._floats(model.w(p + "post_attention_norm.weight"))
            for field, name in _layer_mats(model, il):
                self._mat(getattr(c, field), model.mats[name])
            if hp.is_recurrent(il):
                c.gdn = self._hold(model.gdn[il]._c)
            else:
                c.q_norm = self._floats(model.w(p + "attn_q_norm.weight"))
                c.k_norm = self._floats(model.w(p + "attn_k_norm.weight"))
            if hp.is_moe:
                c.moe = self._hold(model.fused_moe[il]._c)
        m = ffi.new("dd_step_model *")
        m.n_layer, m.n_embd, m.n_head, m.n_head_kv = hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv
        m.head_dim, m.rope_dims, m.eps = hp.head_dim, hp.rope_dims, hp.rms_eps
        m.layers = self._hold(layers)
        m.output_norm = self._floats(model.w("output_norm.weight"))
        self._mat(m.lm_head, model.mats[model.output_name])
        self.n_vocab = model.mats[model.output_name].rows
        self._c = m
        self._cached: tuple[tuple[tuple[weakref.ref, ...], Any], ...] = ()   # one store: safe across threads

    def _hold(self, obj: Any) -> Any:
        self._keep.append(obj)
        return obj

    def _floats(self, a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a, dtype=np.float32)
        ffi = cpu._native_cpu.ffi
        return ffi.cast("float *", self._hold(ffi.from_buffer(self._hold(a))))

    def _mat(self, field: Any, mat: cpu.Matrix) -> None:
        ffi = cpu._native_cpu.ffi
        field.w = ffi.cast("uint8_t *", self._hold(ffi.from_buffer(mat.raw)))
        field.wtype, field.rows, field.k = mat.traits.cpu_kernel, mat.rows, mat.k

    def takes(self, n_tokens: int, cb: Any) -> bool:
        """True if a forward call of ``n_tokens`` with stage callback ``cb`` runs here (see the module doc)."""
        return n_tokens == 1 and cb is None and self._model().observer is None and cpu.isa() != "numpy"

    def _state(self, state: SequenceState, keep: int = STATE_CACHE) -> Any:
        """The ``dd_step_state`` of ``state``'s arrays, rebuilt when they are not the arrays of one of the last
        ``keep`` states (held by weak references: a cached entry keeps no state alive).

        Raises ValueError if a layer's array is missing or not a writeable C-contiguous array of the layout's
        shape (float32; the KV rows of ``state.kv_type``).
        """
        hp = self.hp
        try:
            arrays = [a for il in range(hp.n_layer) for a in
                      ((state.conv[il], state.ssm[il]) if hp.is_recurrent(il) else (state.k[il], state.v[il]))]
        except KeyError as exc:
            raise ValueError(f"sequence state: no array of layer {exc.args[0]} (a state of another model?)") from None
        cached = self._cached
        for j, (refs, entry) in enumerate(cached):
            if len(arrays) == len(refs) and all(r() is a for r, a in zip(refs, arrays)):
                if j:   # most recently used first
                    self._cached = (cached[j], *cached[:j], *cached[j + 1:])
                return entry
        layout, kv = hp.state_layout(), kv_dtype(state.kv_type)
        specs = [s for il in range(hp.n_layer)
                 for s in (((layout.conv[il], np.float32), (layout.ssm[il], np.float32)) if hp.is_recurrent(il)
                           else (((state.capacity, *kv_row_shape(layout.kv[il], state.kv_type)), kv),) * 2)]
        for a, (shape, dtype) in zip(arrays, specs):
            if (not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != tuple(shape)
                    or not a.flags.c_contiguous or not a.flags.writeable):
                raise ValueError(f"sequence state: expected writeable C-contiguous {np.dtype(dtype).name} arrays "
                                 f"of shape {shape}")
        ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
        tables = {name: ffi.new(f"{'float' if name in ('conv', 'ssm') else 'void'} *[]", hp.n_layer)
                  for name in ("conv", "ssm", "k", "v")}
        it = iter(arrays)
        for il in range(hp.n_layer):
            for name in (("conv", "ssm") if hp.is_recurrent(il) else ("k", "v")):
                tables[name][il] = ffi.cast("float *" if name in ("conv", "ssm") else "void *", next(it).ctypes.data)
        c = ffi.new("dd_step_state *")
        c.conv, c.ssm, c.k, c.v = tables["conv"], tables["ssm"], tables["k"], tables["v"]
        c.capacity = state.capacity
        c.kv_type = {"f16": lib.DD_KV_F16, "q8_0": lib.DD_KV_Q8_0}.get(state.kv_type, lib.DD_KV_F32)
        self._cached = ((tuple(weakref.ref(a) for a in arrays), (c, tables)), *cached[:keep - 1])
        return c, tables

    def forward(self, tokens: np.ndarray, state: SequenceState, embeddings: np.ndarray | None = None,
                positions: np.ndarray | None = None, cb: Any = None) -> np.ndarray:
        """One token through the model: :meth:`engine.arch.qwen35.model.Qwen35Model.forward` with n = 1.

        Args: tokens (1,) int; state (advanced by one position); embeddings (1, n_embd) float32 or None;
        positions (3, 1) int M-RoPE positions or None for ``state.pos``; cb: ``cb(stage, il, x)`` with the
        reference's names of the values the step holds outside C (:data:`STAGES`).
        Returns: (1, n_vocab) float32 logits. Raises: as ``Qwen35Model.forward`` (ValueError, ContextFullError);
        EngineError if the native call fails.
        """
        hp = self.hp
        tokens, positions = state.chunk_inputs(tokens, positions, hp.n_vocab)
        if embeddings is None:
            x = self._model().embed(tokens)
        else:
            x = np.asarray(embeddings, dtype=np.float32)
            if x.shape != (1, hp.n_embd):
                raise ValueError(f"embeddings must have shape (1, {hp.n_embd}), got {x.shape}")
        x = np.ascontiguousarray(x[0], dtype=np.float32)
        cos, sin = ops.rope_tables(positions, hp.rope_dims, hp.rope_theta, hp.rope_sections)
        cos, sin = np.ascontiguousarray(cos[0]), np.ascontiguousarray(sin[0])
        st, _tables = self._state(state)   # both held through the call
        logits = np.empty((1, self.n_vocab), dtype=np.float32)
        ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
        level = cpu.ISA_LEVELS.index(cpu.isa())
        cpu._check(lib.dd_step(level, self._c, st, state.pos, ffi.cast("float *", ffi.from_buffer(x)),
                               ffi.cast("double *", ffi.from_buffer(cos)), ffi.cast("double *", ffi.from_buffer(sin)),
                               ffi.cast("float *", ffi.from_buffer(logits))), "decode step")
        state.pos += 1
        if cb is not None:
            cb("inp_embd", -1, x[None])
            cb("result_output", -1, logits)
        return logits

    def forward_batch(self, tokens: np.ndarray, states: list[SequenceState], positions: np.ndarray) -> np.ndarray:
        """One token of each of N sequences in one native call (``dd_step_batch``): row i and ``states[i]`` get
        the bits :meth:`forward` gives that token of that sequence alone.

        Args: tokens (N,) int and positions (3, N) int, column i row i's M-RoPE positions, as
        :meth:`~engine.arch.qwen35.model.Qwen35Model.batch_inputs` checked them against ``states`` (N distinct
        states, each advanced by one position).
        Returns: (N, n_vocab) float32 logits. Raises: ValueError (a state's arrays, :meth:`_state`); EngineError
        if the native call fails.
        """
        hp, n = self.hp, len(states)
        x = np.ascontiguousarray(self._model().embed(np.asarray(tokens)), dtype=np.float32)
        tables = [ops.rope_tables(positions[:, i:i + 1], hp.rope_dims, hp.rope_theta, hp.rope_sections)
                  for i in range(n)]   # row by row: the very table a one-row step computes
        cos = np.ascontiguousarray(np.concatenate([c for c, _ in tables]))
        sin = np.ascontiguousarray(np.concatenate([s for _, s in tables]))
        ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
        keep = max(STATE_CACHE, n)
        entries = [self._state(state, keep) for state in states]   # held here as well
        ptrs = ffi.new("dd_step_state *[]", [c for c, _ in entries])
        pos = ffi.new("size_t[]", [state.pos for state in states])
        logits = np.empty((n, self.n_vocab), dtype=np.float32)
        level = cpu.ISA_LEVELS.index(cpu.isa())
        cpu._check(lib.dd_step_batch(level, self._c, n, ptrs, pos, ffi.cast("float *", ffi.from_buffer(x)),
                                     ffi.cast("double *", ffi.from_buffer(cos)),
                                     ffi.cast("double *", ffi.from_buffer(sin)),
                                     ffi.cast("float *", ffi.from_buffer(logits))), "batched decode step")
        for state in states:
            state.pos += 1
        return logits
