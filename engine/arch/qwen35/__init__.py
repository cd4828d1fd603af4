"""Qwen3.5 / Qwen3.6 hybrid text models (GGUF ``qwen35moe``: MoE; ``qwen35``: dense SwiGLU): Gated DeltaNet
layers with a gated full-attention layer every ``full_attention_interval``, M-RoPE positions.

The folder holds the hyper-parameters (:mod:`.hparams`), the tensor table (:mod:`.tensors`), the numpy
reference forward (:mod:`.model`), its native CPU twin (:mod:`.cpu`, :mod:`.cpu_mixers`), GPU prefill
(:mod:`.cuda`, :mod:`.cuda_plan`), the answer's channels (:mod:`.channels`), the chat markup and decode
positions (:mod:`.markup`), the synthetic-model writer (:mod:`.synth`, :mod:`.quant_mix`) and the real
vocabulary (:mod:`.vocab`). :data:`ARCH` is what :mod:`engine.registry` hands out.
"""

from __future__ import annotations

from typing import Any

from engine.registry import TextArch

from .channels import splitter
from .hparams import Qwen35HParams, from_metadata
from .markup import MARKUP, decode_positions
from .tensors import OPTIONAL_TENSORS, fused_tensors, tensor_shapes


def _reference_model(hp: Qwen35HParams, gguf: Any) -> Any:
    from .model import Qwen35Model
    return Qwen35Model(hp, gguf)


def _native_model(hp: Qwen35HParams, gguf: Any, repack: bool = True) -> Any:
    from .cpu import NativeQwen35Model
    return NativeQwen35Model(hp, gguf, repack=repack)


def _cuda_prefill(hp: Qwen35HParams, gguf: Any, budget_bytes: int | None) -> Any:
    from . import cuda
    return cuda.CudaPrefill(hp, gguf, budget_bytes)


def _prefill_plan(hp: Qwen35HParams, gguf: Any, budget_bytes: int) -> Any:
    from .cuda import PLAN_TOKENS
    from .cuda_plan import plan_file
    return plan_file(hp, gguf, budget_bytes, PLAN_TOKENS).plan


ARCH = TextArch(name="qwen35", hparams=from_metadata, tensor_shapes=tensor_shapes, optional_tensors=OPTIONAL_TENSORS,
                fused_tensors=fused_tensors, reference_model=_reference_model, native_model=_native_model,
                cuda_prefill=_cuda_prefill, prefill_plan=_prefill_plan, channels=splitter,
                markup=MARKUP, decode_positions=decode_positions)
