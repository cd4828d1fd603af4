"""Random-weight GGUF files with the exact layout of Qwen3.5/3.6 models, for tests and benchmarks.

:func:`write_gguf` writes given float32 tensors with a :class:`~engine.arch.qwen35.hparams.Qwen35HParams`'
metadata, quantized like llama-quantize; :func:`synth` writes a whole random model from :data:`PRESETS`,
one tensor at a time (a full-size file streams to disk holding one tensor in RAM). Weight scales keep
activations O(1) (residual writers GPT-2 style); storage types follow llama-quantize.
Design: docs/design/gguf-files.md (the scales and types).
"""

from __future__ import annotations

import fnmatch
import math
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from engine.gguf.quant import (BLOCK_DTYPES, WRITABLE_TYPES, block_size, pack_k_scales, parse_type, quantize, row_bytes,
                    type_name, type_size)

from .hparams import Qwen35HParams
from .quant_mix import MIXES, mix_types
from .synth_lowbit import DRAWN as _LOWBIT_DRAWN
from .synth_lowbit import SHAPE_FALLBACK, random_lowbit_blocks
from .tensors import tensor_shapes

Q = GGMLQuantizationType

QWEN35_N_VOCAB = 248320
"""Padded vocabulary size of every Qwen3.5/3.6 model (docs/spec/qwen35.md section 5)."""

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

_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight",
             "ssm_a", "ssm_dt.bias")
