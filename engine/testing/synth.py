"""Random-weight GGUF files with the exact layout of Qwen3.5/3.6 models, for tests and benchmarks.

:func:`synth` writes a whole random model from a preset (:data:`engine.arch.qwen35.presets.PRESETS`) through
the family's writer (:mod:`engine.arch.qwen35.writer`; :func:`write_gguf` writes given tensors), one tensor at
a time (a full-size file streams to disk holding one tensor in RAM). Weight scales keep activations O(1)
(residual writers GPT-2 style); storage types: :func:`~engine.arch.qwen35.writer.storage_type`.
Design: docs/design/gguf-files.md (the scales and types).
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.arch.qwen35.hparams import Qwen35HParams
from engine.arch.qwen35.presets import PRESETS, QWEN35_N_VOCAB, preset_hparams
from engine.arch.qwen35.quant_mix import MIXES, mix_types
from engine.arch.qwen35.tensors import tensor_shapes
from engine.arch.qwen35.writer import FILE_TYPES, Plan, file_type, storage_type, tokens_of, write_gguf, write_plan
from engine.gguf.quant import BLOCK_DTYPES, pack_k_scales, quantize, row_bytes, type_size

from .synth_lowbit import DRAWN as _LOWBIT_DRAWN
from .synth_lowbit import random_lowbit_blocks

__all__ = ["FILE_TYPES", "PRESETS", "QWEN35_N_VOCAB", "preset_hparams", "storage_type", "synth", "write_gguf"]

Q = GGMLQuantizationType

_RESIDUAL_WRITERS = ("ssm_out.weight", "attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                     "ffn_down.weight")
# std of the dequantized quant value: uniform nibble q-8 in -8..7, uniform int8 in -128..127
_QUANT_STD = {Q.Q4_0: math.sqrt((16 ** 2 - 1) / 12), Q.Q8_0: math.sqrt((256 ** 2 - 1) / 12)}
# K-quants drawn directly: levels of the unsigned quant q (x = d sc (q - centre) with dmin m = d sc centre)
_K_LEVELS = {Q.Q4_K: 16, Q.Q5_K: 32, Q.Q6_K: 64}

def synth(path: str | os.PathLike[str], preset: str, layers: int | None = None, experts: int | None = None,
          quant: str = "q4_0", seed: int = 0, vocab: Any = "qwen35") -> Qwen35HParams:
    """Write a random-weight model of a preset (see module doc for the weight distributions).

    Args:
        path: output file (overwritten).
        preset: ``tiny``, ``small``, ``dense-tiny`` or ``35b-a3b`` (:data:`PRESETS`).
        layers, experts: shrink the preset (:func:`preset_hparams`).
        quant: file type: ``f32``, ``f16``, ``q8_0``, ``q4_0`` (also ``bf16``, ``q4_1``, ``q5_0``, ``q5_1``;
            ``q2_k``, ``q3_k``, the IQ1/IQ2/IQ3 types and ``mxfp4``, drawn as blocks by
            :mod:`engine.testing.synth_lowbit`),
            or a K-quant mix of :data:`engine.arch.qwen35.quant_mix.MIXES` (``q4_k_m``: llama-quantize's per-tensor
            types; ``ud_q4_k_xl``: unsloth's dynamic mix as documented; see :mod:`engine.arch.qwen35.quant_mix`;
            its Q4_K / Q5_K / Q6_K / Q8_0 blocks are drawn directly).
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
    qfile = Q.Q4_K if mix else file_type(quant, MIXES)
    if isinstance(vocab, str):
        if vocab != "qwen35":
            raise ValueError(f"vocab must be 'qwen35', None or a list of tokens, got {vocab!r}")
        from engine.arch.qwen35 import vocab as vocab_module
        vocab = vocab_module.minicpmv46_vocab() if preset.startswith("minicpmv46") else vocab_module.qwen35_vocab()
    n_vocab = QWEN35_N_VOCAB if vocab is None else len(tokens_of(vocab))
    hp = preset_hparams(preset, n_vocab, layers, experts)
    plan: list[Plan] = []
    shapes = tensor_shapes(hp)
    mixed = mix_types(mix, shapes, hp) if mix else {}
    for name, ne in shapes.items():
        shape = tuple(reversed(ne))
        qtype = mixed[name] if mix else storage_type(name, ne, qfile)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), *shape])
        plan.append((name, shape, qtype, lambda n=name, s=shape, q=qtype, r=rng: _random_tensor(n, s, q, hp, r)))
    write_plan(path, hp, plan, MIXES[mix] if mix else FILE_TYPES[qfile], vocab, None,
           name=f"DeltaDesk synthetic {preset}", drawn=_K_LEVELS.keys() | _LOWBIT_DRAWN)
    return hp


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
    random 16 bits r:
    ``|d|`` = std / std(quant) * (0.8 + 0.4 r / 65535), sign (f16 bit 15) from bit 0 of r; the dequantized
    values have std ~``std`` and mean 0.
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
