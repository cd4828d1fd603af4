"""Render the main window's states to PNG files, on a fake engine, for people to look at.

Usage: ``python tests/app/render_screenshots.py [OUT_DIR]`` (default: a new temp dir). Works on the
offscreen platform or a real display (e.g. under Xvfb). Writes empty.png, streaming.png (an answer
streaming under a message with an image), answer.png (rendered Markdown with code and thinking),
search.png (history search), sidebar.png and composer-no-vision.png (an attached image
with the warning shown when the model has no vision tower).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtGui import QColor, QImage, QLinearGradient, QPainter  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from app.sidebar import GpuSample  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402

ANSWER = ["<think>", "The user wants a sorted list", " without duplicates.", "</think>",
          "Use a **set** to drop duplicates, then `sorted`:\n\n", "```python\n",
          "def unique_sorted(xs: list[int]) -> list[int]:\n", "    return sorted(set(xs))\n", "```\n\n",
          "| input | output |\n|---|---|\n| `[3, 1, 3]` | `[1, 3]` |\n\n",
          "It runs in *O(n log n)*."]
STREAM = ["This ", "picture ", "shows ", "a ", "gradient ", "from ", "orange ", "to ", "blue, "] + ["with more words"] * 400


class FakeGpu:
    """Telemetry of a made-up 8 GB card."""

    def sample(self) -> GpuSample:
        return GpuSample("NVIDIA GeForce RTX 4060 (8 GB)", vram_used=5_900_000_000, vram_budget=6_400_000_000,
                         vram_total=8_585_000_000, h2d_gb_s=12.4)


def pump(app: QApplication, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.005)


def sample_image(path: Path) -> Path:
    image = QImage(640, 400, QImage.Format_RGB32)
    painter = QPainter(image)
    gradient = QLinearGradient(0, 0, 640, 400)
    gradient.setColorAt(0, QColor("#f08a24"))
    gradient.setColorAt(1, QColor("#2456f0"))
    painter.fillRect(image.rect(), gradient)
    painter.end()
    image.save(str(path))
    return path


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="deltadesk-shots-"))
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication(sys.argv[:1])
    app.setStyle("Fusion")
    work = Path(tempfile.mkdtemp())
    engine = FakeEngine(tokens=ANSWER, token_ms=30.0, has_vision=True)
    window = build_window(AppPaths(work / "data", work / "config"), loader_for(engine), FakeGpu())
    window.resize(1280, 800)
    window.show()
    window.load_model(None)
    pump(app, 0.5)
    window.grab().save(str(out / "empty.png"))

    window.composer.think_box.setChecked(True)
    window.composer.editor.setPlainText("How do I sort a list and drop duplicates in Python?")
    window.composer.submit()
    while window.controller.busy:
        pump(app, 0.05)
    pump(app, 1.2)
    window.grab().save(str(out / "answer.png"))

    window.new_conversation()
    engine.tokens, engine.token_ms = STREAM, 15.0
    window.composer.think_box.setChecked(False)
    window.composer.add_file(sample_image(work / "gradient.png"))
    window.composer.editor.setPlainText("What is in this image?")
    window.composer.set_vision(False)
    pump(app, 0.2)
    window.composer.grab().save(str(out / "composer-no-vision.png"))
    window.composer.set_vision(True)
    window.composer.submit()
    pump(app, 1.5)
    window.grab().save(str(out / "streaming.png"))
    window.controller.stop()
    while window.controller.busy:
        pump(app, 0.05)

    window.panel.search.setText("sort")
    pump(app, 0.2)
    window.grab().save(str(out / "search.png"))
    window.panel.search.clear()
    pump(app, 1.1)
    window.sidebar.grab().save(str(out / "sidebar.png"))
    QTimer.singleShot(0, window.close)
    pump(app, 0.2)
    print(out)


if __name__ == "__main__":
    main()
