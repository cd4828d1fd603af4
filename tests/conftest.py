"""Shared fixtures: synthetic models written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """Return ``make(preset, quant) -> Path``: a synth GGUF (real vocabulary and template), cached per session."""
    from engine.testing.synth import synth

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


@pytest.fixture(scope="session")
def served(synth_model):
    """The tiny synth model (q8_0, context 512) behind ``engine serve`` on loopback, for the server, remote
    engine and app tests: ``(engine, engine_lock, server)``; a test that runs the engine in process holds
    ``engine_lock`` as the server does."""
    import threading

    from engine.api import Engine, EngineOptions
    from engine.openai import ServerConfig, ServerThread

    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(context=512))
    lock = threading.Lock()
    server = ServerThread(engine, ServerConfig("tiny"), port=0, engine_lock=lock).start()
    yield engine, lock, server
    server.stop()
    engine.close()


@pytest.fixture(scope="session")
def served_vision(synth_model, tmp_path_factory):
    """The tiny synth model with its random vision tower (images bounded to 64 x 64 px, context 512) behind
    ``engine serve`` as ``tiny-vl``: ``(server, engine)``."""
    from engine.api import Engine, EngineOptions
    from engine.openai import ServerConfig, ServerThread
    from engine.testing.pairs import synth_mmproj_for

    mmproj = synth_mmproj_for(tmp_path_factory.mktemp("mm") / "tiny-mmproj.gguf", "tiny", seed=0)
    engine = Engine.load(synth_model("tiny", "q8_0"), mmproj, options=EngineOptions(context=512,
                                                                                  image_max_pixels=64 * 64))
    server = ServerThread(engine, ServerConfig("tiny-vl"), port=0).start()
    yield server, engine
    server.stop()
    engine.close()
