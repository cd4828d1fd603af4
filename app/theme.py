"""Light and dark palettes that follow the desktop's colour scheme (Qt 6.5+ ``QStyleHints.colorScheme``).

Qt's Fusion style draws with one light palette whatever the desktop says; :func:`apply_scheme`
gives the application a dark palette when the scheme is dark and Fusion's light one when it is
light, and leaves the platform's palette alone when the platform does not say (``Unknown``).
The dark colours are those of a common Fusion dark palette (window #353535, base #2a2a2a, text
white, highlight #2a82da), with disabled text greyed.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication


def dark_palette() -> QPalette:
    """The palette used when the desktop's colour scheme is dark."""
    p = QPalette()
    window, base, text = QColor("#353535"), QColor("#2a2a2a"), QColor("#ffffff")
    for role, colour in ((QPalette.Window, window), (QPalette.WindowText, text), (QPalette.Base, base),
                         (QPalette.AlternateBase, QColor("#323232")), (QPalette.ToolTipBase, QColor("#202020")),
                         (QPalette.ToolTipText, text), (QPalette.Text, text), (QPalette.Button, window),
                         (QPalette.ButtonText, text), (QPalette.BrightText, QColor("#ff5555")),
                         (QPalette.Link, QColor("#5ea3f0")), (QPalette.Highlight, QColor("#2a82da")),
                         (QPalette.HighlightedText, QColor("#ffffff")), (QPalette.PlaceholderText, QColor("#9a9a9a")),
                         (QPalette.Light, QColor("#505050")), (QPalette.Midlight, QColor("#454545")),
                         (QPalette.Mid, QColor("#2e2e2e")), (QPalette.Dark, QColor("#232323")),
                         (QPalette.Shadow, QColor("#141414"))):
        p.setColor(role, colour)
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        p.setColor(QPalette.Disabled, role, QColor("#7f7f7f"))
    return p


def scheme_is_dark(scheme: Qt.ColorScheme) -> bool | None:
    """True for a dark scheme, False for a light one, None when the platform does not say."""
    return {Qt.ColorScheme.Dark: True, Qt.ColorScheme.Light: False}.get(scheme)


def apply_scheme(app: QApplication, dark: bool | None) -> None:
    """Give ``app`` the dark palette (True), the style's light one (False), or leave it (None)."""
    if dark is None:
        return
    app.setPalette(dark_palette() if dark else app.style().standardPalette())


def desktop_is_dark() -> bool | None:
    """What the desktop's colour scheme says now (see :func:`scheme_is_dark`)."""
    return scheme_is_dark(QGuiApplication.styleHints().colorScheme())