_RESIDUAL_WRITERS = ("ssm_out.weight", "attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                     "ffn_down.weight")
# std of the dequantized quant value: uniform nibble q-8 in -8..7, uniform int8 in -128..127
_QUANT_STD = {Q.Q4_0: math.sqrt((16 ** 2 - 1) / 12), Q.Q8_0: math.sqrt((256 ** 2 - 1) / 12)}
# K-quants drawn directly: levels of the unsigned quant q (x = d sc (q - centre) with dmin m = d sc centre)
_K_LEVELS = {Q.Q4_K: 16, Q.Q5_K: 32, Q.Q6_K: 64}

_COMMON = dict(arch="qwen35moe", nextn_predict_layers=0, context_length=262144, rms_eps=1e-6,
               rope_theta=1e7, full_attention_interval=4, conv_kernel=4)
_TINY = dict(_COMMON, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, rope_dims=8,
             rope_sections=(2, 1, 1, 0), head_k_dim=16, num_k_heads=2, num_v_heads=4, head_v_dim=16,
             n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "small": dict(_COMMON, n_layer=8, n_embd=256, n_head=8, n_head_kv=2, head_dim=64, rope_dims=16,
                  rope_sections=(3, 3, 2, 0), head_k_dim=32, num_k_heads=4, num_v_heads=8, head_v_dim=32,
                  n_expert=16, n_expert_used=4, n_ff_exp=128, n_ff_shexp=128),
    "dense-tiny": dict(_TINY, arch="qwen35", n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff_shexp=0, n_ff=128),
    "minicpmv46-tiny": dict(_TINY, arch="qwen35", n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff_shexp=0, n_ff=128),
    "minicpmv46": dict(_COMMON, arch="qwen35", n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=256,
                       rope_dims=64, rope_sections=(11, 11, 10, 0), head_k_dim=128, num_k_heads=16, num_v_heads=16,
                       head_v_dim=128, n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff_shexp=0, n_ff=3584),
    "35b-a3b": dict(_COMMON, n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, rope_dims=64,
                    rope_sections=(11, 11, 10, 0), head_k_dim=128, num_k_heads=16, num_v_heads=32,
                    head_v_dim=128, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512),
}
"""Hyper-parameters of each preset except ``n_vocab`` (taken from the vocabulary). ``35b-a3b`` is
Qwen3.5/3.6-35B-A3B (docs/spec/qwen35.md sections 1 and Models) without its MTP block; ``minicpmv46`` is the
text model of MiniCPM-V 4.6, Qwen3.5-0.8B (HF ``text_config``: 24 layers of 1024, 8/2 heads of 256, Gated
DeltaNet 16/16 heads of 128, FFN 3584), and ``minicpmv46-tiny`` its test-sized twin; both get a MiniCPM-V 4.6
projector (:func:`engine.tools.synth.synth_mmproj_for`)."""


def preset_hparams(preset: str, n_vocab: int = QWEN35_N_VOCAB, layers: int | None = None,
                   experts: int | None = None) -> Qwen35HParams:
    """Hyper-parameters of a preset, optionally shrunk.

    Args:
        preset: a key of :data:`PRESETS`.
        n_vocab: vocabulary size (rows of ``token_embd`` / ``output``).
        layers: trunk layer count instead of the preset's (layer types follow ``(il+1) % 4``).
        experts: routed expert count instead of the preset's; ``n_expert_used`` is capped to it.

    Raises:
        ValueError: unknown preset, ``layers`` / ``experts`` < 1, or ``experts`` on a dense preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown synth preset {preset!r} (expected one of {', '.join(PRESETS)})")
    p = dict(PRESETS[preset], n_vocab=n_vocab)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        p["n_layer"] = layers
    if experts is not None:
        if p["arch"] != "qwen35moe" or experts < 1:
            raise ValueError(f"experts={experts} needs a MoE preset and a value >= 1 (preset {preset!r})")
        p["n_expert"] = experts
        p["n_expert_used"] = min(p["n_expert_used"], experts)
    return Qwen35HParams(**p)


def storage_type(name: str, ne: Sequence[int], quant: GGMLQuantizationType,
                 quant_overrides: Mapping[str, str] | None = None) -> GGMLQuantizationType:
    """Storage type of a tensor in a file of type ``quant``, following llama-quantize.

    Args:
        name: GGUF tensor name.
        ne: its GGUF dims.
        quant: the file-wide type.
        quant_overrides: ``fnmatch`` pattern -> type name (``{"output.weight": "q8_0"}``); the first
            matching pattern wins over every other rule.

    Returns:
        F32 for 1-D tensors and the names in the module doc, the override if one matches, else ``quant``,
        or llama-quantize's fallback type when ``ne0`` is not a whole number of its blocks
        (:data:`~engine.arch.qwen35.synth_lowbit.SHAPE_FALLBACK`: IQ4_NL for Q2_K, Q3_K and the IQ types).
    """
    for pattern, qname in (quant_overrides or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return parse_type(qname)
    if len(ne) == 1 or name.endswith(_KEEP_F32):
        return Q.F32
    if quant in SHAPE_FALLBACK and ne[0] % block_size(quant):
        return SHAPE_FALLBACK[quant]
    return quant


# A tensor to write: name, math shape, storage type, and a function producing its stored bytes.
_Plan = tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]


def write_gguf(path: str | os.PathLike[str], hp: Qwen35HParams, tensors: Mapping[str, np.ndarray], quant: str,
               vocab: Any = None, chat_template: str | None = None,
               quant_overrides: Mapping[str, str] | None = None) -> None:
    """Write float tensors and the metadata of ``hp`` as a GGUF file.

    Args:
        path: output file (overwritten).
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
    qfile = _file_type(quant)
    plan: list[_Plan] = []
    for name, x in tensors.items():
        x = np.asarray(x, dtype=np.float32)
        qtype = storage_type(name, x.shape[::-1], qfile, quant_overrides)
        plan.append((name, x.shape, qtype, lambda x=x, qtype=qtype: quantize(x, qtype)))
    _write(path, hp, plan, FILE_TYPES[qfile], vocab, chat_template, name="DeltaDesk test model")


def synth(path: str | os.PathLike[str], preset: str, layers: int | None = None, experts: int | None = None,
          quant: str = "q4_0", seed: int = 0, vocab: Any = "qwen35") -> Qwen35HParams:
    """Write a random-weight model of a preset (see module doc for the weight distributions).

    Args:
        path: output file (overwritten).
        preset: ``tiny``, ``small``, ``dense-tiny`` or ``35b-a3b`` (:data:`PRESETS`).
        layers, experts: shrink the preset (:func:`preset_hparams`).
        quant: file type: ``f32``, ``f16``, ``q8_0``, ``q4_0`` (also ``bf16``, ``q4_1``, ``q5_0``, ``q5_1``;
            ``q2_k``, ``q3_k``, the IQ1/IQ2/IQ3 types and ``mxfp4``, drawn as blocks by
            :mod:`engine.arch.qwen35.synth_lowbit`), or a K-quant mix of :data:`engine.arch.qwen35.quant_mix.MIXES`
            (``q4_k_m``: llama-quantize's per-tensor types; ``ud_q4_k_xl``: unsloth's dynamic mix as documented; see
            :mod:`engine.arch.qwen35.quant_mix`; its Q4_K / Q5_K / Q6_K / Q8_0 blocks are drawn directly).
        seed: the weights are a deterministic function of (seed, tensor name, shape).
        vocab: ``"qwen35"`` for the real vocabulary and chat template (``engine.arch.qwen35.vocab``; the
            ``minicpmv46`` presets add MiniCPM-V's image markers, ``minicpmv46_vocab``), ``None`` for no tokenizer
            metadata with ``vocab_size`` 248320, or a list of token strings.

    Returns:
        The hyper-parameters written.

    Raises:
        ValueError: bad preset, sizes or type name.
    """
    mix = quant.lower() if quant.lower() in MIXES else None
    qfile = Q.Q4_K if mix else _file_type(quant)
    if isinstance(vocab, str):
        if vocab != "qwen35":
            raise ValueError(f"vocab must be 'qwen35', None or a list of tokens, got {vocab!r}")
        from . import vocab as vocab_module
        vocab = vocab_module.minicpmv46_vocab() if preset.startswith("minicpmv46") else vocab_module.qwen35_vocab()
    n_vocab = QWEN35_N_VOCAB if vocab is None else len(_tokens(vocab))
    hp = preset_hparams(preset, n_vocab, layers, experts)
    plan: list[_Plan] = []
    shapes = tensor_shapes(hp)
    mixed = mix_types(mix, shapes, hp) if mix else {}
    for name, ne in shapes.items():
        shape = tuple(reversed(ne))
        qtype = mixed[name] if mix else storage_type(name, ne, qfile)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), *shape])
        plan.append((name, shape, qtype, lambda n=name, s=shape, q=qtype, r=rng: _random_tensor(n, s, q, hp, r)))
    _write(path, hp, plan, MIXES[mix] if mix else FILE_TYPES[qfile], vocab, None,
           name=f"DeltaDesk synthetic {preset}", drawn=_K_LEVELS.keys() | _LOWBIT_DRAWN)
    return hp


