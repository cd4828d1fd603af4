"""Shared fixtures: synthetic models written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """Return ``make(preset, quant) -> Path``: a synth GGUF (real vocabulary and template), cached per session."""
    from engine.synth import synth

    made: dict[tuple[str, str], Path] = {}
    folder = tmp_path_factory.mktemp("synth")

    def make(preset: str = "tiny", quant: str = "q8_0") -> Path:
        key = (preset, quant)
        if key not in made:
            path = folder / f"{preset}-{quant}.gguf"
            synth(path, preset, quant=quant, seed=0)
            made[key] = path
        return made[key]

    return make
