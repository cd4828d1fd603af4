"""Qwen3.5/3.6's side of GPU prefill planning, free of CUDA: which tensors are resident, the activation,
KV cache and state sizes of a pass, and the file's placement (the family-free rule lives in
:mod:`engine.kernels.moe_stream`).

Kept apart from :mod:`engine.arch.qwen35.cuda` so it can be tested on any machine. Sizes are bytes.
Attention and delta-net weights, norms, routers, shared experts, the LM head and the delta-net state always
live on the GPU; routed experts fill what the budget leaves after the reserve for ``plan_tokens`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import DeviceError
from engine.gguf.file import GGUFFile
from engine.gguf.quant import type_name
from engine.kernels.cuda_layout import TILE_ROWS, Matrix, aligned, gemm_matrix
from engine.kernels.moe_stream import ExpertLayout, Placement, expert_layout, place_experts

from .cpu import to_q8_0
from .hparams import Qwen35HParams

Q = GGMLQuantizationType

GDN_CHUNK = 64
"""Chunk length of the chunked Gated DeltaNet kernels (CH in gdn.cu)."""


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


def layer_expert_layout(hp: Qwen35HParams, f: GGUFFile, il: int) -> ExpertLayout:
    """The :class:`ExpertLayout` of layer ``il``'s routed experts from the stored types of its three tensors."""
    p = f"blk.{il}.ffn_"
    types = (f.info(p + x + "_exps.weight").qtype for x in ("gate", "up", "down"))
    return expert_layout(f"blk.{il}", hp.n_expert, hp.n_ff_exp, hp.n_embd, *types)


def stored_rows(gguf: GGUFFile, name: str, qtype: GGMLQuantizationType) -> np.ndarray:
    """The (rows, row bytes) uint8 rows of tensor ``name`` (a matrix, or stacked experts as rows) as the GPU
    keeps them in ``qtype`` (:func:`~engine.kernels.cuda_layout.gemm_matrix`, :func:`layer_expert_layout`):
    the file's bytes when stored so, else (stored without a GPU kernel) converted to Q8_0
    (:func:`engine.arch.qwen35.cpu.to_q8_0`, a bounded number of rows at a time).

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


def plan_placement(hp: Qwen35HParams, budget: int, matrices: list[Matrix], vector_bytes: int,
                   expert_layer_bytes: int, plan_tokens: int) -> Placement:
    """Decide what is resident and what streams (:func:`engine.kernels.moe_stream.place_experts` with this
    model's state, its reserve for ``plan_tokens`` and its smallest pass of :data:`GDN_CHUNK` tokens).

    Raises:
        DeviceBudgetError: the non-expert weights, state, two stream buffers and the reserve for 64 tokens
            do not fit the budget.
    """
    return place_experts(budget, matrices, vector_bytes, state_bytes(hp),
                         tuple(range(hp.n_layer)) if hp.is_moe else (), expert_layer_bytes, plan_tokens,
                         reserve=activation_bytes(hp, plan_tokens) + kv_bytes(hp, plan_tokens),
                         minimum_reserve=activation_bytes(hp, GDN_CHUNK) + kv_bytes(hp, GDN_CHUNK))


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
        DeviceError: a tensor the GPU GEMM cannot take (see :func:`gemm_matrix`, :func:`layer_expert_layout`).
    """
    head = "output.weight" if f.has("output.weight") else "token_embd.weight"
    names = [n for il in range(hp.n_layer) for n in layer_matrices(hp, il)] + [head]
    matrices = {n: gemm_matrix(n, f.info(n).qtype, f.info(n).shape) for n in names}
    vectors = [n for il in range(hp.n_layer) for n in layer_vectors(hp, il)] + ["output_norm.weight"]
    vector_bytes = sum(aligned(int(np.prod(f.info(n).shape)) * 4) for n in vectors)
    layouts = {il: layer_expert_layout(hp, f, il) for il in range(hp.n_layer)} if hp.is_moe else {}
    layer_bytes = max((lay.nbytes for lay in layouts.values()), default=0)
    plan = plan_placement(hp, budget, list(matrices.values()), vector_bytes, layer_bytes, plan_tokens)
    return FilePlan(plan, matrices, vectors, layouts, head)
