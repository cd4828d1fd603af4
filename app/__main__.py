"""Start DeltaDesk: ``python -m app [--model PATH] [--mmproj PATH]`` or the ``deltadesk`` script."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QApplication

from .engine_worker import EngineLoader, WorkerThread, load_real_engine
from .history import HistoryError, HistoryStore, ImageStore
from .main_window import MainWindow, follows_dark_scheme
from .markdown_render import MarkdownRenderer
from .sidebar import GpuTelemetry, MonitorThread

APP_NAME = "deltadesk"


@dataclass(frozen=True)
class AppPaths:
    """Where DeltaDesk keeps its files (platformdirs' user data and config dirs by default)."""

    data: Path
    config: Path

    @classmethod
    def default(cls) -> "AppPaths":
        """The per-user folders of this platform."""
        return cls(Path(platformdirs.user_data_dir(APP_NAME)), Path(platformdirs.user_config_dir(APP_NAME)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: optional model and vision-tower files."""
    parser = argparse.ArgumentParser(prog="deltadesk", description="DeltaDesk: chat with a local Qwen3.5/3.6 model.")
    parser.add_argument("--model", help="GGUF model file (default: the bundled default model)")
    parser.add_argument("--mmproj", help="GGUF vision tower (mmproj) file")
    return parser.parse_args(argv)


def build_window(paths: AppPaths, loader: EngineLoader = load_real_engine,
                 gpu: GpuTelemetry | None = None) -> MainWindow:
    """Build the history, the engine worker, the monitor and the window (a QApplication must exist).

    A history database that cannot be opened is replaced by an in-memory one for this run, and
    the window says so.
    """
    notice = ""
    try:
        store = HistoryStore.open(paths.data / "history.db")
    except HistoryError as exc:
        store = HistoryStore.open(":memory:")
        notice = f"{exc}. This session's chats will not be saved."
    settings = QSettings(str(paths.config / "window.ini"), QSettings.IniFormat)
    window = MainWindow(store, ImageStore(paths.data / "images"), WorkerThread(loader), MonitorThread(gpu),
                        settings, MarkdownRenderer(dark=follows_dark_scheme()))
    if notice:
        window.chat_view.empty_label.setText(notice)
    return window


def main(argv: list[str] | None = None) -> int:
    """Run the app until its window closes; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    app = QApplication(sys.argv[:1])
    app.setApplicationName("DeltaDesk")
    app.setStyle("Fusion")
    window = build_window(AppPaths.default())
    window.show()
    window.load_model(args.model, args.mmproj)
    # Python runs signal handlers only between bytecodes; the timer lets it in so Ctrl+C or a
    # SIGTERM closes the window (saving its state and the live answer) instead of being ignored.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: window.close())
    wake = QTimer()
    wake.timeout.connect(lambda: None)
    wake.start(250)
    status = app.exec()
    window.store.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
