"""The app on a remote engine (another DeltaDesk's ``engine serve`` on loopback), the app's own "Serve on
localhost", and the API key kept out of the settings file."""

from __future__ import annotations

import socket
from dataclasses import replace

import openai
import pytest
from PySide6.QtCore import QSettings, Qt

from app.connections import KeyStore
from app.engine_worker import load_real_engine
from app.history import HistoryStore
from app.settings import Settings
from app.settings_dialog import SettingsDialog
from app_helpers import stored
from engine.events import TurnSummary
from engine.openai.remote import RemoteEngine
from engine.sampling import SamplingParams
from http_fakes import RawServer, delta, sse_head


def _send(qtbot, window, text: str) -> None:
    window.composer.editor.setPlainText(text)
    with qtbot.waitSignal(window.controller.busy_changed, timeout=60000, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)


def _answers(window):
    return [m for m in stored(window.history, HistoryStore.active_path, window.controller.conversation_id)
            if m.role == "assistant"]


def test_the_window_chats_with_a_remote_engine(qtbot, make_window, served) -> None:
    engine, lock, server = served
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, remote_url=server.url, remote_model="tiny", max_tokens=6,
                                  temperature=0.0))
    qtbot.waitUntil(lambda: window.model is not None, timeout=30000)
    assert window.banner.text() == f"tiny on {server.url} (remote engine) \u00b7 text only \u00b7 runs on the server"
    qtbot.waitUntil(lambda: window.sidebar.gpu_label.text() == "Remote engine")
    assert "are the server's" in window.sidebar.gpu_note.text()
    engine.clear_snapshots()
    _send(qtbot, window, "Say hello.")
    with lock:
        want = [e for e in engine.chat([{"role": "user", "content": "Say hello."}], SamplingParams.greedy(6))
                if isinstance(e, TurnSummary)][-1]
    qtbot.waitUntil(lambda: _answers(window)[-1].state == "complete")   # stored on the history thread
    first = _answers(window)[-1]
    assert first.content == want.text.lstrip()
    assert first.stats["prompt_tokens"] == want.prompt_tokens and first.stats["generated_tokens"] == 6
    with qtbot.waitSignal(window.controller.busy_changed, timeout=60000, check_params_cb=lambda busy: not busy):
        assert window.controller.regenerate(first.id)          # the same prompt: resumed whole on the server
    qtbot.waitUntil(lambda: _answers(window)[-1].id != first.id and _answers(window)[-1].state == "complete")
    again = _answers(window)[-1]
    assert again.id != first.id
    assert again.content == first.content and again.stats["reused_tokens"] == want.prompt_tokens
    cached = f"{want.prompt_tokens} of {want.prompt_tokens} prompt tokens cached on the server"
    qtbot.waitUntil(lambda: cached in window.sidebar.last_turn.text(), timeout=10000)   # the sidebar updates after


def test_a_server_dropping_mid_answer_keeps_the_partial_answer(qtbot, make_window) -> None:
    raw = RawServer(sse_head() + delta("Hel") + delta("lo"))
    try:
        window = make_window(loader=lambda request, progress, cancel: RemoteEngine(raw.url, "m", timeout=30))
        _send(qtbot, window, "Hi")
        answer = _answers(window)[-1]
        assert answer.state == "error" and answer.content == "Hello"
        assert "partial answer is kept" in answer.stats["message"]
        assert "partial answer is kept" in window.chat_view.widget_for(answer.id).stats_label.text()
    finally:
        raw.close()


def test_an_unreachable_server_is_a_message_in_the_banner(qtbot, make_window) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, remote_url=url, remote_model="tiny"))
    qtbot.waitUntil(lambda: "could not be loaded" in window.banner.text(), timeout=30000)
    assert f"cannot reach {url}/models" in window.banner.text()