def _file_type(quant: str) -> GGMLQuantizationType:
    try:
        qtype = parse_type(quant)
    except ValueError:
        qtype = None
    if qtype not in FILE_TYPES:
        raise ValueError(f"cannot write a {quant!r} file (expected one of "
                         f"{', '.join(type_name(t).lower() for t in FILE_TYPES)}; synth also: {', '.join(MIXES)})")
    return qtype


def _tokens(vocab: Any) -> list[str]:
    return list(vocab) if isinstance(vocab, (list, tuple)) else vocab.tokens


def _random_tensor(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, hp: Qwen35HParams,
                   rng: np.random.Generator) -> np.ndarray:
    """Stored bytes (``(..., row_bytes)`` uint8) of one random tensor in math ``shape``."""
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if base.endswith("_norm.weight"):
        x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif base == "ssm_a":
        x = -np.exp(rng.uniform(math.log(0.5), math.log(4.0), shape)).astype(np.float32)
    elif base == "ssm_dt.bias":
        x = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        fan_in = shape[-1]
        if base == "token_embd.weight":
            std = 1.0
        elif base in _RESIDUAL_WRITERS:
            std = 1.0 / math.sqrt(2 * hp.n_layer * fan_in)
        else:
            std = 1.0 / math.sqrt(fan_in)
        if qtype in _QUANT_STD:
            return _random_blocks(shape, qtype, std, rng)
        if qtype in _K_LEVELS:
            return _random_kquant_blocks(shape, qtype, std, rng)
        if qtype in _LOWBIT_DRAWN:
            return random_lowbit_blocks(shape, qtype, std, rng)
        x = std * rng.standard_normal(shape, dtype=np.float32)
    return quantize(x, qtype)


