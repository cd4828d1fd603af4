"""An Engine driven by its Session: the overlapping-use refusal is released on every way a job ends."""

from __future__ import annotations

import threading

import pytest

from engine.api import Engine, EngineOptions
from engine.errors import GenerationCancelled, TemplateError
from engine.events import TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.session import Session

MESSAGES = [{"role": "user", "content": "Where is the circle?"}]


@pytest.fixture
def engine(synth_model, tmp_path):
    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(cache_disk_dir=tmp_path))
    yield engine
    engine.close()


def test_a_turn_closed_early_then_closing_the_engine_as_a_job(engine, tmp_path) -> None:
    """The app's shutdown: its turn's iterator is closed after the first token, then ``session.call(engine.close)``
    runs after the turn has ended (never refused as overlapping) and writes the turn's snapshots to disk."""
    with Session() as session:
        events = session.stream(lambda c: engine.chat(MESSAGES, SamplingParams.greedy(64), c))
        assert any(isinstance(e, TokenEvent) for e in events)      # read up to the first token
        events.close()
        session.call(engine.close).result(60)
    assert list(tmp_path.rglob("*.snap"))


def test_a_failed_prepare_and_a_cancelled_queued_turn_leave_the_engine_free(engine) -> None:
    """A turn whose prompt fails to render raises to its caller, and one cancelled while queued never starts:
    neither holds the engine, so the next turn and a read-ahead run."""
    def bad_template(*_args, **_kwargs):
        raise TemplateError("the template failed")

    with Session() as session:
        real = engine.prompts.prepare
        engine.prompts.prepare = bad_template
        with pytest.raises(TemplateError):
            list(session.stream(lambda c: engine.chat(MESSAGES, cancel=c)))
        engine.prompts.prepare = real
        blocker = session.stream(lambda c: engine.chat(MESSAGES, SamplingParams.greedy(4), c))
        stopped = threading.Event()
        stopped.set()                                  # cancelled before the session takes it up
        queued = session.stream(lambda c: engine.chat(MESSAGES, SamplingParams.greedy(4), c), stopped)
        with pytest.raises(GenerationCancelled):
            list(queued)
        summary = [e for e in blocker if isinstance(e, TurnSummary)][0]
        answer = MESSAGES + [{"role": "assistant", "content": summary.text}]
        assert session.read_ahead(lambda c: engine.prefill_ahead(answer, cancel=c)).result(60) is not None
