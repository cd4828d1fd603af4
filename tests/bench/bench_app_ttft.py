"""The app's time to first token: a chat request sent to the engine worker on its thread, as the window
sends it, to the first ``tokens`` signal back on the GUI thread (the worker, its engine session and the
Qt signal hops included), on the bundled demo model. Each turn's prompt differs from its first word, so
a turn resumes at most the chat template's few leading tokens from the prefix cache.

Usage: ``QT_QPA_PLATFORM=offscreen python tests/bench/bench_app_ttft.py [--runs 15] [--prompt-words 40]``.
Prints the median and spread (min..max) in ms; note the machine's load (``uptime``) beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    """Load the demo model in a worker thread, time ``--runs`` turns to their first text, print the figures."""
    from PySide6.QtCore import QObject, QTimer, Signal
    from PySide6.QtWidgets import QApplication

    from app.engine_worker import ChatRequest, LoadRequest, WorkerThread, load_real_engine
    from engine.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--prompt-words", type=int, default=40)
    args = parser.parse_args()
    qapp = QApplication.instance() or QApplication([])

    class Driver(QObject):
        load = Signal(object)
        chat = Signal(object)

    model = ROOT / "assets/models/deltadesk-demo.gguf"
    wt = WorkerThread(load_real_engine)
    driver = Driver()
    driver.load.connect(wt.worker.load)
    driver.chat.connect(wt.worker.chat)
    state: dict = {"times": [], "sent": 0.0, "first": None}

    def send() -> None:
        if len(state["times"]) == args.runs:
            qapp.quit()
            return
        words = " ".join(f"word{(len(state['times']) * 7 + i) % 97}" for i in range(args.prompt_words))
        state["first"], state["sent"] = None, time.perf_counter()
        driver.chat.emit(ChatRequest([{"role": "user", "content": words}], sampling=SamplingParams.greedy(2)))

    def on_tokens(*_args) -> None:
        if state["first"] is None:
            state["first"] = time.perf_counter()
            state["times"].append((state["first"] - state["sent"]) * 1e3)

    wt.worker.loaded.connect(lambda _summary: QTimer.singleShot(0, send))
    wt.worker.load_failed.connect(lambda why: (print(why), qapp.quit()))
    wt.worker.tokens.connect(on_tokens)
    wt.worker.finished.connect(lambda _summary: QTimer.singleShot(0, send))
    driver.load.emit(LoadRequest(str(model)))
    qapp.exec()
    wt.stop()
    t = state["times"]
    print(f"app TTFT over {len(t)} turns: median {statistics.median(t):.1f} ms ({min(t):.1f}..{max(t):.1f})")


if __name__ == "__main__":
    main()
