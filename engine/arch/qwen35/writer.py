"""Qwen3.5/3.6 GGUF files written from tensors: the family's metadata keys (docs/spec/qwen35.md section 1), its
tokenizer keys, and llama-quantize's storage types, streamed through :func:`engine.gguf.write.write`.

Storage types follow llama-quantize (docs/spec/qwen35.md section 2): 1-D tensors, ``*_norm``, ``ffn_gate_inp``,
``ffn_gate_inp_shexp``, ``ssm_conv1d``, ``ssm_a`` and ``ssm_dt.bias`` stay F32, everything else takes the file's type.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

from engine.gguf import write as gguf_write
from engine.gguf.quant import WRITABLE_TYPES, block_size, parse_type, quantize, row_bytes, type_name
from engine.kernels.iq_twins import IQ_TYPES

from .hparams import Qwen35HParams

Q = GGMLQuantizationType
U32, F32, STR, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY

FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    Q.Q2_K: LlamaFileType.MOSTLY_Q2_K, Q.Q3_K: LlamaFileType.MOSTLY_Q3_K_S, Q.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    Q.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS, Q.IQ2_S: LlamaFileType.MOSTLY_IQ2_S, Q.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    Q.IQ3_S: LlamaFileType.MOSTLY_IQ3_S, Q.IQ1_S: LlamaFileType.MOSTLY_IQ1_S, Q.IQ1_M: LlamaFileType.MOSTLY_IQ1_M,
    Q.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}
"""``general.file_type`` written for each file-wide quant type (gguf ``LlamaFileType``)."""

SHAPE_FALLBACK = {t: Q.IQ4_NL for t in (Q.Q2_K, Q.Q3_K, *IQ_TYPES) if t != Q.IQ4_NL}
"""llama-quantize's type for a tensor whose ``ne0`` is not a multiple of 256 (``tensor_type_fallback``)."""

_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight",
             "ssm_a", "ssm_dt.bias")

Plan = tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]
"""A tensor to write: name, math shape, storage type, and a function producing its stored blocks."""


