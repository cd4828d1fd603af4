"""The model used when none is named: the bundled demo (``assets/models/``). Nothing here writes a model;
random test models come only from ``python -m engine synth`` and the tests (:mod:`engine.testing`).
"""

from __future__ import annotations

from pathlib import Path

from .errors import EngineError

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
"""Where the bundled demo model lives: ``deltadesk-demo.gguf`` and its tower ``deltadesk-demo-mmproj.gguf``."""


def bundled_model() -> tuple[Path, Path | None] | None:
    """The bundled demo model under :data:`ASSETS`: (text GGUF, mmproj GGUF or None), or None when its
    text GGUF is absent. Writes nothing."""
    text, mmproj = ASSETS / "deltadesk-demo.gguf", ASSETS / "deltadesk-demo-mmproj.gguf"
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
    """The model (text GGUF, mmproj GGUF or None) the app and ``python -m engine`` use when none is given:
    the bundled demo model (:func:`bundled_model`).

    Raises:
        EngineError: the bundled demo is missing; the message names the file and the ways to get a model.
    """
    bundled = bundled_model()
    if bundled is None:
        raise EngineError(
            f"the bundled demo model {ASSETS / 'deltadesk-demo.gguf'} is missing: restore it from the repository "
            "(git checkout -- assets/models), name a model (--model FILE.gguf), download one "
            "(python -m engine pull REPO:QUANT), or write a random test model "
            "(python -m engine synth --preset tiny --quant q8_0 -o tiny.gguf)")
    return bundled
