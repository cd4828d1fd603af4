"""Per-tensor storage types of the K-quant presets users download, for Qwen3.5/3.6 tensor names.

``Q4_K_M`` follows llama.cpp's ``llama_tensor_get_type`` (no imatrix, no overrides), checked tensor by
tensor against ``llama-quantize`` output (tests/test_synth.py); ``UD-Q4_K_XL`` is Q4_K_M with Q5_K
``ffn_down_exps`` and Q8_0 attention and delta-net projections, from unsloth's published notes.
Both write ``general.file_type`` = ``MOSTLY_Q4_K_M``.
Design: docs/design/quant-formats.md (the rules and their sources).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gguf import GGMLQuantizationType, LlamaFileType

from .hparams import Qwen35HParams

Q = GGMLQuantizationType

MIXES: dict[str, LlamaFileType] = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
                                   "ud_q4_k_xl": LlamaFileType.MOSTLY_Q4_K_M}
"""File presets :func:`mix_types` knows, by name (llama-quantize's, or unsloth's with ``_`` for ``-``),
with the ``general.file_type`` written."""

_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight")
_ATTN_V_LIKE = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")
_UD_Q8_0 = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
            "attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_out.weight")
_UD_EXPERTS = {"ffn_gate_exps.weight": Q.Q4_K, "ffn_up_exps.weight": Q.Q4_K, "ffn_down_exps.weight": Q.Q5_K}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_BLOCK = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q8_0: 32}


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's ``use_more_bits``: the first and last eighth of ``n`` and every third index between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantized(name: str, ne: Sequence[int]) -> bool:
    """Whether llama-quantize quantizes this tensor at all (``tensor_allows_quantization`` for these names)."""
    return (len(ne) >= 2 and name.endswith("weight") and not name.endswith(_NOT_QUANTIZED)
            and "ssm_conv1d" not in name)


def visiting_order(names: Sequence[str]) -> list[str]:
    """``names`` in llama-quantize's order (``weight_name_comparer``): by ``blk.N.`` layer (none = -1), then name."""
    return sorted(names, key=lambda n: (_layer_or(n, -1), n))


def mix_types(mix: str, shapes: Mapping[str, Sequence[int]], hp: Qwen35HParams) -> dict[str, GGMLQuantizationType]:
    """Storage type of every tensor of a file of preset ``mix`` (rules: the module doc).

    Args:
        mix: a key of :data:`MIXES`.
        shapes: every tensor the file holds, GGUF name -> dims ``ne`` (``ne[0]`` = values per row); the
            attention-v counter and the tied-embedding rule look at the whole set.
        hp: the model's hyper-parameters (``n_layer + nextn_predict_layers`` = ``block_count``, ``n_expert``).

    Returns:
        name -> type, in the order of ``shapes``; F32 for tensors llama-quantize leaves unquantized.

    Raises:
        ValueError: unknown ``mix``, or an ``ffn_down`` tensor of a MoE model whose name carries no layer
            number or one outside ``0 .. block_count - 1`` (llama.cpp's ``layer_info`` error).
    """
    if mix not in MIXES:
        raise ValueError(f"unknown quant mix {mix!r} (known: {', '.join(MIXES)})")
    tied = "output.weight" not in shapes
    order = [n for n in visiting_order(list(shapes)) if quantized(n, shapes[n])]
    attn_v = [n for n in order if any(tag in n for tag in _ATTN_V_LIKE)]
    counters = {n: i for i, n in enumerate(attn_v)}
    counters |= {n: i for i, n in enumerate(n for n in order if "ffn_down" in n and n not in counters)}
    n_layer_all = hp.n_layer + hp.nextn_predict_layers
    out = {}
    for name, ne in shapes.items():
        if not quantized(name, ne):
            out[name] = Q.F32
            continue
        qtype = _q4_k_m(name, ne, hp, tied, counters.get(name, 0), len(attn_v), n_layer_all)
        if mix == "ud_q4_k_xl":
            qtype = _ud_q4_k_xl(name, qtype)
        out[name] = _fallback(qtype, ne[0])
    return out


def _q4_k_m(name: str, ne: Sequence[int], hp: Qwen35HParams, tied: bool, counter: int, n_attn_v: int,
            n_layer_all: int) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl's choice for Q4_K_M before the shape fallback; ``counter`` is the
    tensor's index among the attention-v-like (or the ffn_down) tensors in visiting order."""
    eight_experts = hp.n_expert == 8
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return Q.Q6_K if ne[0] % 256 == 0 else Q.Q8_0
    if name == "token_embd.weight":
        return Q.Q4_K
    if any(tag in name for tag in _ATTN_V_LIKE):
        return Q.Q8_0 if eight_experts else Q.Q6_K if use_more_bits(counter, n_attn_v) else Q.Q4_K
    if "attn_k.weight" in name:
        return Q.Q8_0 if eight_experts else Q.Q4_K
    if "ffn_down" in name:
        layer = _ffn_layer(name, n_layer_all) if hp.n_expert > 1 else counter
        return Q.Q6_K if use_more_bits(layer, n_layer_all) else Q.Q4_K
    if "attn_output.weight" in name:
        return Q.Q5_K if eight_experts else Q.Q4_K
    return Q.Q4_K


def _ud_q4_k_xl(name: str, q4_k_m: GGMLQuantizationType) -> GGMLQuantizationType:
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if base in _UD_EXPERTS:
        return _UD_EXPERTS[base]
    return Q.Q8_0 if base in _UD_Q8_0 else q4_k_m


def _layer_or(name: str, default: int) -> int:
    """The N of a ``blk.N.`` name, else ``default``."""
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else default


def _ffn_layer(name: str, n_layer_all: int) -> int:
    layer = _layer_or(name, -1)
    if not 0 <= layer < n_layer_all:
        raise ValueError(f"tensor {name}: no layer number blk.N. with 0 <= N < {n_layer_all} in its name")
    return layer


def _fallback(qtype: GGMLQuantizationType, ne0: int) -> GGMLQuantizationType:
    if ne0 % _BLOCK[qtype] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ne0 % _BLOCK[qtype] == 0 else Q.F16
