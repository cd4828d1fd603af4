"""One DeltaDesk per user profile: the lock, the raise request, and two real launches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from app.single_instance import SingleInstance
from processes import wait_until_sigterm_is_handled

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_instance_of_a_profile_is_refused_and_raises_the_first(qtbot, tmp_path):
    first = SingleInstance(tmp_path / "data")
    assert first.acquire()
    second = SingleInstance(tmp_path / "data")
    with qtbot.waitSignal(first.raise_requested):
        assert not second.acquire()
    other = SingleInstance(tmp_path / "other-profile")
    assert other.acquire()
    other.release()
    first.release()
    again = SingleInstance(tmp_path / "data")
    assert again.acquire()
    again.release()


def test_the_window_comes_to_the_front_when_asked(qtbot, make_window):
    window = make_window(load=False)
    window.showMinimized()
    window.bring_to_front()
    assert not window.isMinimized() and window.isVisible()


def test_a_second_launch_says_so_and_leaves_the_first_running(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")} | {
        "QT_QPA_PLATFORM": "offscreen", "XDG_DATA_HOME": str(tmp_path / "share"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    lock = tmp_path / "share" / "deltadesk" / "deltadesk.lock"
    first = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lock.exists(), first.communicate(timeout=5)[0] if first.poll() is not None else "no lock file"
        second = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 0 and "already running" in second.stdout, second.stdout + second.stderr
        assert first.poll() is None
        assert wait_until_sigterm_is_handled(first)      # its window is up: the SIGTERM below closes it cleanly
    finally:
        first.terminate()
        out = first.communicate(timeout=30)[0]
    assert first.returncode == 0 and "Traceback" not in out, out