def _random_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Q4_0 / Q8_0 blocks drawn directly: uniform random quants, f16 scale ``d`` of random sign.

    Layout (ggml-common.h ``block_q4_0`` / ``block_q8_0``): f16 ``d`` in bytes 0..1, quants after it.
    All bytes are drawn uniformly (raw PCG64 output, the fastest numpy source), then ``d`` is rewritten from its own
    random 16 bits r: ``|d|`` = std / std(quant) * (0.8 + 0.4 r / 65535), sign (f16 bit 15) from bit 0 of r; the
    dequantized values have std ~``std`` and mean 0.
    """
    rb = row_bytes(qtype, shape[-1])
    nbytes = math.prod(shape[:-1]) * rb
    out = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    d_bits = out.reshape(-1, type_size(qtype)).view("<u2")[:, 0]
    r = d_bits.astype(np.float32)
    d = np.float32(std / _QUANT_STD[qtype]) * (np.float32(0.8) + np.float32(0.4 / 65535) * r)
    d_bits[:] = d.astype("<f2").view("<u2") | ((d_bits & 1) << 15)
    return out.reshape(*shape[:-1], rb)


def _random_kquant_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
                          rng: np.random.Generator) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K super-blocks drawn directly (layouts: engine.gguf.quant, ggml-common.h).

    All bytes are drawn uniformly, so the quants q are uniform over their L levels (16, 32, 64); then
    the scales are rewritten from the random bytes already there: Q4_K / Q5_K sub-block scale
    sc = 32 + (byte & 31) with min m = sc and dmin = d (L - 1) / 2, so x = d sc (q - (L - 1) / 2) has
    mean 0; Q6_K int8 scale of magnitude 64 + (byte & 63) and the byte's top bit as sign, x = d sc (q - 32)
    (mean -d sc / 2, small against its std). ``|d|`` = std / (std(q) mean|sc|) * (0.8 + 0.4 r / 65535) from
    d's own random 16 bits r, sign from bit 0 of r: the values have std ~``std``.
    """
    rb = row_bytes(qtype, shape[-1])
    nbytes = math.prod(shape[:-1]) * rb
    out = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    b = out.view(BLOCK_DTYPES[qtype])
    levels = _K_LEVELS[qtype]
    q_std = math.sqrt((levels ** 2 - 1) / 12)
    if qtype == Q.Q6_K:
        raw_scales = b["scales"].view(np.uint8)
        magnitude = (64 + (raw_scales & 63)).astype(np.int16)
        b["scales"] = np.where(raw_scales & 128, -magnitude, magnitude).astype(np.int8)
        mean_sc = 95.5
    else:
        sc = (32 + (b["scales"][:, :8] & 31)).astype(np.int64)
        b["scales"] = pack_k_scales(sc, sc)
        mean_sc = 47.5
    d_bits = b["d"].view("<u2")
    r = d_bits.astype(np.float32)
    d = np.float32(std / (q_std * mean_sc)) * (np.float32(0.8) + np.float32(0.4 / 65535) * r)
    d = np.where(d_bits & 1, -d, d).astype(np.float32)
    b["d"] = d.astype("<f2")
    if qtype != Q.Q6_K:
        b["dmin"] = (d * np.float32((levels - 1) / 2)).astype("<f2")
    return out.reshape(*shape[:-1], rb)


