"""``python -m engine serve`` stops gracefully on SIGTERM (a service manager, ``docker stop``, ``kill``) and on
SIGINT (Ctrl+C): it stops taking requests, closes the session and the engine (the prefix snapshots reach the
``--cache-dir`` disk tier), says so in one line and exits with 0, without a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _serve(model: Path, cache_dir: Path, context: int = 256) -> tuple[subprocess.Popen, str]:
    """The server as a process of its own on a free port, once it listens; and its ``/v1`` URL."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0",
                             "--context", str(context), "--cache-dir", str(cache_dir)],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    while not lines or not lines[-1].startswith("[serving"):
        line = proc.stderr.readline()
        if not line:
            proc.kill()
            pytest.fail("the server did not start:\n" + "".join(lines) + proc.stderr.read())
        lines.append(line)
    return proc, re.search(r"on (http://127\.0\.0\.1:\d+/v1) ", lines[-1]).group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_and_keeps_the_snapshots(synth_model, tmp_path, sig) -> None:
    proc, url = _serve(synth_model("tiny", "q8_0"), tmp_path)
    try:
        response = httpx.post(url + "/chat/completions", timeout=60, json={
            "model": "tiny-q8_0", "max_tokens": 2, "messages": [{"role": "user", "content": "Remember this."}]})
        assert response.status_code == 200, response.text
        assert not list(tmp_path.rglob("*.snap"))          # the snapshots are in RAM until the engine closes
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert f"[{sig.name}: stopped serving" in err
    assert list(tmp_path.rglob("*.snap"))


def test_a_signal_before_the_server_runs_stops_it_and_restores_the_handlers() -> None:
    """A signal between the handlers' installation and the server's start is kept and stops the server it
    watches; the block's end puts the previous handlers back."""
    from engine.openai import StopSignals
    before = signal.getsignal(signal.SIGTERM)

    class _Server:
        should_exit = False

    with StopSignals() as stop:
        signal.raise_signal(signal.SIGTERM)
        server = _Server()
        stop.watch(server)
    assert stop.signal is signal.SIGTERM and server.should_exit
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_while_closing_exits_at_once() -> None:
    """After the server stopped (the session and engine closing), a second signal ends the process at once."""
    code = ("import signal\nfrom engine.openai import StopSignals\nwith StopSignals() as stop:\n"
            "    stop.closing()\n    signal.raise_signal(signal.SIGINT)\n    print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert "[SIGINT again: exiting before the shutdown finished]" in done.stderr and "not reached" not in done.stdout


def test_an_answer_still_streaming_after_the_grace_period_ends_with_an_error_event(synth_model, tmp_path) -> None:
    """SIGTERM while a long answer streams (12,000 tokens: far more than the 2 s grace period decodes): the
    stream ends with a ``server_stopping`` error event (no broken chunk), stderr says it cut one answer off,
    and no ``CancelledError`` traceback is logged; the server exits with 0."""
    import json
    from engine.openai import GRACE_S
    proc, url = _serve(synth_model("tiny", "q8_0"), tmp_path, context=16384)
    events = []
    try:
        with httpx.stream("POST", url + "/chat/completions", timeout=120, json={
                "model": "tiny-q8_0", "max_tokens": 12000, "stream": True, "temperature": 1.0, "seed": 1,
                "messages": [{"role": "user", "content": "Tell a long story."}]}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:
                    proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert f"[stopping: cut off 1 answer(s) still running {GRACE_S:g} s after the stop" in err
    last = json.loads(events[-1])
    assert last["error"]["code"] == "server_stopping" and "cut off after" in last["error"]["message"], last
    assert len(events) > 5 and all("choices" in json.loads(e) for e in events[:-1])
