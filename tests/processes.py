"""Helpers of the tests that start the app as a process of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def wait_until_sigterm_is_handled(proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Wait until ``proc`` has installed its own SIGTERM handler; whether it has.

    The app installs it once its window is built (from then a SIGTERM closes the window and the app
    exits with 0); a SIGTERM before that kills it with the default action. On Linux the process's
    caught-signal mask (``SigCgt`` in ``/proc/PID/status``, proc(5)) says when; elsewhere this returns
    True at once. False when the process ended or ``timeout`` s passed first.
    """
    status = Path(f"/proc/{proc.pid}/status")
    if not sys.platform.startswith("linux"):
        return True
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            caught = "SigCgt: 0"
        if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return True
        time.sleep(0.1)
    return False
