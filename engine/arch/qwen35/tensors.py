"""The tensor table of the Qwen3.5/3.6 text models: every tensor the forward reads, with its GGUF ``ne``.

Names and shapes as llama.cpp's ``src/llama-model.cpp`` loads them for ``LLM_ARCH_QWEN35MOE`` /
``LLM_ARCH_QWEN35``; ``ne`` is fastest first (``(IN, OUT)`` for a 2-D weight, ``(IN, OUT, E)`` for the
routed experts).
"""

from __future__ import annotations

from .hparams import Qwen35HParams


def tensor_shapes(hp: Qwen35HParams) -> dict[str, tuple[int, ...]]:
    """Every trunk tensor the architecture reads, under its split name, with its GGUF ``ne``.

    As llama.cpp's ``llama-model.cpp`` loads them (``LLM_ARCH_QWEN35MOE`` / ``LLM_ARCH_QWEN35``):
    all layers have ``attn_norm`` and ``post_attention_norm``; Gated DeltaNet layers
    ``attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_conv1d, ssm_dt.bias, ssm_a, ssm_norm, ssm_out``;
    full-attention layers ``attn_q`` (q and gate per head), ``attn_k, attn_v, attn_output,
    attn_q_norm, attn_k_norm``; MoE layers the router, routed experts (``ne2`` = expert) and, when
    ``n_ff_shexp`` > 0, the shared expert; dense layers ``ffn_gate, ffn_up, ffn_down``. MTP blocks
    (``il >= n_layer``) are not listed. ``output.weight`` is listed but optional (absent = tied).

    Returns:
        name -> ne tuple, in file order (token_embd, blocks, output_norm, output).
    """
    d, hd = hp.n_embd, hp.head_dim
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (d, hp.n_vocab)}
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = (d,)
        t[p + "post_attention_norm.weight"] = (d,)
        if hp.is_recurrent(il):
            t[p + "attn_qkv.weight"] = (d, hp.conv_dim)
            t[p + "attn_gate.weight"] = (d, hp.value_dim)
            t[p + "ssm_beta.weight"] = (d, hp.num_v_heads)
            t[p + "ssm_alpha.weight"] = (d, hp.num_v_heads)
            t[p + "ssm_conv1d.weight"] = (hp.conv_kernel, hp.conv_dim)
            t[p + "ssm_dt.bias"] = (hp.num_v_heads,)
            t[p + "ssm_a"] = (hp.num_v_heads,)
            t[p + "ssm_norm.weight"] = (hp.head_v_dim,)
            t[p + "ssm_out.weight"] = (hp.value_dim, d)
        else:
            t[p + "attn_q.weight"] = (d, 2 * hp.n_head * hd)
            t[p + "attn_k.weight"] = (d, hp.n_head_kv * hd)
            t[p + "attn_v.weight"] = (d, hp.n_head_kv * hd)
            t[p + "attn_output.weight"] = (hp.n_head * hd, d)
            t[p + "attn_q_norm.weight"] = (hd,)
            t[p + "attn_k_norm.weight"] = (hd,)
        if hp.is_moe:
            t[p + "ffn_gate_inp.weight"] = (d, hp.n_expert)
            t[p + "ffn_gate_exps.weight"] = (d, hp.n_ff_exp, hp.n_expert)
            t[p + "ffn_up_exps.weight"] = (d, hp.n_ff_exp, hp.n_expert)
            t[p + "ffn_down_exps.weight"] = (hp.n_ff_exp, d, hp.n_expert)
            if hp.n_ff_shexp > 0:
                t[p + "ffn_gate_inp_shexp.weight"] = (d,)
                t[p + "ffn_gate_shexp.weight"] = (d, hp.n_ff_shexp)
                t[p + "ffn_up_shexp.weight"] = (d, hp.n_ff_shexp)
                t[p + "ffn_down_shexp.weight"] = (hp.n_ff_shexp, d)
        else:
            t[p + "ffn_gate.weight"] = (d, hp.n_ff)
            t[p + "ffn_up.weight"] = (d, hp.n_ff)
            t[p + "ffn_down.weight"] = (hp.n_ff, d)
    t["output_norm.weight"] = (d,)
    t["output.weight"] = (d, hp.n_vocab)
    return t


OPTIONAL_TENSORS = frozenset({"output.weight"})
"""Tensors of :func:`tensor_shapes` a file may omit (``output.weight`` absent = tied to ``token_embd``)."""


def fused_tensors(hp: Qwen35HParams) -> list[tuple[str, tuple[int, ...], list[tuple[str, int]]]]:
    """The fused storage forms of :func:`tensor_shapes` names (:data:`engine.registry.Fused`).

    Some converters store a full-attention layer's q / k / v as one ``attn_qkv`` (rows q, then k, then v;
    q holds the query and its gate per head) and the routed experts' gate and up as one
    ``ffn_gate_up_exps`` (gate rows, then up rows, per expert).
    """
    out: list[tuple[str, tuple[int, ...], list[tuple[str, int]]]] = []
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        if not hp.is_recurrent(il):
            q, kv = 2 * hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            out.append((p + "attn_qkv.weight", (hp.n_embd, q + 2 * kv),
                        [(p + "attn_q.weight", q), (p + "attn_k.weight", kv), (p + "attn_v.weight", kv)]))
        if hp.is_moe:
            out.append((p + "ffn_gate_up_exps.weight", (hp.n_embd, 2 * hp.n_ff_exp, hp.n_expert),
                        [(p + "ffn_gate_exps.weight", hp.n_ff_exp), (p + "ffn_up_exps.weight", hp.n_ff_exp)]))
    return out
