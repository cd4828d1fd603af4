"""End to end: the window on the real engine with the tiny synthetic model (random weights)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app.engine_worker import load_real_engine
from app.history import HistoryStore
from app_helpers import stored


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    synth = pytest.importorskip("engine.synth")
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    synth.synth(path, "tiny", quant="q8_0", seed=0)
    return path


@pytest.mark.slow
def test_default_model_streams_stops_and_keeps_its_snapshots(qtbot, make_window, tiny_model, monkeypatch, paths):
    from engine import api

    monkeypatch.setattr(api, "default_model", lambda: (tiny_model, None))
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(None)
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    assert window.model.line.startswith("tiny.gguf: qwen35moe") and "text only" in window.model.line
    window.composer.editor.setPlainText("Hello")
    with qtbot.waitSignal(window.controller.busy_changed, timeout=60000, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.controller.live is not None and len(window.controller.live.text) > 0,
                        timeout=60000)
        qtbot.keyClick(window, Qt.Key_Escape)
    answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1]
    assert answer.state == "stopped" and answer.content
    assert answer.stats["generated_tokens"] >= 1 and answer.stats["prompt_tokens"] > 5
    qtbot.waitUntil(lambda: window.snapshots.rowCount() > 0, timeout=10000)
    # the snapshot names the conversation it was taken in, shown by its title
    assert "\u201cHello\u201d" in window.snapshots.index(0).data(Qt.ToolTipRole)
    window.close()
    assert list((paths.cache / "snapshots").rglob("*.snap"))


def test_a_bad_model_file_is_reported_in_plain_words(qtbot, make_window, tmp_path):
    pytest.importorskip("engine.api")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUX" + bytes(64))
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(str(bad))
    qtbot.waitUntil(lambda: "could not be loaded" in window.banner.text(), timeout=30000)
    assert "broken.gguf" in window.banner.text() and "Traceback" not in window.banner.text()
