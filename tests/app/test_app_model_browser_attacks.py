"""The model browser (app/model_browser.py) under load and misuse, on the fake hub (loopback only): the first
open measures the machine off the GUI thread, a failed listing leaves a download under way cancellable,
and closing the browser with Esc stops its download."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.model_browser import ModelBrowser
from engine import hub
from tests.app import test_app_model_browser as base

REPO = base.REPO
synth_pair, fake = base.synth_pair, base.fake      # the fake hub serving the synth pair, as fixtures


def test_first_open_measures_the_machine_off_the_gui_thread(qtbot, fake, monkeypatch):
    threads, measured, finish = [], threading.Event(), threading.Event()

    def slow_machine(vram_budget=None):
        threads.append(threading.current_thread())
        finish.wait(30)                                 # the stream-bandwidth measurement of a first open
        measured.set()
        return hub.Machine(24 << 30, 20.0)
    monkeypatch.setattr(hub, "this_machine", slow_machine)
    b = ModelBrowser(context=4096)
    qtbot.addWidget(b)
    b.show()
    assert not measured.is_set()                        # the dialog is up while the measurement runs
    b.search.setText("35B-A3B ggml-org")
    (row,) = b.visible_rows()
    assert b.table.item(b.rows.index(row), 3).text() == "measuring\u2026" and "measuring" in b.machine_line.text()
    finish.set()
    qtbot.waitUntil(lambda: "fits (size)" in b.table.item(b.rows.index(row), 3).text())
    assert threads and threading.main_thread() not in threads
    assert "24.0 GiB RAM, stream read 20.0 GB/s" in b.machine_line.text()


def _downloading(qtbot, b: ModelBrowser) -> None:
    """List REPO, select its file and start a (slowed) download; return once bytes arrive."""
    b.search.setText(REPO)
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    b.select(next(r for r in b.rows if r.file.repo == REPO))
    got = threading.Event()
    b.bridge.progress.connect(lambda p: p.done > 2 << 20 and got.set())
    b.download_button.click()
    qtbot.waitUntil(got.is_set)


def test_failed_listing_leaves_the_download_cancellable(qtbot, fake):
    fake.delay = 0.003
    b = base._browser(qtbot)
    _downloading(qtbot, b)
    b.search.setText("tester/Missing-GGUF")
    with qtbot.waitSignal(b.bridge.failed):
        b.search.returnPressed.emit()
    assert "no such repository" in b.progress_label.text()
    assert b.cancel_button.isEnabled() and not b.download_button.isEnabled()
    with qtbot.waitSignal(b.bridge.failed) as failed:
        b.cancel_button.click()
    assert "cancelled" in failed.args[0]


def test_escape_stops_the_download(qtbot, fake):
    fake.delay = 0.003
    b = base._browser(qtbot)
    _downloading(qtbot, b)
    ended = []
    b.bridge.done.connect(lambda e: ended.append("done"))
    b.bridge.failed.connect(lambda m, *rest: ended.append(m))
    b.reject()                                          # what Esc does
    qtbot.waitUntil(lambda: bool(ended))
    assert "cancelled" in ended[0] and hub.ModelStore().models() == []


def test_a_file_whose_header_is_refused_is_marked_and_not_downloadable(qtbot, fake, synth_pair):
    data = synth_pair["Tiny-Q8_0.gguf"]
    at = data.index(b"qwen35moe", data.index(b"general.architecture"))
    fake.repos["tester/Llama-GGUF"] = base.FakeRepo({"Llama-Q8_0.gguf": data[:at] + b"llama_moe" + data[at + 9:]})
    b = base._browser(qtbot)
    b.search.setText("tester/Llama-GGUF")
    with qtbot.waitSignal(b.bridge.listed):
        b.search.returnPressed.emit()
    (row,) = [r for r in b.rows if r.file.repo == "tester/Llama-GGUF"]
    cell = b.table.item(b.rows.index(row), 3)
    assert cell.text() == "\u2716 cannot be used" and "llama_moe" in cell.toolTip()
    b.select(row)
    assert not b.download_button.isEnabled() and b.check_button.isEnabled()


def test_delete_opens_the_file_off_the_gui_thread(qtbot, fake, monkeypatch):
    """Deleting opens the model file for its snapshot folder (an ~11 MB header for a real model, ~0.7 s
    here): that runs on a thread, and the list follows when it is done."""
    from PySide6.QtWidgets import QMessageBox
    store = hub.ModelStore()
    entry = hub.Downloaded(REPO, "Tiny-Q8_0.gguf", "Q8_0", 4, "ab" * 32, "c" * 40)
    store.path(REPO, entry.file).parent.mkdir(parents=True)
    store.path(REPO, entry.file).write_bytes(b"GGUF")
    store.add(entry)
    threads = []
    real = hub.delete_model
    monkeypatch.setattr(hub, "delete_model", lambda *a: threads.append(threading.current_thread()) or real(*a))
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.Yes)
    b = base._browser(qtbot)
    b.downloaded.selectRow(0)
    with qtbot.waitSignal(b.bridge.deleted):
        b.delete_button.click()
    assert threads and threading.main_thread() not in threads
    assert b.downloaded.rowCount() == 0 and store.models() == []
