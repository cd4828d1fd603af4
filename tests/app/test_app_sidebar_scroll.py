"""The sidebar at the default window size: when its panels (GPU meters, per-layer and per-token timing,
a full snapshot list) are taller than the window, it scrolls inside its column and its last panel's
buttons come into view; nothing is squeezed below its own size to fit. The snapshot list gives up its
room before the column scrolls."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("size", [DEFAULT_SIZE, (1280, 800), (1024, 640)])
def test_after_an_answer_the_snapshot_buttons_show_without_scrolling(qtbot, make_window, size):
    window = make_window(FakeEngine())
    window.resize(*size)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    window.snapshots.set_snapshots([SnapshotInfo(f"{i:04x}", "1", 64 * (i + 1), 1 << 20, 5.0, 0, "ram")
                                    for i in range(8)])
    sidebar, panel = window.sidebar, window.sidebar.snapshots
    qtbot.waitUntil(lambda: panel.clear_button.isEnabled() and panel.view.isVisible())
    layout = sidebar.layout()
    qtbot.waitUntil(lambda: sidebar.height() >= layout.totalHeightForWidth(sidebar.width()), timeout=5000)
    assert (window.width(), window.height()) == size
    area = _scroll_area(sidebar)
    viewport, bar = area.viewport(), area.verticalScrollBar()
    view = panel.view
    assert view.height() >= view.minimumHeight()
    least = layout.totalHeightForWidth(sidebar.width()) - view.sizeHint().height() + view.minimumHeight()
    fits = least <= viewport.height()                   # the column, its snapshot list at its minimum height
    assert fits or size == (1024, 640)                  # from the default size up it fits
    if fits:
        assert bar.maximum() == 0, f"the sidebar scrolls by {bar.maximum()} px while its list could shrink"
        assert _inside(panel.remove_button, viewport) and _inside(panel.clear_button, viewport)
    else:
        area.ensureWidgetVisible(panel.clear_button, 0, 0)
        qtbot.waitUntil(lambda: _inside(panel.clear_button, viewport) and _inside(panel.remove_button, viewport))
