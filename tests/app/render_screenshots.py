"""Take README's screenshots from the running app on the bundled demo model (the real engine).

Usage: ``python tests/app/render_screenshots.py [OUT_DIR] [--dark]`` (default: a new temp dir).
Works on the offscreen platform or a real display (e.g. under Xvfb). The window is the one
``python -m app`` opens (:func:`app.__main__.build_window` with the real engine loader and NVML),
on a fresh profile in a temp dir; every answer is the demo model's own, typed in and streamed as
a user would. What is staged, and so named in the captions: the window size, the questions, and the
picture, a drawn shape scene of ``training/data.py`` (a held-out seed, the kind of picture the demo
model knows). The GPU section shows whatever this machine has: run it on a GPU machine to get a
GPU picture, never fake one.

Writes chat-with-image.png (an answer about an attached picture, the sidebar with the turn's
figures and the prefix snapshots), composer-image.png (an attached image with the size the model
sees), history-search.png (history search), settings.png (the settings dialog); with ``--dark``
the window uses the dark palette, as on a desktop with a dark colour scheme. With ``--remote`` it
writes only remote-mode.png: the window on a remote engine, another DeltaDesk's ``engine serve`` of the
demo model with its vision tower (staged too: that server runs on this machine, on loopback), asked
about the same picture.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "training")]

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from app.gpu import NvmlGpu  # noqa: E402
from app.theme import apply_scheme  # noqa: E402
from data import EVAL_SEED_BASE, render, scene  # noqa: E402

SCENE_SEED = EVAL_SEED_BASE + 7


def pump(app: QApplication, seconds: float) -> None:
    """Let the app run for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.005)


def until(app: QApplication, done, timeout: float = 120.0) -> None:
    """Run the app until ``done()`` (raises TimeoutError after ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("the app did not get there in time")
        pump(app, 0.02)


def ask(app: QApplication, window, text: str, image: Path | None = None) -> None:
    """Type a message (with an image), send it and wait for the model's whole answer."""
    if image is not None:
        window.composer.add_file(image)
        until(app, lambda: all(t.model_size.isVisibleTo(t) for t in window.composer.thumbnails()))
    window.composer.editor.setPlainText(text)
    window.composer.submit()
    until(app, lambda: window.controller.busy)
    until(app, lambda: not window.controller.busy)
    pump(app, 0.5)


def remote_mode(app: QApplication, window, picture: Path, out: Path) -> None:
    """Connect the window to ``engine serve`` of the demo model (loopback), ask about ``picture``, save
    remote-mode.png."""
    from dataclasses import replace

    from engine.api import Engine, EngineOptions, default_model
    from engine.openai import ServerConfig, ServerThread
    engine = Engine.load(*default_model(), options=EngineOptions(context=4096))
    server = ServerThread(engine, ServerConfig("deltadesk-demo"), port=0).start()
    try:
        window.apply_settings(replace(window.prefs, remote_url=server.url, remote_model="deltadesk-demo"))
        until(app, lambda: window.model is not None and window.model.info.remote)
        ask(app, window, "Describe the image.", picture)
        ask(app, window, "How many shapes are there?")
        pump(app, 1.2)
        window.grab().save(str(out / "remote-mode.png"))
    finally:
        server.stop()
        engine.close()


def main() -> None:
    args = [a for a in sys.argv[1:] if a not in ("--dark", "--remote")]
    out = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="deltadesk-shots-"))
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication(sys.argv[:1])
    app.setStyle("Fusion")
    apply_scheme(app, dark="--dark" in sys.argv)
    work = Path(tempfile.mkdtemp())
    picture = work / "shapes.png"
    render(scene(SCENE_SEED)).save(picture)
    window = build_window(AppPaths(work / "data", work / "config", work / "cache"), gpu=NvmlGpu.open())
    window.resize(1280, 800)
    window.show()
    until(app, lambda: window.controller.conversation_id is not None)
    window.load_configured()
    until(app, lambda: window.model is not None)
    if "--remote" in sys.argv:
        remote_mode(app, window, picture, out)
        QTimer.singleShot(0, window.close)
        pump(app, 0.5)
        print(out)
        return

    ask(app, window, "Hello")
    window.new_conversation()
    until(app, lambda: not window.chat_view.widgets)
    ask(app, window, "What can you do?")
    window.new_conversation()
    until(app, lambda: not window.chat_view.widgets)
    window.composer.add_file(picture)
    window.composer.editor.setPlainText("Describe the image.")
    until(app, lambda: all(t.model_size.isVisibleTo(t) for t in window.composer.thumbnails()))
    window.composer.grab().save(str(out / "composer-image.png"))
    window.composer.submit()
    until(app, lambda: window.controller.busy)
    until(app, lambda: not window.controller.busy)
    ask(app, window, "How many shapes are there?")
    pump(app, 1.2)
    window.grab().save(str(out / "chat-with-image.png"))

    window.panel.search.setText("hexagon")
    pump(app, 0.5)
    window.grab().save(str(out / "history-search.png"))
    window.panel.search.clear()
    dialog = window.settings_dialog()
    dialog.show()
    pump(app, 0.3)
    dialog.grab().save(str(out / "settings.png"))
    dialog.close()
    QTimer.singleShot(0, window.close)
    pump(app, 0.5)
    print(out)


if __name__ == "__main__":
    main()
