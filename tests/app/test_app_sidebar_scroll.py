"""The sidebar at the default window size: when its panels (GPU meters, per-layer and per-token timing,
a full snapshot list) are taller than the window, it scrolls inside its column and its last panel's
buttons come into view; nothing is squeezed below its own size to fit."""

from __future__ import annotations

from PySide6.QtWidgets import QScrollArea

from engine.api import SnapshotInfo
from fake_engine import FakeEngine
from test_app_gpu import GPU_INFO, FakeGpu, send, telemetry

DEFAULT_SIZE = (1180, 760)
"""The window's size on a first start (``MainWindow.restore_state`` without a saved geometry)."""


def _inside(widget, viewport) -> bool:
    """Whether ``widget``'s whole rectangle lies inside ``viewport`` (both on screen)."""
    top_left = widget.mapTo(viewport, widget.rect().topLeft())
    bottom_right = widget.mapTo(viewport, widget.rect().bottomRight())
    return viewport.rect().contains(top_left) and viewport.rect().contains(bottom_right)


def _scroll_area(widget) -> QScrollArea:
    """The scroll area ``widget`` is shown in."""
    parent = widget.parentWidget()
    while parent is not None and not isinstance(parent, QScrollArea):
        parent = parent.parentWidget()
    assert parent is not None, f"{type(widget).__name__} is not inside a scroll area"
    return parent


def test_a_tall_sidebar_scrolls_to_its_last_panel(qtbot, make_window):
    engine = FakeEngine(info=GPU_INFO)
    window = make_window(engine, gpu=FakeGpu())
    assert (window.width(), window.height()) == DEFAULT_SIZE
    engine.gpu_telemetry = telemetry()
    send(qtbot, window, "read this long prompt")
    sidebar = window.sidebar
    qtbot.waitUntil(lambda: sidebar.layers.isVisible())
    window.snapshots.set_snapshots([SnapshotInfo(f"{i:04x}", "1", 64 * (i + 1), 1 << 20, 5.0, 0, "ram")
                                    for i in range(40)])
    buttons = sidebar.snapshots.clear_button
    qtbot.waitUntil(lambda: buttons.isEnabled())
    layout = sidebar.layout()
    qtbot.waitUntil(lambda: sidebar.height() >= layout.totalHeightForWidth(sidebar.width()), timeout=5000)
    panels = [layout.itemAt(i).widget() for i in range(layout.count())]
    for panel in (p for p in panels if p is not None and p.isVisibleTo(sidebar)):
        want = panel.heightForWidth(panel.width()) if panel.hasHeightForWidth() else panel.minimumSizeHint().height()
        assert panel.height() >= want, f"{type(panel).__name__} squeezed to {panel.height()} px (needs {want})"
    assert (window.width(), window.height()) == DEFAULT_SIZE   # the window did not grow past the screen to fit
    area = _scroll_area(sidebar)
    viewport, bar = area.viewport(), area.verticalScrollBar()
    assert sidebar.height() > viewport.height() and bar.maximum() > 0
    assert not _inside(buttons, viewport)                   # the column starts at the top: Machine, GPU
    bar.setValue(bar.maximum())
    qtbot.waitUntil(lambda: _inside(buttons, viewport) and _inside(sidebar.snapshots.remove_button, viewport))
