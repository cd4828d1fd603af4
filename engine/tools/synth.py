"""Synthetic text + vision pairs: a random tower whose width matches a synthetic text model's, and the
engine's default pair when no bundled demo exists."""

from __future__ import annotations

import os
from pathlib import Path

from engine.arch.minicpmv.mmproj import synth_mmproj as synth_minicpmv
from engine.arch.qwen35.synth import QWEN35_N_VOCAB, preset_hparams, synth
from engine.arch.qwen3vl.mmproj import synth_mmproj


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


def write_default_pair(folder: Path) -> tuple[Path, Path]:
    """The ``tiny`` synthetic text model (Q8_0, real vocabulary and template) and its tiny tower (F16) in
    ``folder``, each written once (through a temporary file renamed into place) and reused after.

    Returns:
        (text GGUF, mmproj GGUF).

    Raises:
        OSError: the folder or a file cannot be written.
    """
    path, mmproj = folder / "synth-tiny-q8_0.gguf", folder / "synth-tiny-mmproj-f16.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    for target, write in ((path, lambda p: synth(p, "tiny", quant="q8_0", seed=0)),
                          (mmproj, lambda p: synth_mmproj_for(p, "tiny", seed=0))):
        if not target.is_file():
            tmp = target.with_suffix(".tmp")
            write(tmp)
            tmp.replace(target)
    return path, mmproj
