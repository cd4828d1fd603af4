"""Start DeltaDesk: ``python -m app [--model PATH] [--mmproj PATH]`` or the ``deltadesk`` script."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from engine import hub
from engine.errors import EngineError

from .engine_worker import EngineLoader, WorkerThread, load_real_engine
from .history import ImageStore
from .history_thread import HistoryThread
from .main_window import MainWindow, follows_dark_scheme
from .markdown_render import MarkdownRenderer
from .gpu import GpuTelemetry, NvmlGpu
from .sidebar import MonitorThread
from .single_instance import SingleInstance
from .theme import apply_scheme, desktop_is_dark

APP_NAME = "deltadesk"
ICON = Path(__file__).resolve().parent / "resources" / "deltadesk.svg"


@dataclass(frozen=True)
class AppPaths:
    """Where DeltaDesk keeps its files (platformdirs' user data, config and cache dirs by default)."""

    data: Path
    config: Path
    cache: Path

    @classmethod
    def default(cls) -> "AppPaths":
        """The per-user folders of this platform."""
        return cls(Path(platformdirs.user_data_dir(APP_NAME)), Path(platformdirs.user_config_dir(APP_NAME)),
                   Path(platformdirs.user_cache_dir(APP_NAME)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: optional model and vision-tower files (for this run; settings are kept)."""
    parser = argparse.ArgumentParser(prog="deltadesk", description="DeltaDesk: chat with a local Qwen3.5/3.6 model.")
    parser.add_argument("--model", help="GGUF model file or a downloaded REPO:QUANT (default: the one in the settings, "
                        "else the bundled model)")
    parser.add_argument("--mmproj", help="GGUF vision tower (mmproj) file")
    return parser.parse_args(argv)


def model_arg(model: str, mmproj: str | None) -> tuple[str, str | None]:
    """``--model`` / ``--mmproj`` as files: a downloaded ``REPO:QUANT`` becomes its file and vision tower
    (:func:`engine.hub.model_files`), a path stays as it is.

    Raises:
        EngineError: a hub name that is not downloaded (the message says how to fetch it).
    """
    files = hub.model_files(model)
    if files is None:
        return model, mmproj
    return str(files[0]), mmproj or (str(files[1]) if files[1] else None)


def build_window(paths: AppPaths, loader: EngineLoader = load_real_engine,
                 gpu: GpuTelemetry | None = None) -> MainWindow:
    """Build the history thread, the engine worker, the monitor and the window, then start the history.

    ``gpu``: the monitor's second source of GPU readings (NVML), or None.

    A QApplication must exist. A history database that cannot be opened is replaced by an
    in-memory one for this run, and the window says so.
    """
    history = HistoryThread(paths.data / "history.db")
    state = QSettings(str(paths.config / "settings.ini"), QSettings.IniFormat)
    window = MainWindow(history, ImageStore(paths.data / "images"), WorkerThread(loader), MonitorThread(gpu),
                        state, MarkdownRenderer(dark=follows_dark_scheme()), paths.cache / "snapshots")
    history.start()
    return window


def open_files(window: MainWindow, model: str | None, mmproj: str | None, handed: bool = False) -> None:
    """Open the command line's model (a path, or a downloaded ``REPO:QUANT``: :func:`model_arg`) and vision
    tower for this run, else the configured model with that tower. A hub name that is not downloaded is said
    on stderr and in the status bar; then the configured model loads, unless the files were ``handed`` over
    by a later launch (the loaded model stays)."""
    try:
        files = model_arg(model, mmproj) if model else None
    except EngineError as exc:
        print(f"deltadesk: {exc}", file=sys.stderr)
        window.statusBar().showMessage(str(exc))
        if handed:
            return
        files = None
    if files is not None:
        window.load_model(*files)
    else:
        window.load_configured(mmproj)


def follow_launches(instance: SingleInstance, window: MainWindow) -> None:
    """A later launch raises ``window`` and hands it its ``--model`` / ``--mmproj`` to open (a failed load
    says why in the window and keeps the loaded model)."""
    instance.raise_requested.connect(window.bring_to_front)
    instance.open_requested.connect(lambda model, mmproj: open_files(window, model, mmproj, handed=True))


def main(argv: list[str] | None = None) -> int:
    """Run the app until its window closes; returns the exit status.

    A second launch for the same user (data dir) raises the running window and returns 0.
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    app = QApplication(sys.argv[:1])
    app.setApplicationName("DeltaDesk")
    app.setDesktopFileName("deltadesk")
    app.setWindowIcon(QIcon(str(ICON)))
    app.setStyle("Fusion")
    apply_scheme(app, desktop_is_dark())
    paths = AppPaths.default()
    instance = SingleInstance(paths.data)
    if not instance.acquire(args.model, args.mmproj):
        handed = " and asked to open the model" if args.model or args.mmproj else ""
        print(f"DeltaDesk is already running for this user ({paths.data}): its window was brought to the front"
              f"{handed}.")
        return 0
    window = build_window(paths, gpu=NvmlGpu.open())
    follow_launches(instance, window)
    window.show()
    open_files(window, args.model, args.mmproj)
    # Python runs signal handlers only between bytecodes; the timer lets it in so Ctrl+C or a
    # SIGTERM closes the window (saving its state and the live answer) instead of being ignored.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: window.close())
    wake = QTimer()
    wake.timeout.connect(lambda: None)
    wake.start(250)
    try:
        return app.exec()
    finally:
        instance.release()


if __name__ == "__main__":
    sys.exit(main())
