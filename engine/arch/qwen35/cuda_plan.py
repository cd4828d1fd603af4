"""Planning for GPU prefill, free of CUDA: weight placement under a VRAM budget, activation sizes,
MoE routing tables and the telemetry records.

Kept apart from :mod:`engine.arch.qwen35.cuda` so it can be tested on any machine. Sizes are bytes.

Placement rule: attention and delta-net weights, norms, routers, shared experts, the LM
head and the delta-net state always live on the GPU; activations and the KV cache for a prompt of
``plan_tokens`` positions are reserved; routed experts fill what is left of the budget, whole layers
at a time starting from layer 0 (resident layers run while the first streamed layer is still on its
way). The remaining layers stream from pinned host RAM through two buffers of one layer each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import DeviceBudgetError, DeviceError
from engine.gguf.file import GGUFFile
from engine.kernels.cuda_layout import GPU_TYPES, TILE_ROWS, Matrix, aligned, gemm_matrix
from engine.gguf.quant import row_bytes, type_name

from .cpu import to_q8_0
from .hparams import Qwen35HParams

Q = GGMLQuantizationType

GDN_CHUNK = 64
"""Chunk length of the chunked Gated DeltaNet kernels (CH in gdn.cu)."""

SELECTIVE_FRACTION = 0.85
"""Stream only the selected experts (after each layer's router, without prefetch) when the expected
share of distinct experts a pass selects is at most this; else stream whole layers ahead of use."""


def layer_matrices(hp: Qwen35HParams, il: int) -> list[str]:
    """GGUF names of layer ``il``'s GEMM weights that stay resident (not the routed experts)."""
    p = f"blk.{il}."
    if hp.is_recurrent(il):
        names = ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"]
    else:
        names = ["attn_q", "attn_k", "attn_v", "attn_output"]
    if hp.is_moe:
        shared = ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if hp.n_ff_shexp else []
        names += ["ffn_gate_inp", *shared]
    else:
        names += ["ffn_gate", "ffn_up", "ffn_down"]
    return [p + n + ".weight" for n in names]


def layer_vectors(hp: Qwen35HParams, il: int) -> list[str]:
    """GGUF names of layer ``il``'s small float tensors (norms, conv taps, gate constants), kept as float32."""
    p = f"blk.{il}."
    names = ["attn_norm.weight", "post_attention_norm.weight"]
    if hp.is_recurrent(il):
        names += ["ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight"]
    else:
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if hp.is_moe and hp.n_ff_shexp:
        names.append("ffn_gate_inp_shexp.weight")
    return [p + n for n in names]


@dataclass(frozen=True)
class ExpertLayout:
    """How one layer's routed experts are packed for streaming: per expert, contiguous,
    ``[gate rows (ff) | up rows (ff) | down rows (d)]``, so the gate and up projections are one GEMM
    of 2*ff rows and any set of experts is a set of contiguous copies.

    Attributes:
        gu_qtype, gu_row_bytes: type and row bytes of the gate/up rows (d inputs each).
        down_qtype, down_row_bytes: type and row bytes of the down rows (ff inputs each).
        n_expert, n_ff, n_embd: sizes.
    """

    gu_qtype: GGMLQuantizationType
    gu_row_bytes: int
    down_qtype: GGMLQuantizationType
    down_row_bytes: int
    n_expert: int
    n_ff: int
    n_embd: int

    @property
    def gu_bytes(self) -> int:
        """Bytes of one expert's gate+up rows (the down rows follow them)."""
        return 2 * self.n_ff * self.gu_row_bytes

    @property
    def stride(self) -> int:
        """Bytes of one expert."""
        return self.gu_bytes + self.n_embd * self.down_row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole layer."""
        return self.n_expert * self.stride


def expert_layout(hp: Qwen35HParams, il: int, gate: GGMLQuantizationType, up: GGMLQuantizationType,
                  down: GGMLQuantizationType) -> ExpertLayout:
    """The :class:`ExpertLayout` of layer ``il`` given the storage types of its three expert tensors.

    A stored type without a GPU kernel is laid out as Q8_0 (the host converts those rows at load).

    Raises:
        DeviceError: gate and up laid out in different types.
    """
    gate, up, down = (t if t in GPU_TYPES else Q.Q8_0 for t in (gate, up, down))
    if gate != up:
        raise DeviceError(f"blk.{il}: ffn_gate_exps ({type_name(gate)}) and ffn_up_exps ({type_name(up)}) "
                          "differ in type; the GPU path multiplies them as one matrix")
    return ExpertLayout(gate, row_bytes(gate, hp.n_embd), down, row_bytes(down, hp.n_ff_exp),
                        hp.n_expert, hp.n_ff_exp, hp.n_embd)


def expert_rows(gguf: GGUFFile, name: str, qtype: GGMLQuantizationType) -> np.ndarray:
    """The (rows, row bytes) uint8 rows of stacked expert tensor ``name`` as :func:`expert_layout` lays
    them out in ``qtype``: the file's bytes when stored so, else (stored without a GPU kernel) converted
    to Q8_0 (:func:`engine.arch.qwen35.cpu.to_q8_0`, a bounded number of rows at a time).

    Raises:
        ValueError: ``qtype`` is neither the stored type nor Q8_0.
    """
    info = gguf.info(name)
    raw = gguf.raw(name)
    if info.qtype == qtype:
        return raw
    if qtype != Q.Q8_0:
        raise ValueError(f"tensor {name}: stored as {type_name(info.qtype)}, cannot be laid out as {type_name(qtype)}")
    return to_q8_0(raw, info.qtype, info.ne[0])


# ---- activations ---------------------------------------------------------------------------------

def activation_groups(hp: Qwen35HParams, n: int) -> dict[str, dict[str, int]]:
    """Device buffers for a pass of ``n`` tokens, by group, name -> bytes (float32 unless noted).

    Group ``base`` lives for the whole pass (``emb`` holds the prompt's raw embedding rows, at most 4 bytes a
    value); groups ``gdn``, ``attn`` and ``ffn`` are never live at
    the same time (each mixer writes its result into ``h`` before the FFN starts) and share memory.
    """
    d, f4 = hp.n_embd, 4
    base = {"h": n * d * f4, "x": n * d * f4, "emb": n * d * f4, "pos": 3 * n * 4, "last": d * f4,
            "logits": hp.n_vocab * f4}
    groups = {"base": base}
    if any(hp.is_recurrent(il) for il in range(hp.n_layer)):
        nc = -(-n // GDN_CHUNK)
        rows = hp.num_v_heads * nc * GDN_CHUNK
        groups["gdn"] = {
            "mixed": n * hp.conv_dim * f4, "u": n * hp.conv_dim * f4, "z": n * hp.value_dim * f4,
            "braw": n * hp.num_v_heads * f4, "araw": n * hp.num_v_heads * f4,
            "beta": n * hp.num_v_heads * f4, "g": n * hp.num_v_heads * f4,
            "o": n * hp.value_dim * f4, "y": n * hp.value_dim * f4,
            "conv_new": (hp.conv_kernel - 1) * hp.conv_dim * f4,
            "cw": rows * hp.head_k_dim * f4, "cu": rows * hp.head_v_dim * f4, "cp": rows * GDN_CHUNK * f4,
            "cg": rows * 8,
        }
    if any(not hp.is_recurrent(il) for il in range(hp.n_layer)):
        qd = hp.n_head * hp.head_dim
        groups["attn"] = {"qg": 2 * n * qd * f4, "kraw": n * hp.n_head_kv * hp.head_dim * f4,
                          "q": n * qd * f4, "att": n * qd * f4}
    if hp.is_moe:
        nk = n * hp.n_expert_used
        ffn = {"rlog": n * hp.n_expert * f4, "tidx": nk * 4, "tw": nk * 4, "a_rows": nk * 4, "row_w": nk * 4,
               "inv": nk * 4, "tiles": (nk // TILE_ROWS + hp.n_expert + 1) * 3 * 8, "rcount": hp.n_expert * 4,
               "rcursor": hp.n_expert * 4, "rntiles": 4,
               "hg": nk * 2 * hp.n_ff_exp * f4, "act": nk * hp.n_ff_exp * f4, "outs": nk * d * f4}
        if hp.n_ff_shexp:
            ffn.update({"hs": n * 2 * hp.n_ff_shexp * f4, "acts": n * hp.n_ff_shexp * f4, "sh": n * d * f4})
        groups["ffn"] = ffn
    else:
        groups["ffn"] = {"hg": n * 2 * hp.n_ff * f4, "act": n * hp.n_ff * f4}
    return groups


def activation_bytes(hp: Qwen35HParams, n: int) -> int:
    """Device bytes of :func:`activation_groups` for ``n`` tokens, with the sharing and alignment applied."""
    groups = activation_groups(hp, n)
    size = {g: sum(aligned(b) for b in bufs.values()) for g, bufs in groups.items()}
    return size["base"] + max(v for g, v in size.items() if g != "base")


def kv_bytes(hp: Qwen35HParams, positions: int) -> int:
    """Device bytes of the K and V caches of all attention layers for ``positions`` rows (float32)."""
    n_attn = sum(not hp.is_recurrent(il) for il in range(hp.n_layer))
    return n_attn * 2 * aligned(positions * hp.n_head_kv * hp.head_dim * 4)


def state_bytes(hp: Qwen35HParams) -> int:
    """Device bytes of the conv and delta-rule states of all Gated DeltaNet layers (float32)."""
    n_gdn = sum(hp.is_recurrent(il) for il in range(hp.n_layer))
    conv = (hp.conv_kernel - 1) * hp.conv_dim * 4
    ssm = hp.num_v_heads * hp.head_k_dim * hp.head_v_dim * 4
    return n_gdn * (aligned(conv) + aligned(ssm))


def pass_tokens(hp: Qwen35HParams, n: int, positions: int, available: int) -> int:
    """Tokens per pass for an ``n``-token prompt ending at cache row ``positions`` within ``available`` bytes.

    The whole prompt when it fits, else the largest multiple of 64 that does (each extra pass
    streams the routed experts again).

    Raises:
        DeviceError: not even 64 tokens (or the KV cache itself) fit.
    """
    room = available - kv_bytes(hp, positions)
    if activation_bytes(hp, n) <= room:
        return n
    lo, hi = 0, n // GDN_CHUNK
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if activation_bytes(hp, mid * GDN_CHUNK) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise DeviceError(f"the VRAM budget leaves {available / 2**20:.0f} MiB for activations and the KV cache of "
                          f"{positions} positions: too little for even {GDN_CHUNK} tokens")
    return lo * GDN_CHUNK


# ---- placement -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where every part of the model lives during GPU prefill.

    Attributes:
        budget: VRAM budget, bytes.
        resident_weights: bytes of resident non-expert weights; ``n_matrices`` / ``n_converted``
            count the GEMM weights and those dequantized to F32 on the host.
        state: bytes of the delta-net conv/ssm state.
        plan_tokens: prompt length reserved for; ``reserve``: activation + KV bytes for it.
        resident_experts: layers whose routed experts stay on the GPU.
        streamed_experts: layers whose routed experts stream from pinned host RAM.
        expert_layer_bytes: bytes of one layer's routed experts (0 for a dense model).
        slot_bytes: bytes of each of the ``n_slots`` stream buffers (0 / 0 when nothing streams).
    """

    budget: int
    resident_weights: int
    n_matrices: int
    n_converted: int
    state: int
    plan_tokens: int
    reserve: int
    resident_experts: tuple[int, ...]
    streamed_experts: tuple[int, ...]
    expert_layer_bytes: int
    slot_bytes: int
    n_slots: int

    @property
    def fixed_bytes(self) -> int:
        """Bytes allocated at load: weights, state, resident experts and stream buffers."""
        return (self.resident_weights + self.state + len(self.resident_experts) * self.expert_layer_bytes
                + self.n_slots * self.slot_bytes)

    def text(self) -> str:
        """The plan in plain words, one line per part (for the log / the app's status panel)."""
        g = 2 ** 30
        lines = [f"GPU prefill placement, VRAM budget {self.budget / g:.2f} GiB:",
                 f"  resident {self.resident_weights / g:8.3f} GiB  attention + delta-net weights, norms, routers, "
                 f"shared experts, LM head ({self.n_matrices} matrices"
                 + (f", {self.n_converted} dequantized to F32 on the host" if self.n_converted else "") + ")",
                 f"  resident {self.state / g:8.3f} GiB  delta-net conv + recurrent state"]
        if self.resident_experts:
            lines.append(f"  resident {len(self.resident_experts) * self.expert_layer_bytes / g:8.3f} GiB  routed "
                         f"experts of {_ranges(self.resident_experts)} ({len(self.resident_experts)} layers)")
        if self.streamed_experts:
            lines.append(f"  streamed {len(self.streamed_experts) * self.expert_layer_bytes / g:8.3f} GiB  routed "
                         f"experts of {_ranges(self.streamed_experts)} ({len(self.streamed_experts)} layers, "
                         f"{self.expert_layer_bytes / 2**20:.0f} MiB each) from pinned host RAM through "
                         f"{self.n_slots} x {self.slot_bytes / 2**20:.0f} MiB buffers")
        lines.append(f"  reserved {self.reserve / g:8.3f} GiB  activations + KV cache for {self.plan_tokens} prompt "
                     "tokens (longer prompts run in several passes when they do not fit)")
        return "\n".join(lines)


def _ranges(layers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"layers 0-2, 5"``."""
    parts, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + (None,)):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "layers " + ", ".join(parts)


def plan_placement(hp: Qwen35HParams, budget: int, matrices: list[Matrix], vector_bytes: int,
                   expert_layer_bytes: int, plan_tokens: int) -> Placement:
    """Decide what is resident and what streams.

    Args:
        hp: hyper-parameters.
        budget: VRAM budget, bytes.
        matrices: every resident GEMM weight.
        vector_bytes: bytes of the small float32 tensors (norms, conv taps, ...), already aligned.
        expert_layer_bytes: bytes of one layer's routed experts (0 for a dense model).
        plan_tokens: prompt length whose activations and KV cache are reserved.

    Raises:
        DeviceBudgetError: the non-expert weights, state, two stream buffers and the reserve for 64 tokens
            do not fit the budget.
    """
    weights = sum(aligned(m.nbytes) for m in matrices) + vector_bytes
    state = state_bytes(hp)
    reserve = activation_bytes(hp, plan_tokens) + kv_bytes(hp, plan_tokens)
    layers = tuple(range(hp.n_layer)) if hp.is_moe else ()
    all_experts = len(layers) * aligned(expert_layer_bytes)
    fixed = weights + state
    common = dict(budget=budget, resident_weights=weights, n_matrices=len(matrices),
                  n_converted=sum(m.converted for m in matrices), state=state, plan_tokens=plan_tokens,
                  reserve=reserve, expert_layer_bytes=aligned(expert_layer_bytes))
    if fixed + reserve + all_experts <= budget:
        return Placement(resident_experts=layers, streamed_experts=(), slot_bytes=0, n_slots=0, **common)
    slot = aligned(expert_layer_bytes)
    room = budget - fixed - 2 * slot - reserve
    minimum = fixed + 2 * slot + activation_bytes(hp, GDN_CHUNK) + kv_bytes(hp, GDN_CHUNK)
    if budget < minimum:
        raise DeviceBudgetError(f"VRAM budget {budget / 2**30:.2f} GiB is below the {minimum / 2**30:.2f} GiB GPU "
                                f"prefill needs (weights {weights / 2**30:.2f} GiB, two expert buffers of "
                                f"{slot / 2**20:.0f} MiB, state and activations)")
    n_res = max(0, min(len(layers), room // slot)) if slot else 0
    return Placement(resident_experts=layers[:n_res], streamed_experts=layers[n_res:], slot_bytes=slot,
                     n_slots=2, **common)


@dataclass(frozen=True)
class FilePlan:
    """What GPU prefill of one file places: the :class:`Placement` and the parts it was made from.

    Attributes:
        plan: the placement. matrices: GGUF name -> resident GEMM weight. vectors: GGUF names of the
        float32 tensors. layouts: layer -> its routed experts' layout (empty for a dense model). head: the LM
        head's GGUF name.
    """

    plan: Placement
    matrices: dict[str, Matrix]
    vectors: list[str]
    layouts: dict[int, ExpertLayout]
    head: str


def plan_file(hp: Qwen35HParams, f: GGUFFile, budget: int, plan_tokens: int) -> FilePlan:
    """The GPU prefill placement of file ``f`` under ``budget`` bytes, from its tensor table alone (no device,
    no tensor data: works on :meth:`GGUFFile.from_header`).

    Raises:
        DeviceBudgetError: the budget is below what GPU prefill needs (see :func:`plan_placement`).
        DeviceError: a tensor the GPU GEMM cannot take (see :func:`gemm_matrix`, :func:`expert_layout`).
    """
    head = "output.weight" if f.has("output.weight") else "token_embd.weight"
    names = [n for il in range(hp.n_layer) for n in layer_matrices(hp, il)] + [head]
    matrices = {n: gemm_matrix(n, f.info(n).qtype, f.info(n).shape) for n in names}
    vectors = [n for il in range(hp.n_layer) for n in layer_vectors(hp, il)] + ["output_norm.weight"]
    vector_bytes = sum(aligned(int(np.prod(f.info(n).shape)) * 4) for n in vectors)
    layouts: dict[int, ExpertLayout] = {}
    if hp.is_moe:
        for il in range(hp.n_layer):
            p = f"blk.{il}.ffn_"
            layouts[il] = expert_layout(hp, il, *(f.info(p + x + "_exps.weight").qtype for x in ("gate", "up", "down")))
    layer_bytes = max((lay.nbytes for lay in layouts.values()), default=0)
    plan = plan_placement(hp, budget, list(matrices.values()), vector_bytes, layer_bytes, plan_tokens)
    return FilePlan(plan, matrices, vectors, layouts, head)


def expected_distinct(hp: Qwen35HParams, n: int) -> float:
    """Expected number of distinct experts n tokens select when each picks k of E uniformly: E (1 - (1 - k/E)^n)."""
    return hp.n_expert * (1.0 - math.pow(1.0 - hp.n_expert_used / hp.n_expert, n))


def use_selective(hp: Qwen35HParams, n: int) -> bool:
    """Whether a pass of ``n`` tokens should stream only the experts its router selects.

    True when :func:`expected_distinct` is at most :data:`SELECTIVE_FRACTION` of the experts.
    """
    return expected_distinct(hp, n) <= SELECTIVE_FRACTION * hp.n_expert


# ---- routing tables --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouteTables:
    """Token-expert assignments sorted by expert, as the grouped GEMM and the combine kernel read them.

    Attributes:
        a_rows: (n*k,) int32 token of each sorted assignment (the gate/up GEMM's A-row gather).
        row_w: (n*k,) float32 routing weight of each sorted assignment (the down GEMM's row scale).
        inv: (n*k,) int32 sorted row of assignment (token t, slot s) at ``t*k + s``.
        tiles: (T, 3) int64 (row_start, row_count, weight byte offset) per M tile, rows <= TILE_ROWS.
        experts: (u,) int64 distinct experts selected, ascending.
    """

    a_rows: np.ndarray
    row_w: np.ndarray
    inv: np.ndarray
    tiles: np.ndarray
    experts: np.ndarray


def route_tables(idx: np.ndarray, weights: np.ndarray, n_expert: int, expert_offset: np.ndarray) -> RouteTables:
    """Sort the router's choices by expert (stable: tokens ascending within an expert) and cut tiles.

    Args:
        idx: (n, k) int expert ids from the router.
        weights: (n, k) float32 routing weights.
        n_expert: E.
        expert_offset: (E,) int64 byte offset of each expert's weights in the buffer the GEMM reads.

    Raises:
        ValueError: an expert id outside 0..E-1.
    """
    n, k = idx.shape
    flat = np.asarray(idx, dtype=np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"router returned expert ids outside 0..{n_expert - 1}")
    order = np.argsort(flat, kind="stable")
    inv = np.empty(n * k, dtype=np.int32)
    inv[order] = np.arange(n * k, dtype=np.int32)
    counts = np.bincount(flat, minlength=n_expert)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    experts = np.flatnonzero(counts)
    per = -(-counts[experts] // TILE_ROWS)
    tile_expert = np.repeat(experts, per)
    first = np.repeat(np.cumsum(per) - per, per)
    within = (np.arange(tile_expert.size) - first) * TILE_ROWS
    row_start = starts[tile_expert] + within
    row_count = np.minimum(TILE_ROWS, counts[tile_expert] - within)
    tiles = np.stack([row_start, row_count, np.asarray(expert_offset, dtype=np.int64)[tile_expert]], axis=1)
    return RouteTables(a_rows=(order // k).astype(np.int32),
                       row_w=np.asarray(weights, dtype=np.float32).reshape(-1)[order],
                       inv=inv, tiles=np.ascontiguousarray(tiles, dtype=np.int64), experts=experts)


def copy_runs(experts: np.ndarray) -> list[tuple[int, int]]:
    """Group ascending expert ids into runs of consecutive ids: [(first, count), ...] (one copy each)."""
    runs: list[tuple[int, int]] = []
    for e in (int(x) for x in experts):
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


# ---- telemetry -----------------------------------------------------------------------------------

@dataclass
class LayerTelemetry:
    """One layer of one prefill (summed over passes).

    Attributes:
        layer: layer index; kind: ``"gdn"`` or ``"attention"``.
        experts: ``"resident"``, ``"streamed"`` (whole layer ahead of use), ``"selective"`` (selected
            experts after the router) or ``"dense"``.
        compute_ms: GPU time of the layer on the compute stream (event to event), ms.
        h2d_bytes: routed-expert bytes copied host -> device for this layer.
        h2d_ms: GPU time of those copies on the copy stream, ms.
        experts_copied: experts copied (all passes).
    """

    layer: int
    kind: str
    experts: str
    compute_ms: float = 0.0
    h2d_bytes: int = 0
    h2d_ms: float = 0.0
    experts_copied: int = 0

    @property
    def h2d_gbs(self) -> float:
        """Achieved copy rate, GB/s (1e9 bytes), 0 without copies."""
        return self.h2d_bytes / self.h2d_ms / 1e6 if self.h2d_ms > 0 else 0.0


@dataclass
class PrefillTelemetry:
    """What one GPU prefill did, for the app's sidebar and the benchmark.

    Attributes:
        n_tokens: prompt tokens prefilled; passes: passes over the layers (1 unless the budget forced more).
        mode: ``"resident"``, ``"streamed"`` or ``"selective"`` (see :class:`LayerTelemetry`).
        wall_ms: host wall time of the whole call, ms (upload of embeddings to logits on the host).
        gpu_ms: GPU time from the first layer's start to the logits, ms.
        h2d_bytes / h2d_ms: totals over layers (copy-stream busy time).
        vram_budget / vram_used / vram_free: bytes; used = this engine's allocations, free = the device's.
        layers: per-layer records.
    """

    n_tokens: int
    passes: int
    mode: str
    wall_ms: float
    gpu_ms: float
    h2d_bytes: int
    h2d_ms: float
    vram_budget: int
    vram_used: int
    vram_free: int
    layers: list[LayerTelemetry] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        """Prompt tokens per second of wall time."""
        return self.n_tokens / (self.wall_ms / 1e3) if self.wall_ms > 0 else 0.0

    @property
    def h2d_gbs(self) -> float:
        """Achieved copy rate over all streamed layers, GB/s."""
        return self.h2d_bytes / self.h2d_ms / 1e6 if self.h2d_ms > 0 else 0.0

    def add_events(self, events: list[tuple[int, str, float, int]], stride: dict[int, int]) -> None:
        """Sum timed GPU events into the layer records and the totals.

        Args:
            events: (layer, "compute" or "copy", ms, bytes copied) per recorded event pair.
            stride: layer -> bytes of one expert's weights (to count the experts a copy moved).
        """
        for il, kind, ms, nbytes in events:
            lt = self.layers[il]
            if kind == "compute":
                lt.compute_ms += ms
            else:
                lt.h2d_ms += ms
                lt.h2d_bytes += nbytes
                lt.experts_copied += nbytes // stride[il]
        self.h2d_bytes = sum(lt.h2d_bytes for lt in self.layers)
        self.h2d_ms = sum(lt.h2d_ms for lt in self.layers)
