"""Per-tensor storage types of llama.cpp's K-quant file presets, for Qwen3.5/3.6 (``qwen35``,
``qwen35moe``) tensor names: what ``llama-quantize`` writes, so synthetic files carry the same mix.

Source: llama.cpp ``src/llama-quant.cpp`` (ggml-org/llama.cpp at commit 007dbbf),
``llama_tensor_get_type`` / ``llama_tensor_get_type_impl``, ``tensor_allows_quantization`` and
``tensor_type_fallback``, without an importance matrix and without user overrides. For
``LLAMA_FTYPE_MOSTLY_Q4_K_M`` (default type Q4_K) that gives, tensor by tensor:

* not quantized (kept F32): tensors of fewer than 2 dimensions, names not ending in ``weight``,
  ``*_norm.weight``, ``ffn_gate_inp.weight``, ``ssm_conv1d``;
* ``output.weight``: Q6_K (Q8_0 when ``ne0`` is not a multiple of 256); ``token_embd.weight``:
  Q4_K, or the output's rule when the file has no ``output.weight`` (tied embeddings);
* "attention-v-like" tensors (names containing ``attn_v.weight``, ``attn_qkv.weight`` or
  ``attn_kv_b.weight``; in Qwen3.5 one per layer: ``attn_qkv`` of a delta-net layer, ``attn_v`` of a
  full-attention layer), counted in file order i = 0..n-1 (llama.cpp sorts tensors by layer, so i
  is the layer): Q6_K when ``use_more_bits(i, n)``, else Q4_K; Q8_0 when ``n_expert == 8``;
* ``attn_k.weight``: Q8_0 when ``n_expert == 8``, else Q4_K;
* names containing ``ffn_down`` (``ffn_down``, ``ffn_down_exps``, ``ffn_down_shexp``) of layer l
  (parsed from the name) in a model of ``n_layer`` layers: Q6_K when ``use_more_bits(l, n_layer)``,
  else Q4_K;
* ``attn_output.weight``: Q5_K when ``n_expert == 8``, else Q4_K;
* everything else quantized (``attn_q``, ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_out``,
  ``ffn_gate*``, ``ffn_up*``): Q4_K;
* then the shape fallback: ``ne0`` not a multiple of 256 turns Q4_K into Q5_0, Q5_K into Q5_1,
  Q6_K into Q8_0, and F16 if ``ne0`` is not a multiple of 32 either.

``use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division, C's
remainder: negative operands never occur as ``i >= n/8`` there).

Unsloth's UD-Q4_K_XL mixes are chosen per model with an importance matrix and published as files,
not as a rule in llama.cpp, so they are not reproduced here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gguf import GGMLQuantizationType, LlamaFileType

from .hparams import Qwen35HParams

Q = GGMLQuantizationType

MIXES: dict[str, LlamaFileType] = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}
"""K-quant file presets :func:`mix_type` knows, by their llama-quantize name, with their ``general.file_type``."""

_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight")
_ATTN_V_LIKE = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_BLOCK = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q8_0: 32}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def quantized(name: str, ne: Sequence[int]) -> bool:
    """Whether llama-quantize quantizes this tensor at all (``tensor_allows_quantization`` for these names)."""
    return (len(ne) >= 2 and name.endswith("weight") and not name.endswith(_NOT_QUANTIZED)
            and "ssm_conv1d" not in name)


def mix_type(mix: str, name: str, ne: Sequence[int], hp: Qwen35HParams, has_output: bool = True) -> GGMLQuantizationType:
    """Storage type of tensor ``name`` (GGUF dims ``ne``) in a file of preset ``mix`` (see the module doc).

    Args:
        mix: a key of :data:`MIXES`.
        name: GGUF tensor name; ``ne``: its dims (``ne[0]`` = values per row).
        hp: the model's hyper-parameters (``n_layer``, ``n_expert``).
        has_output: the file has an ``output.weight`` (else ``token_embd`` is tied and takes the output's rule).

    Returns:
        The type; F32 for tensors llama-quantize leaves unquantized.

    Raises:
        ValueError: unknown ``mix``, or a per-layer tensor whose name carries no layer number.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown quant mix {mix!r} (known: {', '.join(MIXES)})")
    if not quantized(name, ne):
        return Q.F32
    n_layer = hp.n_layer + hp.nextn_predict_layers
    eight_experts = hp.n_expert == 8
    qtype = Q.Q4_K
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return Q.Q6_K if ne[0] % 256 == 0 else Q.Q8_0
    if name == "token_embd.weight":
        qtype = Q.Q4_K
    elif any(tag in name for tag in _ATTN_V_LIKE):
        qtype = Q.Q8_0 if eight_experts else Q.Q6_K if use_more_bits(_layer(name), n_layer) else Q.Q4_K
    elif "attn_k.weight" in name:
        qtype = Q.Q8_0 if eight_experts else Q.Q4_K
    elif "ffn_down" in name:
        qtype = Q.Q6_K if use_more_bits(_layer(name), n_layer) else Q.Q4_K
    elif "attn_output.weight" in name:
        qtype = Q.Q5_K if eight_experts else Q.Q4_K
    return _fallback(qtype, ne[0])


def _layer(name: str) -> int:
    match = re.match(r"blk\.(\d+)\.", name)
    if match is None:
        raise ValueError(f"tensor {name}: no layer number (blk.N.) in its name")
    return int(match.group(1))


def _fallback(qtype: GGMLQuantizationType, ne0: int) -> GGMLQuantizationType:
    if ne0 % _BLOCK[qtype] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ne0 % _BLOCK[qtype] == 0 else Q.F16
