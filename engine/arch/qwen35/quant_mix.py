"""Per-tensor storage types of the K-quant file presets users download, for Qwen3.5/3.6 (``qwen35``,
``qwen35moe``) tensor names, so synthetic files carry the same mix: llama-quantize's ``Q4_K_M`` and
unsloth's ``UD-Q4_K_XL``.

**Q4_K_M.** Source: llama.cpp ``src/llama-quant.cpp`` as vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp``, ggml 0.25.3), functions ``llama_tensor_get_type`` / ``llama_tensor_get_type_impl``,
``tensor_get_category``, ``tensor_allows_quantization``, ``init_quantize_state_counters`` and
``tensor_type_fallback``, without an importance matrix and without user overrides. Tensors are visited
in ``llama_model_loader::weights_map`` order (``weight_name_comparer``: by the layer number of
``blk.N.``, tensors without one first, then by name). With default type Q4_K, tensor by tensor:

* not quantized (kept as stored): tensors of fewer than 2 dimensions, names not ending in ``weight``,
  ``*_norm.weight``, ``ffn_gate_inp.weight``, ``ssm_conv1d``;
* ``output.weight``: Q6_K (Q8_0 when ``ne0`` is not a multiple of 256); ``token_embd.weight``:
  Q4_K, or the output's rule when the file has no ``output.weight`` (tied embeddings);
* "attention-v-like" tensors (category ``ATTENTION_V``, ``ATTENTION_QKV`` or ``ATTENTION_KV_B``:
  names containing ``attn_v.weight``, ``attn_qkv.weight`` or ``attn_kv_b.weight``; in Qwen3.5 one per
  layer: ``attn_qkv`` of a delta-net layer, ``attn_v`` of a full-attention layer): the i-th of them in
  visiting order, of ``n_attention_wv`` in the file, is Q6_K when ``use_more_bits(i, n_attention_wv)``,
  else Q4_K; Q8_0 whatever i when ``n_expert == 8``. The counter is over these tensors, not the layer
  number: it equals the layer only when every layer has exactly one (true of Qwen3.5 files, not of a
  file whose ``block_count`` counts MTP blocks it does not store). The ``ATTENTION_QKV`` branch that
  would give Q5_K is never reached for Q4_K_M: the attention-v-like branch comes first;
* ``attn_k.weight``: Q8_0 when ``n_expert == 8``, else Q4_K;
* names containing ``ffn_down`` (``ffn_down``, ``ffn_down_exps``, ``ffn_down_shexp``) of layer l
  (parsed from ``blk.l.`` when ``n_expert > 1``; in a dense model the index among the ffn_down tensors
  in visiting order, which is the layer) in a model of ``block_count``
  layers (``n_layer_all``, MTP blocks included): Q6_K when ``use_more_bits(l, block_count)``, else Q4_K;
* ``attn_output.weight``: Q5_K when ``n_expert == 8``, else Q4_K;
* everything else quantized (``attn_q``, ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_out``,
  ``ffn_gate*``, ``ffn_up*``): Q4_K;
* then the shape fallback: ``ne0`` not a multiple of 256 turns Q4_K into Q5_0, Q5_K into Q5_1,
  Q6_K into Q8_0, and F16 if ``ne0`` is not a multiple of 32 either.

``use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division; C's remainder
equals Python's here, since ``i >= n/8`` when it is reached). For Qwen3.5-35B-A3B (40 layers, 256
experts) that is layers 0-4, 7, 10, ..., 34 and 35-39: 20 of 40.

Checked against the quantizer itself: ``tests/fixtures/quant_mix/make_fixture.py`` runs that llama.cpp's
``llama-quantize ... Q4_K_M`` on F16 synth files (40 layers at the 35B-A3B's widths; 8 experts; 128-wide expert
rows; the dense MiniCPM-V 4.6 text model) and records every tensor's type, and
``tests/test_synth.py::test_q4_k_m_mix_equals_llama_quantize_output`` finds :func:`mix_types` equal to it on
every tensor. Not covered there: a file whose ``block_count`` counts an MTP block it does not store.

**UD-Q4_K_XL.** Unsloth chooses these per model with an importance matrix and KL-divergence runs and
publishes files, not a rule; no per-tensor type list of their Qwen3.5/3.6 MoE files was found in a
public, citable form. The mix here is defined from what is documented, and otherwise is Q4_K_M:

* routed experts: ``ffn_gate_exps`` and ``ffn_up_exps`` Q4_K, ``ffn_down_exps`` Q5_K (gittensor-ai-lab/
  sparkinfer pull request 224, on unsloth's Qwen3.6-35B-A3B UD files: "ffn_down_exps is Q5_K while
  gate/up stay Q4_K"; unsloth's Qwen3.5-35B-A3B announcement, r/LocalLLaMA 2026-02-27: "ffn_down_exps is
  slightly more sensitive", MXFP4 retired from Q4_K_XL);
* attention and delta-net projections (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``attn_qkv``,
  ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_out``): Q8_0 (the same announcement: "Quantizing any
  attn_* is especially sensitive for hybrid architectures, and so leaving them in higher precision",
  "ssm_out dramatically increases KLD and the disk space savings is minuscule");
* everything else (shared experts, ``token_embd``, ``output``, unquantized tensors): the Q4_K_M rule,
  then the same shape fallback.

Both presets write ``general.file_type`` = ``MOSTLY_Q4_K_M`` (15), the preset the UD files start from.
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
