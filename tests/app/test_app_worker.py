"""The engine worker on its QThread: loading (stages, cancel), batching, prefill progress, cancel
within one token or one prompt piece, errors."""

from __future__ import annotations

import threading
import time

import pytest
from PySide6.QtCore import QObject, Signal

from app.engine_worker import (BATCH_SECONDS, ChatRequest, LoadRequest, WorkerThread, load_real_engine, plain_error,
                               summarize)
from engine.errors import ModelFormatError
from engine.events import PrefillProgress, PrefillStats
from fake_engine import BlockingLoader, FakeEngine, StagedLoader, failing_loader, fake_info, loader_for


class Driver(QObject):
    """Sends queued requests to a worker, as the window and the controller do."""

    load = Signal(object)
    chat = Signal(object)
    clear = Signal(object)
    measure = Signal(str)


@pytest.fixture
def worker_thread():
    threads = []

    def make(loader):
        t = WorkerThread(loader)
        t.driver = Driver()
        t.driver.load.connect(t.worker.load)
        t.driver.chat.connect(t.worker.chat)
        t.driver.clear.connect(t.worker.clear_snapshots)
        t.driver.measure.connect(t.worker.measure_image)
        threads.append(t)
        return t

    yield make
    for t in threads:
        t.stop()


def _load(qtbot, wt, signal, request=LoadRequest()):
    with qtbot.waitSignal(signal) as blocker:
        wt.driver.load.emit(request)
    return blocker.args


def test_load_runs_off_the_ui_thread_and_summarizes(qtbot, worker_thread, tmp_path):
    seen = {}

    def loader(request, progress, cancel):
        seen["thread"] = threading.current_thread()
        seen["request"] = request
        return FakeEngine()

    wt = worker_thread(loader)
    request = LoadRequest("m.gguf", "mmproj-m.gguf", context=2048, image_max_pixels=512 * 512, cache_dir=tmp_path)
    (summary,) = _load(qtbot, wt, wt.worker.loaded, request)
    assert seen["thread"] is not threading.main_thread() and seen["request"] == request
    assert summary.info.context == 4096 and not summary.info.has_vision
    assert "qwen35moe" in summary.line and "Q8_0" in summary.line and "read per token" in summary.line


def test_the_real_loader_passes_options_progress_and_cancel(monkeypatch, tmp_path):
    from engine import api

    seen = {}
    def load(cls, model, mmproj, options, progress, cancel):
        seen.update(model=model, options=options, progress=progress, cancel=cancel)

    monkeypatch.setattr(api.Engine, "load", classmethod(load))
    stages, cancel = [], threading.Event()
    load_real_engine(LoadRequest("m.gguf", context=2048, cache_dir=tmp_path, threads=3, device="cuda",
                                 vram_budget=6 << 30, weights="ram"), stages.append, cancel)
    assert seen["model"] == "m.gguf" and seen["options"] == api.EngineOptions(
        context=2048, cache_disk_dir=tmp_path, threads=3, device="cuda", vram_budget=6 << 30, weights="ram")
    assert seen["progress"] == stages.append and seen["cancel"] is cancel


def test_the_real_loader_pairs_the_bundled_demo_with_its_tower(monkeypatch, tmp_path):
    """The bundled demo named by its path (as `scripts/run --model` or a dropped file does) gets its
    vision tower; another model without --mmproj gets none, and an explicit tower is kept."""
    from engine import api, demo_model

    demo, tower = tmp_path / "deltadesk-demo.gguf", tmp_path / "deltadesk-demo-mmproj.gguf"
    other = tmp_path / "other.gguf"
    for f in (demo, tower, other):
        f.write_bytes(b"GGUF")
    monkeypatch.setattr(demo_model, "bundled_model", lambda: (demo, tower))
    seen = []
    monkeypatch.setattr(api.Engine, "load", classmethod(lambda cls, model, mmproj, *a, **k: seen.append(mmproj)))
    for model, mmproj in ((str(demo), None), (str(other), None), (str(demo), "mine.gguf")):
        load_real_engine(LoadRequest(model, mmproj, cache_dir=tmp_path), lambda stage: None, threading.Event())
    assert seen == [tower, None, "mine.gguf"]


def test_load_error_is_plain_words(qtbot, worker_thread):
    wt = worker_thread(failing_loader("model.gguf: tensor blk.0.attn_q.weight is missing"))
    (message,) = _load(qtbot, wt, wt.worker.load_failed)
    assert message == "model.gguf: tensor blk.0.attn_q.weight is missing"


