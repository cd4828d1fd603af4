"""The model browser (app/model_browser.py) on a fake hub (tests/hub_fake.py, loopback only): search, fit
marks, a live listing with header fits, download with progress in the dialog and the status bar, cancel,
resume, open, delete; and the window's entry points (menu, the first-run button)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.model_browser import ModelBrowser  # noqa: E402
from engine import hub  # noqa: E402
from tests.hub_fake import FakeHub, FakeRepo  # noqa: E402

REPO = "tester/Tiny-GGUF"


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory) -> dict[str, bytes]:
    from engine.testing.synth import synth
    from engine.testing.pairs import synth_mmproj_for
    d = tmp_path_factory.mktemp("synth")
    synth(d / "t.gguf", "tiny", quant="q8_0", seed=2)
    synth_mmproj_for(d / "t-mmproj.gguf", "tiny", seed=2)
    return {"Tiny-Q8_0.gguf": (d / "t.gguf").read_bytes(), "mmproj-F16.gguf": (d / "t-mmproj.gguf").read_bytes()}


@pytest.fixture
def fake(synth_pair, tmp_path, monkeypatch):
    server = FakeHub(repos={REPO: FakeRepo(dict(synth_pair))}).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("DELTADESK_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    yield server
    server.close()


def _browser(qtbot, ram_gib: int = 24, **kw) -> ModelBrowser:
    b = ModelBrowser(machine=hub.Machine(ram_gib << 30, 20.0), context=4096, **kw)
    qtbot.addWidget(b)
    b.show()
    return b


def _cell(b: ModelBrowser, row, col: int) -> str:
    return b.table.item(b.rows.index(row), col).text()


def test_search_filters_the_catalogue_and_marks_fits(qtbot, fake):
    b = _browser(qtbot)
    b.search.setText("35B-A3B ggml-org")
    (row,) = b.visible_rows()
    assert row.file.name == "Qwen3.6-35B-A3B-Q4_K_M.gguf"
    assert "fits (size)" in _cell(b, row, 3) and "tok/s" in _cell(b, row, 5)
    small = _browser(qtbot, ram_gib=16)
    small.search.setText("35B-A3B ggml-org")
    assert "does not fit" in _cell(small, small.visible_rows()[0], 3)
    b.search.setText("MiniCPM")
    assert {r.file.repo for r in b.visible_rows()} == {"openbmb/MiniCPM-V-4.6-gguf"}
    b.search.setText("Qwen3.6-35B-A3B")      # UD-Q4_K_M (22.1 GB) is tight on 24 GiB, Q4_K_M (20.4 GB) fits
    starred = [r for r in b.visible_rows() if "recommended" in _cell(b, r, 3)]
    assert [r.file.name for r in starred] == ["Qwen3.6-35B-A3B-Q4_K_M.gguf"]


def test_typed_repo_is_listed_live_with_header_fits(qtbot, fake):
    b = _browser(qtbot)
    b.search.setText(REPO)
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    (row,) = [r for r in b.rows if r.file.repo == REPO]
    assert row.basis == "header" and row.fit.verdict == "fits"
    assert "fits (header)" in _cell(b, row, 3) and "recommended" in _cell(b, row, 3)
    assert all(rng.startswith("bytes=") for m, p, rng, _ in fake.requests if p.startswith("/blob/"))


def test_unknown_repo_is_reported_not_raised(qtbot, fake):
    b = _browser(qtbot)
    seen = []
    b.status.connect(seen.append)
    b.search.setText("tester/Missing-GGUF")
    with qtbot.waitSignal(b.bridge.failed):
        b.search.returnPressed.emit()
    assert "no such repository" in seen[-1] and "no such repository" in b.progress_label.text()


def test_download_progress_cancel_resume_open_and_delete(qtbot, fake, monkeypatch, tmp_path):
    fake.delay = 0.003
    b = _browser(qtbot, snapshot_dir=tmp_path / "snapshots")
    status = []
    b.status.connect(status.append)
    b.search.setText(REPO)
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    row = next(r for r in b.rows if r.file.repo == REPO)
    b.select(row)
    assert b.download_button.isEnabled()
    got_bytes = threading.Event()
    b.bridge.progress.connect(lambda p: p.done > 4 << 20 and got_bytes.set())
    b.download_button.click()
    qtbot.waitUntil(got_bytes.is_set)
    assert b.cancel_button.isEnabled() and not b.download_button.isEnabled()
    with qtbot.waitSignal(b.bridge.failed):
        b.cancel_button.click()
    assert "cancelled" in b.progress_label.text() and "resumes" in status[-1]
    assert any(s.startswith("Downloading Tiny-Q8_0.gguf:") and "MiB/s" in s for s in status)
    fake.delay = 0.0
    fake.requests.clear()
    with qtbot.waitSignal(b.bridge.done):
        b.download_button.click()
    resumed = [rng for m, p, rng, _ in fake.requests if m == "GET" and p.startswith("/blob/")]
    assert any(rng.startswith("bytes=") and not rng.startswith("bytes=0-") for rng in resumed)
    assert b.progress.value() == b.progress.maximum() and "sha256 verified" in status[-1]
    assert b.downloaded.rowCount() == 1 and b.downloaded.item(0, 0).text() == f"{REPO}:Q8_0"
    assert b.downloaded.item(0, 3).text() == "never" and b.downloaded.item(0, 4).text() == "mmproj-F16.gguf"
    with qtbot.waitSignal(b.open_requested) as opened:
        b.open_button.click()
    path, mmproj = opened.args
    assert Path(path).read_bytes()[:4] == b"GGUF" and Path(mmproj).name == "mmproj-F16.gguf"
    again = _browser(qtbot, snapshot_dir=tmp_path / "snapshots")
    assert again.downloaded.item(0, 3).text() != "never"
    again.downloaded.selectRow(0)
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.Yes)
    with qtbot.waitSignal(again.bridge.deleted):
        again.delete_button.click()
    assert again.downloaded.rowCount() == 0 and not Path(path).exists() and not Path(mmproj).exists()


def test_a_browser_let_go_during_a_hub_call_is_deleted_on_the_gui_thread(qtbot, fake, monkeypatch):
    """The hub thread holds the bridge, not the dialog: when the last reference to the dialog goes while a
    listing runs, the dialog and (once the listing has ended) its bridge are deleted on the GUI thread,
    never by the hub thread as it ends (a widget deleted off the GUI thread crashes the app)."""
    started, gate, real_list = threading.Event(), threading.Event(), hub.list_repo

    def slow_list(repo):
        started.set()
        gate.wait(30)
        return real_list(repo)

    monkeypatch.setattr(hub, "list_repo", slow_list)
    deleted = []
    b = _browser(qtbot)
    for obj, what in ((b, "dialog"), (b.bridge, "bridge")):
        obj.destroyed.connect(lambda *_, what=what: deleted.append((what, threading.current_thread().name)),
                              Qt.DirectConnection)
    b.list_repo(REPO)
    assert started.wait(30)
    del b
    gate.set()
    qtbot.waitUntil(lambda: len(deleted) == 2)
    assert deleted == [("dialog", threading.main_thread().name), ("bridge", threading.main_thread().name)]


def test_window_menu_and_first_run_button_open_the_browser(qtbot, make_window, fake, monkeypatch):
    """On the default (demo) model the banner offers "Get a real model"; it and the Chat menu's "Get models"
    open the browser, whose lines reach the status bar and whose Open loads the file in the window."""
    monkeypatch.setattr(hub, "this_machine", lambda vram_budget=None: hub.Machine(24 << 30, 20.0))
    window = make_window()
    assert window.models_button.isVisible()
    window.models_button.click()
    browser = window.model_browser
    assert browser.isVisible() and browser.context == window.prefs.context
    browser.status.emit("hello from the browser")
    assert window.statusBar().currentMessage() == "hello from the browser"
    browser.close()
    (menu_action,) = [a for a in window.menuBar().actions()[0].menu().actions() if a.text() == "&Get models\u2026"]
    menu_action.trigger()
    assert window.model_browser is not browser and window.model_browser.isVisible()
    window.model_browser.open_requested.emit("/models/x.gguf", "")
    qtbot.waitUntil(lambda: window.prefs.model_path == "/models/x.gguf")
    assert not window.models_button.isVisible()


def test_app_command_line_takes_a_downloaded_repo_quant(tmp_path, monkeypatch):
    from app.__main__ import model_arg
    from engine.errors import EngineError
    monkeypatch.setenv("DELTADESK_MODELS_DIR", str(tmp_path / "models"))
    store = hub.ModelStore()
    entry = hub.Downloaded(REPO, "Tiny-Q8_0.gguf", "Q8_0", 4, "ab" * 32, "c" * 40, "mmproj-F16.gguf")
    for name in (entry.file, entry.mmproj):
        store.path(REPO, name).parent.mkdir(parents=True, exist_ok=True)
        store.path(REPO, name).write_bytes(b"GGUF")
    store.add(entry)
    assert model_arg(f"{REPO}:q8_0", None) == (str(store.path(REPO, entry.file)), str(store.path(REPO, entry.mmproj)))
    assert model_arg(f"{REPO}:Q8_0", "/x/tower.gguf")[1] == "/x/tower.gguf"
    assert model_arg("/some/file.gguf", None) == ("/some/file.gguf", None)
    with pytest.raises(EngineError,
                       match="not downloaded.*fetch it with `python -m engine pull tester/Tiny-GGUF --quant Q4_0`"):
        model_arg(f"{REPO}:Q4_0", None)


def test_token_goes_to_the_keyring_and_opens_a_gated_repo(qtbot, fake, monkeypatch):
    import keyring
    from keyring.backend import KeyringBackend

    class Memory(KeyringBackend):
        priority = 1
        store: dict = {}

        def get_password(self, service, user):
            return self.store.get((service, user))

        def set_password(self, service, user, password):
            self.store[(service, user)] = password

        def delete_password(self, service, user):
            self.store.pop((service, user), None)

    monkeypatch.setattr(keyring, "get_keyring", lambda: Memory())
    monkeypatch.setattr(keyring, "get_password", Memory().get_password)
    monkeypatch.setattr(keyring, "set_password", Memory().set_password)
    fake.tokens.add("hf_secret")
    fake.repos[REPO].gated = True
    b = _browser(qtbot)
    b.search.setText(REPO)
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    assert not any(r.fit for r in b.rows if r.file.repo == REPO)       # gated: no header without a token
    b.token.setText("hf_secret")
    b.save_token_button.click()
    assert Memory.store[(hub.KEYRING_SERVICE, hub.KEYRING_USER)] == "hf_secret" and b.token.text() == ""
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    assert [r.fit.verdict for r in b.rows if r.file.repo == REPO] == ["fits"]


@pytest.mark.slow
def test_first_run_to_a_downloaded_model_loaded_in_the_window(qtbot, make_window, fake, monkeypatch):
    """A new user's path: the demo-model window's "Get a real model", a typed repo listed with its fit, the
    download, Open: the real engine loads the downloaded file with its vision tower."""
    from app.engine_worker import load_real_engine
    monkeypatch.setattr(hub, "this_machine", lambda vram_budget=None: hub.Machine(24 << 30, 20.0))
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(None)
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    assert window.models_button.isVisible()
    window.models_button.click()
    b = window.model_browser
    b.search.setText(REPO)
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    b.select(next(r for r in b.rows if r.file.repo == REPO))
    with qtbot.waitSignal(b.bridge.done, timeout=60000):
        b.download_button.click()
    b.open_button.click()
    qtbot.waitUntil(lambda: window.model is not None and window.model.info.path.name == "Tiny-Q8_0.gguf",
                    timeout=60000)
    assert window.model.info.has_vision and not window.models_button.isVisible()
    assert window.prefs.model_path == str(hub.ModelStore().path(REPO, "Tiny-Q8_0.gguf"))     # next start opens it
