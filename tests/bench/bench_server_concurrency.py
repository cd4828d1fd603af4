"""Concurrent chat streams against ``engine serve --parallel N``: aggregate decode tok/s and per-stream TTFT.

The server runs as its own process (``python -m engine serve``, prefix cache on as shipped); the client opens
``k`` streamed chat completions at once with the official ``openai`` client (each prompt its own, so no
stream resumes another's answer) and measures, per stream, the time to its first content chunk (TTFT) and
its completion tokens (``stream_options.include_usage``). Rounds of each ``k`` are interleaved. Aggregate tok/s
is the streams' completion tokens over the round's wall time; the server process's CPU seconds per round
(``/proc/PID/stat``) give tokens per CPU-second, steadier than wall time on a shared machine.

Usage: ``.venv/bin/python tests/bench/bench_server_concurrency.py --model M [--parallel 4] [--streams 1 4]
[--rounds 3] [--tokens 32]``. Prints one line per ``k`` (medians over rounds) and the load average
(``os.getloadavg``) at start and end; report them with the figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stream(client: openai.OpenAI, prompt: str, tokens: int, out: list, t0: float) -> None:
    """One streamed chat completion: appends (TTFT s, completion tokens, end s), times from ``t0``."""
    first = None
    used = 0
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    out.append((first if first is not None else float("nan"), used, time.perf_counter() - t0))


def _round(client: openai.OpenAI, pid: int, k: int, tag: str, tokens: int) -> tuple[float, float, float]:
    """``k`` streams at once: (aggregate tok/s, median TTFT ms, tokens per server CPU-second)."""
    out: list = []
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    threads = [threading.Thread(target=_stream, args=(client, f"Story {tag}-{i}: tell me about river {i}.",
                                                      tokens, out, t0)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    total = sum(n for _, n, _ in out)
    return total / wall, statistics.median(f for f, _, _ in out) * 1e3, total / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", args.model, "--port", str(port),
                               "--parallel", str(args.parallel), "--model-name", "m", "--context", "2048"])
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        print(f"model {os.path.basename(args.model)}; --parallel {args.parallel}; {args.tokens} tokens a stream; "
              f"load average {os.getloadavg()[0]:.2f} at start")
        _round(client, server.pid, 1, "warm", 4)
        results: dict[int, list] = {k: [] for k in args.streams}
        for r in range(args.rounds):
            for k in args.streams:
                results[k].append(_round(client, server.pid, k, f"{r}-{k}", args.tokens))
        for k, rows in results.items():
            agg, ttft, per_cpu = (statistics.median(col) for col in zip(*rows))
            print(f"{k} streams: aggregate {agg:6.2f} tok/s, per stream {agg / k:6.2f} tok/s, median TTFT "
                  f"{ttft:7.0f} ms, {per_cpu:6.2f} tok per server CPU-s (medians of {len(rows)} rounds)")
        print(f"load average {os.getloadavg()[0]:.2f} at end")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