def _run(qtbot, wt, request, on_tokens=None):
    got = {"text": "", "batches": 0, "ms": []}

    def tokens(text, ms):
        got["text"] += text
        got["batches"] += 1
        got["ms"] += ms
        if on_tokens:
            on_tokens(got)

    wt.worker.tokens.connect(tokens)
    t0 = time.monotonic()
    with qtbot.waitSignal(wt.worker.finished) as blocker:
        wt.driver.chat.emit(request)
    got["seconds"] = time.monotonic() - t0
    return got, blocker.args[0]


def test_waits_for_worker_signals_leave_the_gui_threads_qt_objects_alone(qtbot, qtlog, worker_thread):
    """The worker's signals reach a plain callable (a test's wait) on the worker's thread: the wait must not
    stop the GUI thread's timer or quit its event loop from there (pytest-qt's own blocker did; Qt refuses
    the stop and forgets the timer, so a quit lost just before the loop started was never made up for)."""
    wt = worker_thread(loader_for(FakeEngine()))
    for _ in range(3):
        _load(qtbot, wt, wt.worker.loaded)
    _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert [r.message for r in qtlog.records if "thread" in r.message] == []


def test_tokens_arrive_in_batches(qtbot, worker_thread):
    engine = FakeEngine(tokens=[f"t{i} " for i in range(200)], token_ms=2.0)
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    got, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.stop_reason == "eos"
    assert got["text"] == summary.text == "".join(f"t{i} " for i in range(200))
    assert len(got["ms"]) == 200
    # 200 tokens at >= 2 ms each take >= 400 ms; a batch is sent once BATCH_SECONDS (40 ms) have passed
    # since the last, so however slow the machine, there are at most seconds / BATCH_SECONDS + 1
    assert 3 <= got["batches"] <= got["seconds"] / BATCH_SECONDS + 1


def test_cancel_takes_effect_within_one_token(qtbot, worker_thread):
    engine = FakeEngine(tokens=["x"] * 1000, token_ms=5.0)
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    request = ChatRequest([{"role": "user", "content": "hi"}])
    at_cancel = {}

    def cancel_after_first_batch(got):
        if not at_cancel:
            request.cancel.set()
            at_cancel["produced"] = engine.produced
            at_cancel["time"] = time.monotonic()

    got, summary = _run(qtbot, wt, request, cancel_after_first_batch)
    assert summary.stop_reason == "cancelled"
    assert engine.produced - at_cancel["produced"] <= 1
    assert summary.generated_tokens <= at_cancel["produced"]
    assert got["text"] == summary.text == "x" * summary.generated_tokens


def test_prefill_progress_arrives_in_batches_before_the_answer(qtbot, worker_thread):
    engine = FakeEngine(tokens=["a", "b"], prompt_pieces=50, piece_ms=4.0)
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    order = []
    wt.worker.prefill_progress.connect(order.append)
    wt.worker.prefilled.connect(order.append)
    wt.worker.tokens.connect(lambda text, ms: order.append(text))
    got, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.stop_reason == "eos" and engine.pieces_read == 50
    progress = [e for e in order if isinstance(e, PrefillProgress)]
    # 50 pieces at >= 4 ms each take >= 200 ms: batches of >= 40 ms, as the tokens' above
    assert 2 <= len(progress) <= got["seconds"] / BATCH_SECONDS + 1
    # never backwards (two batches can show one count: 50 pieces read 20 tokens, 2.5 pieces a token)
    assert all(p.total == 30 for p in progress) and [p.done for p in progress] == sorted(p.done for p in progress)
    first_stats = next(i for i, e in enumerate(order) if isinstance(e, PrefillStats))
    assert all(isinstance(e, PrefillProgress) for e in order[:first_stats])
    assert all(isinstance(e, str) for e in order[first_stats + 1:]) and "".join(order[first_stats + 1:]) == "ab"


def test_cancel_during_prefill_takes_effect_within_one_piece(qtbot, worker_thread):
    engine = FakeEngine(tokens=["never"], prompt_pieces=1000, piece_ms=5.0)
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    request = ChatRequest([{"role": "user", "content": "hi"}])
    at_cancel = {}

    def cancel(_progress):
        if not at_cancel:
            request.cancel.set()
            at_cancel["read"] = engine.pieces_read

    wt.worker.prefill_progress.connect(cancel)
    got, summary = _run(qtbot, wt, request)
    assert summary.stop_reason == "cancelled" and summary.message == "Stopped."
    assert engine.pieces_read - at_cancel["read"] <= 1 and engine.produced == 0 and got["text"] == ""


