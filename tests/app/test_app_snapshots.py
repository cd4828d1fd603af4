"""The sidebar's prefix-snapshot list: its model, and listing, removing and clearing from the window."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.snapshots import SnapshotKeyRole, SnapshotListModel, human_age
from engine.api import SnapshotInfo
from fake_engine import FakeEngine


def _snap(key, pos, tier="ram", hits=0, conversation="3"):
    return SnapshotInfo(key=key, conversation=conversation, pos=pos, nbytes=pos * 1024, age_s=90.0, hits=hits,
                        tier=tier)


def test_model_passes_qtmodeltester_and_describes_each_snapshot(qtmodeltester):
    model = SnapshotListModel(lambda conversation: {"3": "Trip to Turin"}.get(conversation, ""))
    qtmodeltester.check(model, force_py=True)
    model.set_snapshots([_snap("aa", 2048, "disk", hits=1), _snap("bb", 512, conversation="9")])
    qtmodeltester.check(model, force_py=True)
    first, second = model.index(0), model.index(1)
    assert first.data() == "2048 tokens \u00b7 2.0 MB \u00b7 1 hit \u00b7 disk\nTrip to Turin \u00b7 1 min ago"
    assert second.data().startswith("512 tokens \u00b7 512.0 KB \u00b7 0 hits \u00b7 RAM\nchat 9 \u00b7 ")
    assert first.data(SnapshotKeyRole) == "aa" and "kept in disk" in first.data(Qt.ToolTipRole)
    assert model.total_bytes() == 2560 * 1024
    assert [human_age(s) for s in (5, 61, 7200, 200000)] == ["5 s", "1 min", "2 h", "2 d"]


def test_the_sidebar_lists_removes_and_clears_snapshots(qtbot, make_window):
    engine = FakeEngine()
    window = make_window(engine)
    panel = window.sidebar.snapshots
    assert panel.summary.text().startswith("No snapshots yet") and not panel.clear_button.isEnabled()
    for text in ("first question", "second question"):
        window.composer.editor.setPlainText(text)
        with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
            qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: window.snapshots.rowCount() == 2)
    assert panel.summary.text() == "2 snapshots, 5.7 MB"
    # deepest first (the second turn's prompt is the longer one), named by the conversation's title
    first, second = window.snapshots.index(0).data(), window.snapshots.index(1).data()
    assert first.startswith("40 tokens") and second.startswith("20 tokens") and "\nfirst question \u00b7 " in first
    assert not panel.remove_button.isEnabled()

    panel.view.setCurrentIndex(window.snapshots.index(1))
    assert panel.remove_button.isEnabled()
    removed = window.snapshots.index(1).data(SnapshotKeyRole)
    panel.remove_button.click()
    qtbot.waitUntil(lambda: window.snapshots.rowCount() == 1)
    assert removed not in [s.key for s in engine.snapshot_list]
    panel.clear_button.click()
    qtbot.waitUntil(lambda: window.snapshots.rowCount() == 0)
    assert engine.snapshot_list == [] and panel.view.isHidden()


def test_the_ages_are_drawn_again_as_time_passes(qtbot):
    model = SnapshotListModel()
    model.age_timer.setInterval(20)
    model.set_snapshots([_snap("aa", 64), _snap("bb", 32)])
    with qtbot.waitSignal(model.dataChanged) as changed:
        pass
    top, bottom = changed.args[:2]
    assert (top.row(), bottom.row()) == (0, 1) and Qt.DisplayRole in changed.args[2]
    model.set_snapshots([])
    assert not model.age_timer.isActive()
