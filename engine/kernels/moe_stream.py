"""Streaming a MoE model's routed experts over PCIe during GPU prefill, free of CUDA and of any family.

What stays resident and what streams under a VRAM budget (:class:`Placement`), how a layer's experts are
packed for contiguous copies (:class:`ExpertLayout`), the router's choices sorted for the grouped GEMM
(:class:`RouteTables`), the copies a set of experts needs (:func:`copy_runs`) and the telemetry records.
A family passes its sizes and tensor types in; these records know no tensor names. Sizes are bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import DeviceBudgetError, DeviceError
from engine.gguf.quant import row_bytes, type_name
from engine.kernels.cuda_layout import GPU_TYPES, TILE_ROWS, Matrix, aligned

Q = GGMLQuantizationType

SELECTIVE_FRACTION = 0.85
"""Stream only the selected experts (after each layer's router, without prefetch) when the expected
share of distinct experts a pass selects is at most this; else stream whole layers ahead of use."""


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


def expert_layout(layer: str, n_expert: int, n_ff: int, n_embd: int, gate: GGMLQuantizationType,
                  up: GGMLQuantizationType, down: GGMLQuantizationType) -> ExpertLayout:
    """The :class:`ExpertLayout` of ``n_expert`` experts (``n_ff`` x ``n_embd``) stored in these three types.

    A stored type without a GPU kernel is laid out as Q8_0 (the host converts those rows at load).
    ``layer`` names the layer in errors (e.g. ``"blk.3"``).

    Raises:
        DeviceError: gate and up laid out in different types.
    """
    gate, up, down = (t if t in GPU_TYPES else Q.Q8_0 for t in (gate, up, down))
    if gate != up:
        raise DeviceError(f"{layer}: the gate experts ({type_name(gate)}) and up experts ({type_name(up)}) "
                          "differ in type; the GPU path multiplies them as one matrix")
    return ExpertLayout(gate, row_bytes(gate, n_embd), down, row_bytes(down, n_ff), n_expert, n_ff, n_embd)


# ---- placement -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where every part of the model lives during GPU prefill.

    Attributes:
        budget: VRAM budget, bytes.
        resident_weights: bytes of resident non-expert weights; ``n_matrices`` / ``n_converted``
            count the GEMM weights and those converted to Q8_0 on the host.
        state: bytes of the recurrent state the device keeps (0 for none).
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
                 f"  resident {self.resident_weights / g:8.3f} GiB  weights other than routed experts: mixers, norms, "
                 f"routers, shared experts, LM head ({self.n_matrices} matrices"
                 + (f", {self.n_converted} converted to Q8_0 on the host" if self.n_converted else "") + ")",
                 f"  resident {self.state / g:8.3f} GiB  recurrent state"]
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


def place_experts(budget: int, matrices: list[Matrix], vector_bytes: int, state: int,
                  expert_layers: tuple[int, ...], expert_layer_bytes: int, plan_tokens: int, reserve: int,
                  minimum_reserve: int) -> Placement:
    """Decide which layers' routed experts stay resident and which stream.

    Everything but the routed experts is resident, and ``reserve`` (activations and KV cache for
    ``plan_tokens`` prompt tokens) is kept free; routed experts fill what is left, whole layers at a time
    in ``expert_layers`` order (resident layers run while the first streamed one is on its way). The rest
    stream from pinned host RAM through two buffers of one layer each.

    Args:
        matrices / vector_bytes: the resident GEMM weights and the aligned bytes of the float32 tensors.
        state: bytes of the recurrent state. expert_layers: layers with routed experts (empty: dense).
        minimum_reserve: activation and KV bytes of the smallest pass the family can run.

    Raises:
        DeviceBudgetError: the resident weights, state, two stream buffers and ``minimum_reserve`` do not fit.
    """
    weights = sum(aligned(m.nbytes) for m in matrices) + vector_bytes
    all_experts = len(expert_layers) * aligned(expert_layer_bytes)
    fixed = weights + state
    common = dict(budget=budget, resident_weights=weights, n_matrices=len(matrices),
                  n_converted=sum(m.converted for m in matrices), state=state, plan_tokens=plan_tokens,
                  reserve=reserve, expert_layer_bytes=aligned(expert_layer_bytes))
    if fixed + reserve + all_experts <= budget:
        return Placement(resident_experts=expert_layers, streamed_experts=(), slot_bytes=0, n_slots=0, **common)
    slot = aligned(expert_layer_bytes)
    room = budget - fixed - 2 * slot - reserve
    minimum = fixed + 2 * slot + minimum_reserve
    if budget < minimum:
        raise DeviceBudgetError(f"VRAM budget {budget / 2**30:.2f} GiB is below the {minimum / 2**30:.2f} GiB GPU "
                                f"prefill needs (weights {weights / 2**30:.2f} GiB, two expert buffers of "
                                f"{slot / 2**20:.0f} MiB, state and activations)")
    n_res = max(0, min(len(expert_layers), room // slot)) if slot else 0
    return Placement(resident_experts=expert_layers[:n_res], streamed_experts=expert_layers[n_res:],
                     slot_bytes=slot, n_slots=2, **common)


def expected_distinct(n_expert: int, n_used: int, n: int) -> float:
    """Expected number of distinct experts n tokens select when each picks k of E uniformly: E (1 - (1 - k/E)^n)."""
    return n_expert * (1.0 - math.pow(1.0 - n_used / n_expert, n))


def use_selective(n_expert: int, n_used: int, n: int) -> bool:
    """Whether a pass of ``n`` tokens (each routed to ``n_used`` of ``n_expert`` experts) should stream only
    the experts its router selects: when :func:`expected_distinct` is at most :data:`SELECTIVE_FRACTION` of them.
    """
    return expected_distinct(n_expert, n_used, n) <= SELECTIVE_FRACTION * n_expert


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
        layer: layer index; kind: the layer's mixer as the family names it (e.g. ``"attention"``).
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