def test_load_reports_its_stages_and_cancel_stops_the_engine_load(qtbot, worker_thread):
    loader = StagedLoader(FakeEngine())
    wt = worker_thread(loader)
    stages, outcomes = [], []
    wt.worker.load_stage.connect(lambda request, stage: stages.append((request.model_path, stage)))
    wt.worker.loaded.connect(outcomes.append)
    wt.worker.load_failed.connect(outcomes.append)
    wt.driver.load.emit(LoadRequest("big.gguf"))
    qtbot.waitUntil(lambda: len(stages) == 1)
    loader.step()
    qtbot.waitUntil(lambda: len(stages) == 2)
    assert stages == [("big.gguf", "mapping tensors"), ("big.gguf", "building the tokenizer")]
    wt.worker.cancel_load()
    loader.step()
    assert loader.finished.wait(30) and loader.cancelled.is_set() and loader.engine.loads == []
    qtbot.wait(50)
    assert outcomes == [] and len(stages) == 2
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.message == "Cannot answer: Loading the model was cancelled."


def test_a_new_load_cancels_the_one_in_progress(qtbot, worker_thread):
    first = StagedLoader(FakeEngine())
    wt = worker_thread(first)
    wt.driver.load.emit(LoadRequest("first.gguf"))
    qtbot.waitUntil(lambda: len(first.stages) == 1)
    wt.worker._loader = loader_for(FakeEngine(tokens=["second"]))
    (summary,) = _load(qtbot, wt, wt.worker.loaded, LoadRequest("second.gguf"))
    first.step()
    assert first.finished.wait(30) and first.cancelled.is_set()
    _, turn = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert turn.text == "second"


def test_error_mid_stream_ends_the_turn_with_a_message(qtbot, worker_thread):
    engine = FakeEngine(tokens=["a"] * 10, fail_with=MemoryError())
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    got, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.stop_reason == "error"
    assert summary.message.startswith("Out of memory while answering")
    assert got["text"] == "aaaaa"


def test_chat_without_a_model_says_why(qtbot, worker_thread):
    wt = worker_thread(failing_loader("bad magic"))
    _load(qtbot, wt, wt.worker.load_failed)
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.stop_reason == "error" and summary.message == "Cannot answer: bad magic"


def test_plain_error_and_summary_texts():
    assert plain_error(ModelFormatError("f.gguf: bad"), "loading") == "f.gguf: bad"
    assert "File not found" in plain_error(FileNotFoundError(2, "nope", "m.gguf"), "loading")
    assert plain_error(ValueError("x"), "answering") == "Unexpected error while answering: ValueError: x"
    line = summarize(fake_info(has_vision=True)).line
    assert line.startswith("fake-model.gguf: qwen35moe, 4 layers (1 attention)") and line.endswith("vision")


def test_summary_says_whose_parameter_count_it_shows():
    """n_params counts the text model only: the line must not read as the count with the vision tower."""
    line = summarize(fake_info(n_params=16_696_096, has_vision=True)).line
    assert "16.7 M params (text model)," in line


def test_summary_and_banner_note_the_chatml_fallback():
    from app.main_window import headline
    from engine.api import CHATML_NOTE
    info = fake_info(template_note=CHATML_NOTE)
    assert summarize(info).line.endswith(f"text only; {CHATML_NOTE}")
    assert headline(info, "prefill on CPU").endswith(f"decode on CPU \u00b7 {CHATML_NOTE}")
    assert CHATML_NOTE not in headline(fake_info(), "prefill on CPU")


def test_a_cancelled_load_returns_at_once_and_its_model_is_dropped(qtbot, worker_thread):
    engine = FakeEngine()
    loader = BlockingLoader(engine)
    wt = worker_thread(loader)
    failed = []
    wt.worker.loaded.connect(failed.append)
    wt.driver.load.emit(LoadRequest())
    assert loader.started.wait(30)
    wt.worker.cancel_load()
    loader.release()
    qtbot.wait(50)
    assert failed == [] and engine.loads
    assert engine.closed == 1              # the engine that finished loading too late is released
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.message == "Cannot answer: Loading the model was cancelled."


def test_a_newer_load_replaces_the_model_and_closes_the_old_one(qtbot, worker_thread):
    engines = [FakeEngine(tokens=["one"]), FakeEngine(tokens=["two"])]
    wt = worker_thread(lambda request, progress, cancel: engines[int(request.model_path)])
    _load(qtbot, wt, wt.worker.loaded, LoadRequest("0"))
    _load(qtbot, wt, wt.worker.loaded, LoadRequest("1"))
    assert engines[0].closed == 1
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}]))
    assert summary.text == "two"