def test_serve_on_localhost_shares_the_loaded_engine_and_its_snapshots(qtbot, make_window, synth_model,
                                                                       monkeypatch) -> None:
    from engine import api
    monkeypatch.setattr(api, "default_model", lambda: (synth_model("tiny", "q8_0"), None))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    window = make_window(loader=load_real_engine, load=False)
    window.apply_settings(replace(window.prefs, max_tokens=4, temperature=0.0), reload=False)
    window.load_configured()
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    window.apply_settings(replace(window.prefs, serve_local=True, serve_port=port))
    url = f"http://127.0.0.1:{port}/v1"
    qtbot.waitUntil(lambda: window.serve_status.text().endswith(url))
    _send(qtbot, window, "Name a colour.")
    answer = _answers(window)[-1]
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                         max_tokens=4, temperature=0)
    assert got.choices[0].message.content == answer.content.lstrip()
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens   # the app's snapshot
    remote = RemoteEngine.connect(url, model)                           # a second DeltaDesk would connect like this
    summary = [e for e in remote.chat([{"role": "user", "content": "Name a colour."}], SamplingParams.greedy(4))][-1]
    assert summary.text == answer.content.lstrip()
    remote.close()
    window.apply_settings(replace(window.prefs, serve_local=False))
    qtbot.waitUntil(lambda: window.serve_status.text() == "")
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


class _MemoryKeyring:
    def __init__(self) -> None:
        self.stored: dict[tuple[str, str], str] = {}

    def get_password(self, service, user):
        return self.stored.get((service, user))

    def set_password(self, service, user, password):
        self.stored[(service, user)] = password

    def delete_password(self, service, user):
        del self.stored[(service, user)]


class _NoKeyring:
    def _fail(self, *args):
        from keyring.errors import NoKeyringError
        raise NoKeyringError("No recommended backend was available.")

    get_password = set_password = delete_password = _fail


def test_the_api_key_goes_to_the_keyring_not_the_settings_file(qtbot, tmp_path) -> None:
    ring = _MemoryKeyring()
    keys = KeyStore(ring)
    dialog = SettingsDialog(Settings(), keys=keys)
    qtbot.addWidget(dialog)
    tab = dialog.connections
    tab.url.setText("http://gpu-box:8000/v1")
    tab.model.setEditText("Qwen3.6-35B-A3B")
    tab.key.setText("sk-very-secret")
    tab.serve.setChecked(True)
    tab.port.setValue(9090)
    dialog.accept()
    settings = dialog.settings()
    assert (settings.remote_url, settings.remote_model, settings.serve_local, settings.serve_port) == (
        "http://gpu-box:8000/v1", "Qwen3.6-35B-A3B", True, 9090)
    ini = tmp_path / "s.ini"
    settings.write(QSettings(str(ini), QSettings.IniFormat))
    assert "sk-very-secret" not in ini.read_text() and "gpu-box" in ini.read_text()
    assert keys.get("http://gpu-box:8000/v1") == "sk-very-secret" and keys.note == ""
    assert Settings.read(QSettings(str(ini), QSettings.IniFormat)) == settings
    reopened = SettingsDialog(settings, keys=keys)
    qtbot.addWidget(reopened)
    assert reopened.connections.key.text() == "sk-very-secret"
    keys.set("http://gpu-box:8000/v1", "")
    assert ring.stored == {}


def test_without_a_keyring_the_key_lives_for_the_session_with_a_message(qtbot) -> None:
    keys = KeyStore(_NoKeyring())
    keys.set("http://h/v1", "k1")
    assert keys.get("http://h/v1") == "k1" and "has no password store (keyring)" in keys.note
    dialog = SettingsDialog(Settings(remote_url="http://h/v1"), keys=keys)
    qtbot.addWidget(dialog)
    assert "has no password store" in dialog.connections.status.text() and dialog.connections.key.text() == "k1"
    assert "NoKeyringError" in dialog.connections.status.toolTip()


def test_list_models_fills_the_model_box(qtbot, served) -> None:
    dialog = SettingsDialog(Settings(), keys=KeyStore(_MemoryKeyring()))
    qtbot.addWidget(dialog)
    tab = dialog.connections
    tab.url.setText(served[2].url)
    tab.list_models()
    qtbot.waitUntil(lambda: tab.list_button.isEnabled())
    assert [tab.model.itemText(i) for i in range(tab.model.count())] == ["tiny"]
    tab.url.setText("http://127.0.0.1:9/v1")
    tab.list_models()
    qtbot.waitUntil(lambda: tab.list_button.isEnabled())
    assert "cannot reach" in tab.status.text()


def test_a_bad_port_in_the_settings_file_takes_the_default(tmp_path) -> None:
    ini = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    ini.setValue("preferences/serve_port", 70000)
    assert Settings.read(ini).serve_port == Settings().serve_port
