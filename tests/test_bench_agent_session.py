"""The agent-session benchmark's driver: interleaving, resuming, refusals, and stopping its servers.

The end-to-end tests run ``tests/bench/bench_agent_session.py`` against a real ``engine serve`` on the tiny
synth model and a stand-in for ``llama-server`` (:data:`FAKE_PEER`, a stdlib HTTP server that can die or hang
at its Nth request), and check that no server outlives the bench.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "bench"
sys.path.insert(0, str(BENCH))

from agent_session_report import comparison, spread  # noqa: E402
from agent_session_servers import check_memory  # noqa: E402
from bench_agent_session import done_requests, keep_until, messages_for  # noqa: E402

FAKE_PEER = '''#!{python}
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
action, _, at = os.environ.get("FAKE_PEER", "").partition(":")
seen = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.send({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        seen.append(len(json.dumps(body["messages"])))
        if at and len(seen) == int(at):
            if action == "die":
                os._exit(3)
            open(os.environ["FAKE_PEER_MARK"], "w").close()
            time.sleep(600)
        usage = {{"prompt_tokens": seen[-1], "completion_tokens": 1, "total_tokens": seen[-1] + 1,
                  "prompt_tokens_details": {{"cached_tokens": seen[-2] if len(seen) > 1 else 0}}}}
        self.send({{"id": "c", "object": "chat.completion", "created": 0, "model": "agent-bench", "usage": usage,
                   "choices": [{{"index": 0, "finish_reason": "length",
                                "message": {{"role": "assistant", "content": "a"}}}}],
                   "timings": {{"prompt_ms": 1.0}}}})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _rows(path: Path, key: str = "request") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if key in r]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_conversation_grows_by_one_call_and_result_per_request():
    first, third = messages_for(1, 300, 3), messages_for(3, 300, 3)
    assert [m["role"] for m in first] == ["system", "user"]
    assert third[:2] == first and [m["role"] for m in third[2:]] == ["assistant", "tool"] * 2
    assert third[3]["content"].count("\n") == 2 and third[3]["tool_call_id"] == third[2]["tool_calls"][0]["id"]


def test_resume_keeps_the_requests_both_servers_answered(tmp_path):
    out = tmp_path / "ours.jsonl"
    lines = [{"uptime": "u"}, {"request": 1}, {"request": 2}, {"warmup": 2}, {"request": 3}]
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert done_requests(out) == 3 and done_requests(tmp_path / "absent.jsonl") == 0
    keep_until(out, 2)
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines[:4]


def test_the_comparison_gives_each_ratio_and_their_spread(capsys):
    ours = [{"request": k, "prompt_tokens": 10 * k, "prefilled_tokens": 10, "ttft_ms": t, "order": 2 - k % 2,
             "load1": 1.0} for k, t in [(1, 300.0), (2, 50.0), (3, 200.0), (4, 100.0)]]
    peer = [{**r, "ttft_ms": 100.0, "load1": 3.0} for r in ours]
    comparison(ours, peer)
    text = capsys.readouterr().out
    assert "| 1 | 10 / 10 | 10 / 10 | 300 | 100 | 3.00 | - / - | 1.0 / 3.0 | ours |" in text
    assert "| 2 | 20 / 20 | 10 / 10 | 50 | 100 | 0.50 | - / - | 1.0 / 3.0 | llama-server |" in text
    assert "request 1 3.00 (3.00-3.00); requests 2-4: median 1.00 (0.50-2.00) over 3 requests" in text
    assert "median 2.00 (1.00-3.00)" in text and spread([]) == "-"


def test_both_servers_at_once_are_refused_when_memory_is_short(synth_model):
    from engine.kernels.cpu import physical_cores

    model = str(synth_model("tiny", "q8_0"))
    with pytest.raises(SystemExit, match=r"both servers at once need about [\d,]+ MiB \(model file .* but 100 MiB "
                                         r"is available: .*--sequential"):
        check_memory(model, 2048, physical_cores(), available=100)
    with pytest.raises(SystemExit, match=rf"--threads {physical_cores()} so both servers run as many threads"):
        check_memory(model, 2048, physical_cores() + 1)


def _bench(tmp_path: Path, model: Path, fake: str, *extra: str) -> subprocess.Popen:
    """Start the bench on ``model`` against ours and the stand-in peer (behaving as ``fake`` says)."""
    from engine.kernels.cpu import physical_cores

    peer = tmp_path / "llama-server"
    if not peer.exists():
        peer.write_text(FAKE_PEER.format(python=sys.executable))
        peer.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_PEER": fake, "FAKE_PEER_MARK": str(tmp_path / "hung")}
    return subprocess.Popen([sys.executable, str(BENCH / "bench_agent_session.py"), "--model", str(model), "--work",
                             str(tmp_path / "work"), "--llama-server", str(peer), "--requests", "2", "--system-tokens",
                             "300", "--result-lines", "3", "--context", "2048", "--threads", str(physical_cores()),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _pids(work: Path) -> list[int]:
    return [r["pid"] for name in ("ours", "llama-server") for r in _rows(work / f"{name}.jsonl", "pid")]


@pytest.mark.slow
def test_a_server_that_dies_is_named_and_the_run_resumes(synth_model, tmp_path):
    model, work = synth_model("tiny", "q8_0"), tmp_path / "work"
    out, err = _bench(tmp_path, model, "die:2").communicate(timeout=300)
    assert "llama-server (pid " in err and "exited with code 3 during request 2" in err and "--resume" in err, err
    assert all(map(_gone, _pids(work)))
    assert [r["request"] for r in _rows(work / "ours.jsonl")] == [1]
    assert [r["request"] for r in _rows(work / "llama-server.jsonl")] == [1]

    bench = _bench(tmp_path, model, "", "--resume")
    out, err = bench.communicate(timeout=300)
    assert bench.returncode == 0, err
    for name in ("ours", "llama-server"):
        rows = _rows(work / f"{name}.jsonl")
        assert [(r["request"], r["order"]) for r in rows] == [(1, 1 if name == "ours" else 2),
                                                              (2, 2 if name == "ours" else 1)]
        assert all(r["load1"] >= 0 and r["cpu_s"] >= 0 and r["idle_cpu_s"] >= 0 for r in rows)
        assert [r["warmup"] for r in _rows(work / f"{name}.jsonl", "warmup")] == [1]
    assert "requests 2-2: median" in out
    assert all(map(_gone, _pids(work)))


@pytest.mark.slow
def test_ctrl_c_stops_both_servers(synth_model, tmp_path):
    bench = _bench(tmp_path, synth_model("tiny", "q8_0"), "hang:2")
    deadline = time.monotonic() + 300
    while not (tmp_path / "hung").exists() and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "hung").exists(), bench.communicate()[1]
    bench.send_signal(signal.SIGINT)
    _, err = bench.communicate(timeout=300)
    assert bench.returncode == 130 and "interrupted: the servers are stopped" in err, err
    pids = _pids(tmp_path / "work")
    assert len(pids) == 2 and all(map(_gone, pids))
