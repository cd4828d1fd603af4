"""What the window says about model files: the .gguf files of a drop, the vision tower lying next to a
model, and the banner's one-line headline of a loaded model."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QMimeData


def gguf_files(mime: QMimeData) -> tuple[list[str], list[str]]:
    """The local .gguf files of a drop, as (models, vision towers); a tower's name contains "mmproj"."""
    files = [url.toLocalFile() for url in mime.urls()
             if url.isLocalFile() and url.toLocalFile().lower().endswith(".gguf")]
    towers = [f for f in files if "mmproj" in Path(f).name.lower()]
    return [f for f in files if f not in towers], towers


def paired_mmproj(model_path: str) -> str | None:
    """The vision tower lying next to a model: the one ``*mmproj*.gguf`` file in its folder, or of
    several the one whose name shares the longest start with the model's (None: none, a tie, or
    the folder cannot be read). llama.cpp's and the model hubs' releases ship the pair that way.
    """
    model = Path(model_path)
    try:
        towers = sorted(p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model)
    except OSError:
        return None
    if len(towers) <= 1:
        return str(towers[0]) if towers else None
    def shared(p: Path) -> int:
        return len(os.path.commonprefix([p.name.lower(), model.name.lower()]))
    best = max(shared(p) for p in towers)
    picks = [p for p in towers if shared(p) == best]
    return str(picks[0]) if len(picks) == 1 and best > 0 else None


def headline(info, prefill: str, images: str = "") -> str:
    """The banner's line for a user: model name, size, main quant type, what it takes, where it runs.

    E.g. "Qwen3.6-35B-A3B-Q4_K_M · 34.7 B params · Q4_K · text and images · prefill on GPU (H200),
    decode on CPU". ``info`` is an :class:`engine.api.ModelInfo` (``n_params`` counts the text
    model; the main quant type is the one holding the most bytes); ``prefill`` and ``images`` are
    :func:`~app.gpu.device_phrase` and :func:`~app.gpu.vision_phrase`. A remote engine is named
    with its server: "tiny on http://host:8000/v1 (remote engine) · text only · runs on the server".
    Weights read into memory say so after the decode ("decode on CPU, weights in memory"; ``info.weights``).
    A file that chats in ChatML for want of a template ends with that notice (``info.template_note``).
    A pruned file says how many experts it kept after its size ("128 of 256 experts kept (REAP)",
    ``info.pruning``).
    """
    takes = "text and images" if info.has_vision else "text only"
    if info.remote:
        return " \u00b7 ".join((f"{info.name} on {info.remote} (remote engine)", takes, prefill))
    n = info.n_params
    size = f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    quant = max(info.quant_mix.items(), key=lambda kv: kv[1][1])[0] if info.quant_mix else "?"
    held = "weights in memory" if info.weights == "ram" else ""
    where = ", ".join(p for p in (prefill, "decode on CPU", held, images) if p)
    parts = (Path(info.path).stem, f"{size} params", info.pruning, quant, takes, where, info.template_note)
    return " \u00b7 ".join(p for p in parts if p)