def storage_type(name: str, ne: Sequence[int], quant: GGMLQuantizationType,
                 quant_overrides: Mapping[str, str] | None = None) -> GGMLQuantizationType:
    """Storage type of a tensor in a file of type ``quant``, following llama-quantize.

    Args:
        name: GGUF tensor name. ne: its GGUF dims. quant: the file-wide type.
        quant_overrides: ``fnmatch`` pattern -> type name (``{"output.weight": "q8_0"}``); the first
            matching pattern wins over every other rule.

    Returns:
        F32 for 1-D tensors and the names in the module doc, the override if one matches, else ``quant``,
        or :data:`SHAPE_FALLBACK` when ``ne0`` is not a whole number of its blocks.
    """
    for pattern, qname in (quant_overrides or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return parse_type(qname)
    if len(ne) == 1 or name.endswith(_KEEP_F32):
        return Q.F32
    if quant in SHAPE_FALLBACK and ne[0] % block_size(quant):
        return SHAPE_FALLBACK[quant]
    return quant


def file_type(quant: str, also: Iterable[str] = ()) -> GGMLQuantizationType:
    """The file-wide type named ``quant`` (a key of :data:`FILE_TYPES`). Raises ValueError naming the
    writable ones (and ``also``, names a caller accepts besides)."""
    try:
        qtype = parse_type(quant)
    except ValueError:
        qtype = None
    if qtype not in FILE_TYPES:
        extra = f"; also: {', '.join(also)}" if also else ""
        raise ValueError(f"cannot write a {quant!r} file (expected one of "
                         f"{', '.join(type_name(t).lower() for t in FILE_TYPES)}{extra})")
    return qtype


def write_gguf(path: str | os.PathLike[str], hp: Qwen35HParams, tensors: Mapping[str, np.ndarray], quant: str,
               vocab: Any = None, chat_template: str | None = None,
               quant_overrides: Mapping[str, str] | None = None) -> None:
    """Write float tensors and the metadata of ``hp`` as a GGUF file.

    Args:
        path: output file (replaced when complete).
        hp: hyper-parameters; every key of docs/spec/qwen35.md section 1 is written from it (``block_count`` =
            ``n_layer + nextn_predict_layers``), plus ``general.name/type/file_type/quantization_version``.
        tensors: GGUF name -> float array in math shape (``(OUT, IN)`` for a weight, ``(E, OUT, IN)`` for
            experts). Written as given, in this order: nothing is checked against ``hp``, so a test can
            write a deliberately broken file.
        quant: file type name: ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``.
        vocab: ``None`` (no tokenizer metadata; ``{arch}.vocab_size`` = ``hp.n_vocab`` is written), a list
            of token strings (minimal ``gpt2`` tokenizer metadata), or an ``engine.arch.qwen35.vocab.GGUFVocab``.
        chat_template: ``tokenizer.chat_template``; for a GGUFVocab, defaults to the Qwen3.5 template.
        quant_overrides: per-tensor types, see :func:`storage_type`.

    Raises:
        ValueError: unknown or unwritable type name (K-quants cannot be written), a quantized tensor whose
            ``ne0`` is not a multiple of the block size, or a vocabulary whose size differs from ``hp.n_vocab``.
    """
    qfile = file_type(quant)
    plan: list[Plan] = []
    for name, x in tensors.items():
        x = np.asarray(x, dtype=np.float32)
        qtype = storage_type(name, x.shape[::-1], qfile, quant_overrides)
        plan.append((name, x.shape, qtype, lambda x=x, qtype=qtype: quantize(x, qtype)))
    write_plan(path, hp, plan, FILE_TYPES[qfile], vocab, chat_template, name="DeltaDesk test model")


def write_plan(path: str | os.PathLike[str], hp: Qwen35HParams, plan: Iterable[Plan], ftype: LlamaFileType,
               vocab: Any, chat_template: str | None, name: str, drawn: Iterable[GGMLQuantizationType] = ()) -> None:
    """Stream a GGUF: header, metadata and tensor table first, then each tensor produced and written in turn.
    ``drawn``: types besides :data:`WRITABLE_TYPES` the plan's producers make (drawn as blocks).

    Raises:
        ValueError: a type that cannot be produced, or an ``ne0`` that is not a whole number of blocks.
    """
    producible = WRITABLE_TYPES | set(drawn)
    tensors = []
    for tname, shape, qtype, produce in plan:
        if qtype not in producible:
            raise ValueError(f"tensor {tname}: cannot write {type_name(qtype)} (writable: "
                             f"{', '.join(sorted(type_name(t).lower() for t in WRITABLE_TYPES))})")
        if shape[-1] % block_size(qtype):
            raise ValueError(f"tensor {tname}: ne0 = {shape[-1]} is not a multiple of the {type_name(qtype)} "
                             f"block size {block_size(qtype)}")
        nbytes = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
        tensors.append(gguf_write.TensorOut(tname, tuple(reversed(shape)), int(qtype), nbytes,
                                            lambda p=produce: (np.ascontiguousarray(p()).reshape(-1).view(np.uint8),)))
    records = metadata_records(hp, ftype, name) + vocab_records(hp, vocab, chat_template)
    gguf_write.write(path, records, tensors)


def metadata_records(hp: Qwen35HParams, ftype: LlamaFileType, name: str) -> list[bytes]:
    """``general.*`` and every ``{arch}.*`` key of docs/spec/qwen35.md section 1, from ``hp``."""
    a, rec = hp.arch, gguf_write.kv_record
    u32 = {
        "block_count": hp.n_layer + hp.nextn_predict_layers, "nextn_predict_layers": hp.nextn_predict_layers,
        "context_length": hp.context_length, "embedding_length": hp.n_embd,
        "attention.head_count": hp.n_head, "attention.head_count_kv": hp.n_head_kv,
        "attention.key_length": hp.head_dim, "attention.value_length": hp.head_dim,
        "rope.dimension_count": hp.rope_dims, "full_attention_interval": hp.full_attention_interval,
        "ssm.conv_kernel": hp.conv_kernel, "ssm.state_size": hp.head_k_dim, "ssm.group_count": hp.num_k_heads,
        "ssm.time_step_rank": hp.num_v_heads, "ssm.inner_size": hp.value_dim,
    }
    if hp.is_moe:
        u32.update({"expert_count": hp.n_expert, "expert_used_count": hp.n_expert_used,
                    "expert_feed_forward_length": hp.n_ff_exp,
                    "expert_shared_feed_forward_length": hp.n_ff_shexp})
    else:
        u32["feed_forward_length"] = hp.n_ff
    return [rec("general.architecture", a, STR), rec("general.type", "model", STR), rec("general.name", name, STR),
            rec("general.file_type", int(ftype), U32),
            rec("general.quantization_version", gguf.GGML_QUANT_VERSION, U32),
            *(rec(f"{a}.{key}", value, U32) for key, value in u32.items()),
            rec(f"{a}.attention.layer_norm_rms_epsilon", hp.rms_eps, F32),
            rec(f"{a}.rope.freq_base", hp.rope_theta, F32),
            rec(f"{a}.rope.dimension_sections", list(hp.rope_sections), ARR, GGUFValueType.INT32)]


def vocab_records(hp: Qwen35HParams, vocab: Any, chat_template: str | None) -> list[bytes]:
    """Tokenizer metadata (see :func:`write_gguf`, ``vocab``).

    Raises:
        ValueError: a vocabulary whose size differs from ``hp.n_vocab``.
    """
    rec = gguf_write.kv_record
    template = [rec("tokenizer.chat_template", chat_template, STR)] if chat_template else []
    if vocab is None:
        return [rec(f"{hp.arch}.vocab_size", hp.n_vocab, U32), *template]
    tokens = tokens_of(vocab)
    if len(tokens) != hp.n_vocab:
        raise ValueError(f"vocabulary has {len(tokens)} tokens but hp.n_vocab = {hp.n_vocab}")
    if isinstance(vocab, (list, tuple)):
        return [rec("tokenizer.ggml.model", "gpt2", STR), rec("tokenizer.ggml.tokens", tokens, ARR, STR),
                rec("tokenizer.ggml.token_type", [int(gguf.TokenType.NORMAL)] * len(tokens), ARR,
                    GGUFValueType.INT32), *template]
    from . import vocab as vocab_module
    return vocab_module.tokenizer_records(vocab, vocab_module.QWEN35_CHAT_TEMPLATE if chat_template is None
                                          else chat_template)


def tokens_of(vocab: Any) -> list[str]:
    """The token strings of a vocabulary given as a list or a ``GGUFVocab``."""
    return list(vocab) if isinstance(vocab, (list, tuple)) else vocab.tokens
