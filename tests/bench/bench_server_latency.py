"""The request latency ``engine serve`` adds over the in-process engine: time to first token (TTFT)
measured the same way on both sides, from the call to the first piece of answer text in hand.

In process: ``Engine.chat`` as a turn of the session the server shares, to its first ``TokenEvent``.
Over HTTP: the official ``openai`` client's streamed ``chat.completions.create`` on loopback to its first
chunk with content (request encoding, the server's parsing and queueing, the event-loop hop and SSE framing
included). Both run on one engine with the prefix cache off, so every turn prefills the whole prompt;
runs are interleaved.

Usage: ``.venv/bin/python tests/bench/bench_server_latency.py [--model M] [--runs 15] [--prompt-words 40] [--stub]``
(default model: the bundled demo). Prints medians and the spread (min..max) of each and of the
per-pair difference; note the machine's load (``uptime``) beside the figures. ``--stub`` serves an
engine that answers at once (no model), which isolates the server's own cost from the prefill's
run-to-run noise on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import openai

from engine.api import Engine, EngineOptions, default_model
from engine.events import PrefillStats, TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.openai import ServerConfig, ServerThread
from engine.session import Session


class _Stub:
    """An engine that answers every turn at once with one token (the server's cost alone)."""

    def __init__(self, info) -> None:
        self.info = info

    def chat(self, messages, sampling=None, cancel=None, enable_thinking=False, conversation="", *, tools=None,
             grammar=None):
        yield PrefillStats(1, 0, 1, 0.0, 0.0, "cpu", 0.0)
        yield TokenEvent(0, "x", 0.0, 0)
        yield TurnSummary("eos", "", 1, 0, 1, 0.0, 0.0, 0.0, "x")


def _in_process(engine: Engine, session: Session, messages: list[dict]) -> float:
    session.call(lambda: None).result()   # the server's last (cut-off) turn may still be ending: not part of the timing
    t0 = time.perf_counter()
    events = session.stream(lambda cancel: engine.chat(messages, SamplingParams.greedy(2), cancel))
    for event in events:
        if isinstance(event, TokenEvent) and event.text:
            ms = (time.perf_counter() - t0) * 1e3
            events.close()
            return ms
    raise RuntimeError("no token")


def _over_http(client: openai.OpenAI, model: str, messages: list[dict]) -> float:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ms = (time.perf_counter() - t0) * 1e3
            stream.close()
            return ms
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF text model (default: the bundled demo)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--stub", action="store_true", help="an engine that answers at once (the server's cost alone)")
    args = ap.parse_args()
    path = args.model or default_model()[0]
    engine = Engine.load(path, options=EngineOptions(prefix_cache=False, device="cpu"))
    if args.stub:
        engine = _Stub(engine.info)
    session = Session()
    server = ServerThread(engine, ServerConfig("m"), port=0, session=session).start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    print(f"model {'stub' if args.stub else os.path.basename(path)}; load average {os.getloadavg()[0]:.2f} at start")
    local, remote = [], []
    for k in range(args.runs + 1):
        messages = [{"role": "user", "content": " ".join(f"word{k}x{i}" for i in range(args.prompt_words))}]
        pair = (_in_process(engine, session, messages), _over_http(client, "m", messages))
        if k:  # the first pair warms up both paths
            local.append(pair[0])
            remote.append(pair[1])
    diff = [r - loc for loc, r in zip(local, remote)]
    for name, xs in (("in process", local), ("engine serve", remote), ("difference", diff)):
        print(f"{name:13s} TTFT median {statistics.median(xs):7.1f} ms  (min {min(xs):.1f}, max {max(xs):.1f}, "
              f"n={len(xs)})")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    server.stop()


if __name__ == "__main__":
    main()
