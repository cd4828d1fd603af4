"""The shapes of the family's models: named hyper-parameter presets, real (``35b-a3b``, ``minicpmv46``) and
test-sized (``tiny``, ``small``, ...), for the hub catalogue's estimates and the synthetic test models
(:mod:`engine.testing.synth`).
"""

from __future__ import annotations

from typing import Any

from .hparams import Qwen35HParams

QWEN35_N_VOCAB = 248320
"""Padded vocabulary size of every Qwen3.5/3.6 model (docs/spec/qwen35.md section 5)."""

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
projector (:func:`engine.testing.pairs.synth_mmproj_for`)."""


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
