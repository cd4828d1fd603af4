"""Render app/resources/deltadesk.svg to the PNG sizes of the freedesktop icon theme.

Usage: ``python packaging/render_icons.py OUT_DIR`` writes ``OUT_DIR/hicolor/NxN/apps/deltadesk.png``
for each of :data:`SIZES` and ``OUT_DIR/hicolor/scalable/apps/deltadesk.svg`` (packaging/build
calls it; the PNGs are made, not kept in the repository).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QGuiApplication, QImage, QPainter  # noqa: E402
from PySide6.QtSvg import QSvgRenderer  # noqa: E402

SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
SVG = Path(__file__).resolve().parent.parent / "app" / "resources" / "deltadesk.svg"


def render(out: Path) -> list[Path]:
    """Write the PNGs and the SVG under ``out``; returns the files written."""
    renderer = QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"{SVG}: not a valid SVG")
    written = []
    for size in SIZES:
        image = QImage(size, size, QImage.Format_ARGB32)
        image.fill(Qt.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.Antialiasing)
        renderer.render(painter)
        painter.end()
        target = out / "hicolor" / f"{size}x{size}" / "apps" / "deltadesk.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not image.save(str(target)):
            raise SystemExit(f"{target}: cannot write")
        written.append(target)
    scalable = out / "hicolor" / "scalable" / "apps" / "deltadesk.svg"
    scalable.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SVG, scalable)
    return written + [scalable]


if __name__ == "__main__":
    app = QGuiApplication(sys.argv[:1])
    render(Path(sys.argv[1]))
