"""Render the main window's states to PNG files, on a fake engine, for people to look at.

Usage: ``python tests/app/render_screenshots.py [OUT_DIR]`` (default: a new temp dir). Works on the
offscreen platform or a real display (e.g. under Xvfb). Writes empty.png, answer.png (rendered
Markdown with code and thinking), composer-image.png (an attached image with the size the model
sees), composer-no-vision.png (the warning shown when the model has no vision tower),
streaming.png (an answer streaming under a message with an image, the sidebar listing prefix
snapshots), search.png (history search), sidebar.png and settings.png (the settings dialog).
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
from app.history import HistoryStore  # noqa: E402
from app.settings_dialog import SettingsDialog  # noqa: E402
from app.gpu import GpuSample  # noqa: E402
from engine.api import SnapshotInfo  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402

ANSWER = ["<think>", "The user wants a sorted list", " without duplicates.", "</think>",
          "Use a **set** to drop duplicates, then `sorted`:\n\n", "```python\n",
          "def unique_sorted(xs: list[int]) -> list[int]:\n", "    return sorted(set(xs))\n", "```\n\n",
          "| input | output |\n|---|---|\n| `[3, 1, 3]` | `[1, 3]` |\n\n",
          "It runs in *O(n log n)*."]
STREAM = ["This ", "picture ", "shows ", "a ", "gradient ", "from ", "orange ", "to ", "blue,"] + \
    [" with more words"] * 400
EARLIER_CHATS = [
    ("Weekend in Turin", "Trains from Lyon to Turin on a Saturday?",
     "Take the TGV through the Fr\u00e9jus tunnel; book ahead."),
    ("Pear tart timing", "How long do I bake a pear tart at 180 \u00b0C?", "About 40 minutes, until the custard sets."),
    ("Rust lifetimes", "Why does the borrow checker reject this closure?", "The closure outlives the borrowed value."),
    ("Sourdough starter", "My starter smells like acetone. Is it dead?", "It is hungry: feed it twice a day."),
]
EARLIER_SNAPSHOTS = [SnapshotInfo("e1", "4", 3412, 61_400_000, 7200.0, 4, "disk"),
                     SnapshotInfo("e2", "2", 1187, 48_900_000, 86400.0 * 2, 1, "disk")]


class FakeGpu:
    """NVML readings of a made-up 8 GB card."""

    name = "NVIDIA GeForce RTX 4060 (8 GB)"

    def sample(self) -> GpuSample:
        return GpuSample(self.name, vram_used=5_900_000_000, vram_total=8_585_000_000, h2d_gb_s=12.4)


def seed_history(store: HistoryStore) -> None:
    """Add a few earlier conversations, so the list and the search have something to show."""
    for title, question, answer in EARLIER_CHATS:
        start = store.reply(store.create_conversation(), question, [], title)
        store.update_message(start.answer_id, answer, "complete")


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
    window = build_window(AppPaths(work / "data", work / "config", work / "cache"), loader_for(engine), FakeGpu())
    window.resize(1280, 800)
    window.show()
    pump(app, 0.3)
    window.load_configured()
    pump(app, 1.2)
    window.grab().save(str(out / "empty.png"))

    engine.snapshot_list = list(EARLIER_SNAPSHOTS)

    window.composer.think_box.setChecked(True)
    window.composer.editor.setPlainText("How do I sort a list and drop duplicates in Python?")
    window.composer.submit()
    pump(app, 0.1)
    while window.controller.busy:
        pump(app, 0.05)
    pump(app, 1.2)
    window.grab().save(str(out / "answer.png"))
    answered = window.controller.conversation_id

    window.history.call(seed_history, then=lambda _: window.conversations.reload())
    window.new_conversation()
    pump(app, 0.2)
    engine.tokens, engine.token_ms = STREAM, 15.0
    window.composer.think_box.setChecked(False)
    window.composer.add_file(sample_image(work / "gradient.png"))
    window.composer.editor.setPlainText("What is in this image?")
    pump(app, 0.3)
    window.composer.grab().save(str(out / "composer-image.png"))
    window.composer.set_vision(False)
    pump(app, 0.2)
    window.composer.grab().save(str(out / "composer-no-vision.png"))
    window.composer.set_vision(True)
    pump(app, 0.2)
    window.composer.submit()
    pump(app, 1.5)
    window.grab().save(str(out / "streaming.png"))
    window.controller.stop()
    while window.controller.busy:
        pump(app, 0.05)

    window.panel.search.setText("sorted")
    pump(app, 0.3)
    window.panel.select(answered)
    pump(app, 0.5)
    window.grab().save(str(out / "search.png"))
    window.panel.search.clear()
    pump(app, 1.1)
    window.sidebar.grab().save(str(out / "sidebar.png"))
    dialog = SettingsDialog(window.prefs, window)
    dialog.show()
    pump(app, 0.3)
    dialog.grab().save(str(out / "settings.png"))
    dialog.close()
    QTimer.singleShot(0, window.close)
    pump(app, 0.2)
    print(out)


if __name__ == "__main__":
    main()
