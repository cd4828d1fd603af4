"""The model used when none is named: the bundled demo (``assets/models/``), else a tiny
synthetic text model and vision tower written once to the user cache dir.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs

from .errors import EngineError


def bundled_model() -> tuple[Path, Path | None] | None:
    """The bundled demo model under ``assets/models/``: (text GGUF, mmproj GGUF or None), or
    None when its text GGUF is absent. Writes nothing."""
    assets = Path(__file__).resolve().parent.parent / "assets" / "models"
    text, mmproj = assets / "deltadesk-demo.gguf", assets / "deltadesk-demo-mmproj.gguf"
    if not text.is_file():
        return None
    return text, mmproj if mmproj.is_file() else None


def bundled_mmproj_for(model_path: str | Path) -> Path | None:
    """The bundled demo's vision tower when ``model_path`` is the bundled demo's text GGUF (same file
    after resolving links), else None: a model named by its path without ``--mmproj`` still gets it,
    as it does when no model is named (so the demo always loads with its tower). Any other model's
    tower must be given explicitly."""
    bundled = bundled_model()
    if bundled is None or not Path(model_path).is_file():
        return None
    return bundled[1] if Path(model_path).resolve() == bundled[0].resolve() else None


def default_model() -> tuple[Path, Path | None]:
    """The model (text GGUF, mmproj GGUF or None) the app and ``python -m engine`` use when none is given.

    The bundled demo model (:func:`bundled_model`) when present; else the ``tiny`` synthetic model
    and its tiny random vision tower (random weights, real vocabulary and template: it exercises the
    whole pipeline but only babbles), written once to the user cache dir.

    Raises:
        EngineError: the cache dir is not writable.
    """
    bundled = bundled_model()
    if bundled is not None:
        return bundled
    from .tools.synth import write_default_pair
    folder = Path(platformdirs.user_cache_dir("deltadesk")) / "models"
    try:
        path, mmproj = write_default_pair(folder)
    except OSError as exc:
        raise EngineError(f"cannot write the default model to {folder}: {exc}") from exc
    return path, mmproj
