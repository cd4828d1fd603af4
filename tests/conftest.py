"""Shared fixtures: synthetic models written once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import pytest


@pytest.fixture
def isa_reset():
    """Put the CPU kernels' ISA level and thread count back to their defaults after the test."""
    yield
    from engine.kernels import cpu
    cpu.set_isa(None)
    cpu.set_threads()


@pytest.fixture
def vnni(isa_reset):
    """The CPU kernels on the avx512vnni level for one test (skip where absent); the defaults restored after."""
    from engine.kernels import cpu
    if "avx512vnni" not in cpu.supported_isas():
        pytest.skip("needs the avx512vnni level")
    cpu.set_isa("avx512vnni")


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


class Hold:
    """``with hold:`` gives the test the engine to itself: a job of ``session`` holds the session's thread
    from the block's start to its end (the engine busy, as with the app's own turn)."""

    def __init__(self, session) -> None:
        self.session = session

    def __enter__(self) -> Self:
        import threading
        self._entered, self._leave = threading.Event(), threading.Event()
        self._ticket = self.session.call(self._wait)
        assert self._entered.wait(60)
        return self

    def _wait(self) -> None:
        self._entered.set()
        self._leave.wait(300)

    def __exit__(self, *exc) -> None:
        self._leave.set()
        self._ticket.result(60)


@pytest.fixture(scope="session")
def served(synth_model):
    """The tiny synth model (q8_0, context 512) behind ``engine serve`` on loopback, for the server, remote
    engine and app tests: ``(engine, hold, server)``; a test that runs the engine in process does it inside
    ``with hold:`` (:class:`Hold`; ``hold.session`` runs the server's turns)."""
    from engine.api import Engine, EngineOptions
    from engine.openai import ServerConfig, ServerThread
    from engine.session import Session

    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(context=512))
    session = Session()
    server = ServerThread(engine, ServerConfig("tiny"), port=0, session=session).start()
    yield engine, Hold(session), server
    server.stop()
    session.close()
    engine.close()


@pytest.fixture(scope="module")
def engine(served):
    """The :func:`served` engine (a test file may define its own ``engine``)."""
    return served[0]


@pytest.fixture(scope="module")
def hold(served):
    """``with hold:`` keeps the :func:`served` engine to the test (:class:`Hold`); ``hold.session`` runs the turns."""
    return served[1]


@pytest.fixture(scope="module")
def server(served):
    """The :func:`served` ``ServerThread`` (its ``url`` ends in ``/v1``)."""
    return served[2]


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