def test_snapshots_are_listed_after_a_turn_and_cleared(qtbot, worker_thread):
    engine = FakeEngine()
    wt = worker_thread(loader_for(engine))
    with qtbot.waitSignal(wt.worker.snapshots_listed) as blocker:
        wt.driver.load.emit(LoadRequest())
    assert blocker.args == [[]]
    with qtbot.waitSignal(wt.worker.snapshots_listed) as blocker:
        wt.driver.chat.emit(ChatRequest([{"role": "user", "content": "hi"}], conversation="7"))
    (listed,) = blocker.args
    assert [(s.conversation, s.pos, s.tier) for s in listed] == [("7", 20, "ram")]
    assert engine.conversations == ["7"]
    with qtbot.waitSignal(wt.worker.snapshots_listed) as blocker:
        wt.driver.clear.emit(listed[0].key)
    assert blocker.args == [[]]


def test_image_sizes_are_measured_by_the_engine(qtbot, worker_thread, tmp_path):
    from PIL import Image

    Image.new("RGB", (640, 480)).save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    wt = worker_thread(loader_for(FakeEngine(has_vision=True)))
    _load(qtbot, wt, wt.worker.loaded)
    with qtbot.waitSignal(wt.worker.image_measured) as blocker:
        wt.driver.measure.emit(str(tmp_path / "a.png"))
    assert blocker.args == [str(tmp_path / "a.png"), (240, 320, 240 * 320 // (32 * 32), 1)]
    with qtbot.waitSignal(wt.worker.image_measured) as blocker:
        wt.driver.measure.emit(str(tmp_path / "bad.png"))
    assert "cannot identify image file" in blocker.args[1] and blocker.args[1].endswith("bad.png'")


def test_stop_saves_the_snapshots_of_the_model(qtbot, worker_thread):
    engine = FakeEngine()
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    wt.stop()
    assert engine.closed == 1 and not wt.thread.isRunning()


def test_a_finished_turn_reads_the_next_one_ahead(qtbot, worker_thread):
    engine = FakeEngine(tokens=["Hi", "!"])
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "hi"}], conversation="3"))
    qtbot.waitUntil(lambda: bool(engine.aheads))
    assert engine.aheads == [([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi!"}], "done")]


def test_a_send_cancels_the_read_ahead_at_once(qtbot, worker_thread):
    engine = FakeEngine(tokens=["a"], piece_ms=5.0)
    engine.ahead_pieces = 100_000                     # ~10 minutes unless cancelled: the send waits for no such thing
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    _run(qtbot, wt, ChatRequest([{"role": "user", "content": "one"}]))
    assert engine.reading_ahead.wait(30)
    _, summary = _run(qtbot, wt, ChatRequest([{"role": "user", "content": "two"}]))
    assert summary.stop_reason == "eos" and len(engine.calls) == 2
    assert engine.aheads[0] == ([{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"}],
                                "cancelled")


def test_an_image_measurement_stops_the_read_ahead_too(qtbot, worker_thread, tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 32)).save(tmp_path / "a.png")
    engine = FakeEngine(tokens=["a"], piece_ms=5.0, has_vision=True)
    engine.ahead_pieces = 100_000                     # ~10 minutes unless stopped
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    _run(qtbot, wt, ChatRequest([{"role": "user", "content": "one"}]))
    assert engine.reading_ahead.wait(30)
    with qtbot.waitSignal(wt.worker.image_measured, timeout=30000) as blocker:
        wt.driver.measure.emit(str(tmp_path / "a.png"))
    assert blocker.args[1] == (16, 32, 0, 1) and engine.aheads[0][1] == "cancelled"


def test_a_turn_waits_for_the_job_the_shared_session_is_running(qtbot, worker_thread):
    """The worker submits to the engine's session (which "Serve on localhost" shares) rather than locking."""
    engine = FakeEngine(tokens=["x"])
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    entered, leave = threading.Event(), threading.Event()
    served = wt.worker._session.call(lambda: entered.set() or leave.wait(30))    # a served request, say
    assert entered.wait(30)
    with qtbot.waitSignal(wt.worker.finished, timeout=30000) as blocker:
        wt.driver.chat.emit(ChatRequest([{"role": "user", "content": "hi"}]))
        qtbot.waitUntil(lambda: bool(wt.worker._session._queued))    # the turn waits in the session's queue
        assert engine.calls == []
        leave.set()
    assert served.result(30) and blocker.args[0].stop_reason == "eos" and len(engine.calls) == 1


def test_a_stopped_turn_reads_nothing_ahead(qtbot, worker_thread):
    engine = FakeEngine(tokens=["x"] * 1000, token_ms=5.0)
    wt = worker_thread(loader_for(engine))
    _load(qtbot, wt, wt.worker.loaded)
    request = ChatRequest([{"role": "user", "content": "hi"}])
    _, summary = _run(qtbot, wt, request, on_tokens=lambda got: request.cancel.set())
    assert summary.stop_reason == "cancelled"
    time.sleep(0.1)
    assert engine.aheads == []