def _write(path: str | os.PathLike[str], hp: Qwen35HParams, plan: Iterable[_Plan], file_type: LlamaFileType,
           vocab: Any, chat_template: str | None, name: str, drawn: Iterable[GGMLQuantizationType] = ()) -> None:
    """Stream a GGUF: header, metadata and tensor table first, then each tensor produced and written in turn.
    ``drawn``: types besides :data:`WRITABLE_TYPES` the plan's producers make (drawn as blocks)."""
    plan = list(plan)
    producible = WRITABLE_TYPES | set(drawn)
    w = gguf.GGUFWriter(os.fspath(path), hp.arch)
    _add_metadata(w, hp, file_type, name)
    _add_vocab(w, hp, vocab, chat_template)
    for tname, shape, qtype, _ in plan:
        if qtype not in producible:
            raise ValueError(f"tensor {tname}: cannot write {type_name(qtype)} (writable: "
                             f"{', '.join(sorted(type_name(t).lower() for t in WRITABLE_TYPES))})")
        if shape[-1] % block_size(qtype):
            raise ValueError(f"tensor {tname}: ne0 = {shape[-1]} is not a multiple of the {type_name(qtype)} "
                             f"block size {block_size(qtype)}")
        nbytes = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
        w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, produce in plan:
        w.write_tensor_data(produce())
    w.close()


def _add_metadata(w: gguf.GGUFWriter, hp: Qwen35HParams, file_type: LlamaFileType, name: str) -> None:
    """``general.*`` and every ``{arch}.*`` key of docs/spec/qwen35.md section 1, from ``hp``."""
    a = hp.arch
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    u32 = {
        "block_count": hp.n_layer + hp.nextn_predict_layers,
        "nextn_predict_layers": hp.nextn_predict_layers,
        "context_length": hp.context_length,
        "embedding_length": hp.n_embd,
        "attention.head_count": hp.n_head,
        "attention.head_count_kv": hp.n_head_kv,
        "attention.key_length": hp.head_dim,
        "attention.value_length": hp.head_dim,
        "rope.dimension_count": hp.rope_dims,
        "full_attention_interval": hp.full_attention_interval,
        "ssm.conv_kernel": hp.conv_kernel,
        "ssm.state_size": hp.head_k_dim,
        "ssm.group_count": hp.num_k_heads,
        "ssm.time_step_rank": hp.num_v_heads,
        "ssm.inner_size": hp.value_dim,
    }
    if hp.is_moe:
        u32.update({"expert_count": hp.n_expert, "expert_used_count": hp.n_expert_used,
                    "expert_feed_forward_length": hp.n_ff_exp,
                    "expert_shared_feed_forward_length": hp.n_ff_shexp})
    else:
        u32["feed_forward_length"] = hp.n_ff
    for key, value in u32.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", hp.rope_theta)
    w.add_key_value(f"{a}.rope.dimension_sections", list(hp.rope_sections), gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.INT32)


def _add_vocab(w: gguf.GGUFWriter, hp: Qwen35HParams, vocab: Any, chat_template: str | None) -> None:
    """Tokenizer metadata (see :func:`write_gguf`, ``vocab``)."""
    if vocab is None:
        w.add_vocab_size(hp.n_vocab)
        if chat_template:
            w.add_chat_template(chat_template)
        return
    tokens = _tokens(vocab)
    if len(tokens) != hp.n_vocab:
        raise ValueError(f"vocabulary has {len(tokens)} tokens but hp.n_vocab = {hp.n_vocab}")
    if isinstance(vocab, (list, tuple)):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        if chat_template:
            w.add_chat_template(chat_template)
        return
    from . import vocab as vocab_module
    template = vocab_module.QWEN35_CHAT_TEMPLATE if chat_template is None else chat_template
    vocab_module.add_tokenizer_metadata(w, vocab, template)
