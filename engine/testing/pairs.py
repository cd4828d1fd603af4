"""Synthetic text + vision pairs: a random tower whose width matches a synthetic text model's."""

from __future__ import annotations

import os
from pathlib import Path

from engine.testing.minicpmv import synth_mmproj as synth_minicpmv
from engine.arch.qwen35.presets import QWEN35_N_VOCAB, preset_hparams
from engine.testing.qwen3vl import synth_mmproj


def synth_mmproj_for(path: str | os.PathLike[str], preset: str, seed: int = 0) -> Path:
    """Write a random vision tower (mmproj GGUF) that matches a text preset's hidden size.

    ``35b-a3b`` gets the real Qwen3.5/3.6 tower shape (27 x 1152, Q8_0, ~0.5 GB), the other Qwen
    presets the tiny test tower (F16); see :data:`engine.arch.qwen3vl.mmproj.PRESETS`. ``minicpmv46`` gets the
    real MiniCPM-V 4.6 tower (F16, ~1.1 GB) and ``minicpmv46-tiny`` the tiny one
    (:data:`engine.arch.minicpmv.mmproj.PRESETS`).

    Raises:
        ValueError: unknown preset.
    """
    n_embd = preset_hparams(preset, QWEN35_N_VOCAB, None, None).n_embd
    if preset.startswith("minicpmv46"):
        return synth_minicpmv(path, "real" if preset == "minicpmv46" else "tiny", out_dim=n_embd, seed=seed)
    if preset == "35b-a3b":
        return synth_mmproj(path, "real", out_dim=n_embd, seed=seed, ftype="Q8_0")
    return synth_mmproj(path, "tiny", out_dim=n_embd, seed=seed, ftype="F16")
