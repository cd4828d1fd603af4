"""Images and figures in remote mode: a server that says it has a vision tower takes new images (sized by the
server), one that does not is refused up front with the reason, and the figures of a turn say what the server
did not report instead of showing zeros."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QImage

from app.engine_worker import load_real_engine
from app.history import HistoryStore
from app_helpers import settle, stored
from engine.openai.remote import RemoteEngine
from http_fakes import ScriptServer, delta, paced, sse_head


def _png(tmp_path, name="pic.png", color="red"):
    image = QImage(48, 40, QImage.Format_RGB32)
    image.fill(QColor(color))
    path = tmp_path / name
    image.save(str(path))
    return path


def _path(window):
    return stored(window.history, HistoryStore.active_path, window.controller.conversation_id)


def _connect(qtbot, make_window, url: str, model: str):
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, remote_url=url, remote_model=model, max_tokens=4, temperature=0.0))
    qtbot.waitUntil(lambda: window.model is not None)
    return window


def _attach(qtbot, window, path) -> None:
    window.composer.add_file(path)
    qtbot.waitUntil(lambda: len(window.composer.thumbnails()) == 1
                    and window.composer.thumbnails()[0].model_size.isVisible())


def test_a_deltadesk_peer_with_a_vision_tower_takes_a_new_image(qtbot, make_window, served_vision, tmp_path):
    server, engine = served_vision
    window = _connect(qtbot, make_window, server.url, "tiny-vl")
    assert window.banner.text().startswith(f"tiny-vl on {server.url} (remote engine) \u00b7 text and images")
    image = _png(tmp_path)
    _attach(qtbot, window, image)
    thumb = window.composer.thumbnails()[0]
    assert thumb.model_size.text() == "the server decides its size and token cost" and not thumb.unreadable
    assert not window.composer.warning.isVisible()
    window.composer.editor.setPlainText("What colour is it?")
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: _path(window)[-1].state == "complete")
    question, answer = _path(window)[-2:]
    assert len(question.images) == 1 and answer.stats["generated_tokens"] == 4
    assert answer.stats["prompt_tokens"] > engine.image_info(image).tokens   # the image reached the server's model


def test_a_server_that_does_not_say_it_reads_images_refuses_them_up_front(qtbot, make_window, served, tmp_path):
    _engine, _lock, server = served
    window = _connect(qtbot, make_window, server.url, "tiny")
    assert " \u00b7 text only \u00b7 " in window.banner.text()
    _attach(qtbot, window, _png(tmp_path))
    thumb = window.composer.thumbnails()[0]
    assert thumb.model_size.text() == "model cannot read it"
    assert "does not say that tiny reads images" in window.composer.warning.text()
    assert "--mmproj" in window.composer.warning.text()
    window.composer.editor.setPlainText("What is it?")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    settle(qtbot, window.history)
    assert _path(window) == [] and window.composer.editor.toPlainText() == "What is it?"


def test_stop_without_usage_says_the_server_did_not_report_the_counts(qtbot, make_window):
    raw = ScriptServer(paced([sse_head()] + [delta("a")] * 100))     # 0.2 s apart: a token batch each
    try:
        window = make_window(loader=lambda request, progress, cancel: RemoteEngine(raw.url, "m", timeout=30,
                                                                                     context=2048))
        window.composer.editor.setPlainText("Hi")
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.sidebar.context_bar.parts[2] >= 2)
        assert window.sidebar.context_bar.legend()[:-1] == []                  # no "prefilled 0" while streaming
        with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
            window.controller.stop()
        qtbot.waitUntil(lambda: _path(window)[-1].state == "stopped")
        answer = _path(window)[-1]
        label = window.chat_view.widget_for(answer.id).stats_label.text()
        assert "prompt tokens not reported by the server" in label and " of 0 " not in label
        assert "prompt tokens not reported by the server" in window.sidebar.last_turn.text()
        assert window.sidebar.context_bar.legend() == [f"generated {answer.stats['generated_tokens']}"]
    finally:
        raw.close()


def test_a_remote_cache_hit_has_no_restore_time_and_the_snapshots_are_the_servers(qtbot, make_window, served):
    engine, lock, server = served
    window = _connect(qtbot, make_window, server.url, "tiny")
    assert "The server keeps its own prefix snapshots" in window.sidebar.snapshots.summary.text()
    with lock:
        engine.clear_snapshots()
    for _ in range(2):
        window.composer.editor.setPlainText("Say hello.") if not _path(window) else None
        with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
            if _path(window):
                window.controller.regenerate(_path(window)[-1].id)
            else:
                qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: _path(window)[-1].state == "complete")
    answer = _path(window)[-1]
    assert answer.stats["reused_tokens"] == answer.stats["prompt_tokens"] > 0 and "restore_ms" not in answer.stats
    label = window.chat_view.widget_for(answer.id).stats_label.text()
    assert f"{answer.stats['prompt_tokens']} of {answer.stats['prompt_tokens']} prompt tokens reused" in label
    assert "restored in" not in label
