"""Decode time per token: the one-call native step vs the per-hook path, interleaved (not a test).

Both paths run the same kernels and give the same bits, so the difference is the Python between the
native calls that the step removes. Usage::

    .venv/bin/python tests/bench/bench_step.py /tmp/bench/slice_q4_0.gguf --threads 1 2 --tokens 16 --rounds 6

Each round decodes ``--tokens`` tokens on each path (order alternating by round) from the same state
after a short prompt; prints per path and thread count the median ms/token over rounds with the
min-max, the calling thread's CPU time per token (``time.thread_time``: at 1 thread all the work,
less disturbed by a busy machine than wall time), the median of the per-round ratio, and the 1-minute
load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.registry import open_text
from engine.kernels import cpu
from engine.turn.state import SequenceState


def decode(model: NativeQwen35Model, state: SequenceState, token: int, n: int) -> tuple[float, float]:
    """Greedy-decode n tokens from ``state`` (a copy is used); returns (wall, calling thread's CPU) ms per token."""
    state = state.copy()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        token = int(model.forward(np.array([token]), state)[0].argmax())
    return (time.perf_counter() - t0) * 1e3 / n, (time.thread_time() - c0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=16, help="tokens per path per round")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    gguf = open_text(args.gguf)
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    if model.step is None:
        raise SystemExit(f"the step does not take this model: {model.step_fallback}")
    step = model.step
    print(f"{args.gguf}: isa {cpu.isa()}, load {os.getloadavg()[0]:.2f}")
    prompt = np.random.default_rng(0).integers(0, gguf.hparams.n_vocab, 8)
    for threads in args.threads:
        cpu.set_threads(threads)
        state = SequenceState.new(gguf.hparams, 8 + 2 * args.tokens + 8)
        token = int(model.forward(prompt, state)[-1].argmax())
        times: dict[str, list[float]] = {"step": [], "hooks": []}
        cpu_ms: dict[str, list[float]] = {"step": [], "hooks": []}
        decode(model, state, token, 2)   # warm-up: pages and pool
        for r in range(args.rounds):
            for name in (("step", "hooks") if r % 2 == 0 else ("hooks", "step")):
                model.step = step if name == "step" else None
                wall, used = decode(model, state, token, args.tokens)
                times[name].append(wall)
                cpu_ms[name].append(used)
        model.step = step
        ratio = statistics.median(h / s for h, s in zip(times["hooks"], times["step"]))
        for name, ts in times.items():
            print(f"threads {threads} {name:5s}: {statistics.median(ts):7.2f} ms/token "
                  f"({min(ts):.2f}-{max(ts):.2f}), {1e3 / statistics.median(ts):6.2f} tok/s; "
                  f"calling thread CPU {statistics.median(cpu_ms[name]):7.2f} ms/token")
        print(f"threads {threads} hooks/step time ratio (median of rounds): {ratio:.3f}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
