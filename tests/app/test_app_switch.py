"""A failed model switch keeps what worked: a truncated GGUF or an unreachable remote server leaves the model
loaded before (local or remote) answering, with the error in the status bar and the settings naming it."""

from __future__ import annotations

import socket
import weakref
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from app.engine_worker import load_real_engine
from app.history import HistoryStore
from app_helpers import stored


def _send(qtbot, window, text: str):
    window.composer.editor.setPlainText(text)
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: stored(window.history, HistoryStore.active_path,
                                   window.controller.conversation_id)[-1].state == "complete")
    return stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1]


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _failed(qtbot, window, words: str) -> str:
    qtbot.waitUntil(lambda: window.loading is None and words in window.statusBar().currentMessage())
    return window.statusBar().currentMessage()


def test_a_truncated_gguf_leaves_the_local_model_answering(qtbot, make_window, synth_model, tmp_path):
    good = synth_model("tiny", "q8_0")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, model_path=str(good), context=512, max_tokens=3, temperature=0.0,
                                  weights="map"))   # mapped: open beside the new one (read into memory: closed first)
    qtbot.waitUntil(lambda: window.model is not None)
    assert window.statusBar().currentMessage() == f"Now using {good.name}."
    banner, first = window.banner.text(), _send(qtbot, window, "Say hello.")
    window.load_model(str(truncated), remember=True)
    message = _failed(qtbot, window, "Could not open cut.gguf")
    assert message.startswith(f"Still using {good.name}. Could not open cut.gguf: ")
    assert window.banner.text() == banner and window.prefs.model_path == str(good)
    again = _send(qtbot, window, "Say hello.")
    assert again.state == "complete" and again.stats["generated_tokens"] == first.stats["generated_tokens"] == 3


def test_the_copy_read_into_memory_is_freed_before_the_next_load(qtbot, make_window, synth_model):
    from engine.errors import EngineError
    copies, freed = [], []

    def loader(request, progress, cancel):
        if request.model_path == "m.gguf":
            freed.append(all(ref() is None for ref in copies))
            raise EngineError("m.gguf: wrong magic b'GGUX', expected b'GGUF'")
        engine = load_real_engine(request, progress, cancel)
        copies.append(weakref.ref(engine.text.file.writable))
        return engine

    window = make_window(loader=loader, load=False)
    window.apply_settings(replace(window.prefs, model_path=str(synth_model("tiny", "q8_0")), context=512,
                                  weights="ram", device="cpu"))
    qtbot.waitUntil(lambda: window.model is not None)
    window.load_model("m.gguf")
    qtbot.waitUntil(lambda: window.loading is None and "loaded again" in window.statusBar().currentMessage())
    assert freed == [True]           # not held by a reference cycle until some later collection


def test_an_unreachable_server_leaves_the_local_model_and_the_settings(qtbot, make_window, synth_model):
    good = synth_model("tiny", "q8_0")
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, model_path=str(good), context=512, max_tokens=3, temperature=0.0))
    qtbot.waitUntil(lambda: window.model is not None)
    url = _closed_port_url()
    window.apply_settings(replace(window.prefs, remote_url=url, remote_model="tiny"))
    message = _failed(qtbot, window, f"cannot reach {url}/models")
    assert message.startswith(f"Still using {good.name}. Could not open tiny at {url}")
    assert window.model.info.path == good and window.prefs.remote_url == "" and window.prefs.model_path == str(good)
    assert _send(qtbot, window, "Say hello.").stats["generated_tokens"] == 3


def test_a_truncated_gguf_leaves_the_remote_engine_answering(qtbot, make_window, served, tmp_path):
    _engine, _lock, server = served
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, remote_url=server.url, remote_model="tiny", max_tokens=3))
    qtbot.waitUntil(lambda: window.model is not None)
    banner = window.banner.text()
    window.load_model(str(truncated))
    assert "Still using tiny" in _failed(qtbot, window, "Could not open cut.gguf")
    assert window.banner.text() == banner and window.prefs.remote_url == server.url
    assert _send(qtbot, window, "Say hello.").stats["generated_tokens"] == 3


@pytest.mark.parametrize("held", [dict(device="cuda", vram_budget=6 * 2**30), dict(weights="ram")])
def test_a_model_holding_the_gpu_is_closed_first_and_loaded_again_after_a_failed_switch(qtbot, make_window, held):
    """Also a model read into memory (weights "ram"): a second copy beside it could exhaust the memory, and "auto"
    would measure the memory without it (and map the new one)."""
    from engine.errors import EngineError
    from fake_engine import FakeEngine, fake_info
    engine = FakeEngine(info=fake_info(**held))
    asked = []

    def loader(request, progress, cancel):
        asked.append((request.model_path, engine.closed))
        if request.model_path == "m.gguf":
            raise EngineError("m.gguf: wrong magic b'GGUX', expected b'GGUF'")
        return engine

    window = make_window(loader=loader)
    window.load_model("m.gguf")
    qtbot.waitUntil(lambda: window.loading is None and "loaded again" in window.statusBar().currentMessage())
    assert asked == [(None, 0), ("m.gguf", 1), (None, 1)]     # closed before the new load, then loaded again
    assert window.statusBar().currentMessage().startswith("Still using fake-model.gguf (loaded again). "
                                                          "Could not open m.gguf: m.gguf: wrong magic")
    assert window.model is not None and window.composer.send_button.isEnabled()


def test_a_reload_while_an_answer_streams_closes_the_model_read_into_memory_after_the_turn(qtbot, make_window):
    from fake_engine import FakeEngine, fake_info
    engine = FakeEngine(tokens=["a", "b", "c", "d"], info=fake_info(weights="ram"))
    engine.hold(after=2)
    window = make_window(engine)
    window.composer.editor.setPlainText("q")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: engine.produced >= 2 and window.controller.live is not None)
    window.apply_settings(replace(window.prefs, context=2048))        # stops the answer, closes, loads again
    qtbot.waitUntil(lambda: window.model is not None and window.loading is None and engine.closed == 1)
    assert engine.loads[-1].context == 2048 and not window.controller.busy
    assert "Now using" in window.statusBar().currentMessage()
