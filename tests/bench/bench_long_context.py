"""Benchmark: long-context CPU prefill, tok/s at 2k vs 10k prompt tokens (a script, not a test).

    python tests/bench/bench_long_context.py [--model m.gguf] [--lengths 2048,10240] [--threads 2] [--repeats 1]

Without ``--model`` it writes ``synth --preset minicpmv46`` (the Qwen3.5-0.8B text backbone of
MiniCPM-V 4.6, Q4_0, random weights) to a temporary folder first. Each length is a fresh state
prefilled the way the app does it (:func:`engine.turn.runtime.prefill`: pieces of
:data:`engine.turn.runtime.PREFILL_PIECE` tokens) from random token ids; lengths are interleaved over
the repeats and medians reported. Per length it prints wall tok/s, the process CPU seconds (all
threads: on a busy machine tokens per CPU second move less than wall figures) and the share of
wall time spent in attention over the KV cache and in the Gated DeltaNet recurrence (the two token
mixers; the rest is projections, FFN, norms). The claim checked (a companion
study's 408 -> 361 tok/s): tok/s at the longest length >= 85 % of that at the shortest. Load
average is printed before and after: figures from a loaded machine are not final.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.testing.synth import synth
from engine.registry import open_text
from engine.kernels import cpu
from engine.turn.runtime import PREFILL_PIECE, prefill
from engine.turn.state import SequenceState

CLAIM = 0.85
"""tok/s at the longest length over tok/s at the shortest that the study reports reaching (361 / 408)."""


class MixerClock:
    """Wall seconds spent in a model's ``attend`` and ``delta_rule`` hooks (wraps the instance's methods)."""

    def __init__(self, model: NativeQwen35Model) -> None:
        self.seconds = {"attend": 0.0, "delta_rule": 0.0}
        for name in self.seconds:
            setattr(model, name, self._timed(name, getattr(model, name)))

    def _timed(self, name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return call

    def reset(self) -> None:
        for name in self.seconds:
            self.seconds[name] = 0.0


def run_once(model: NativeQwen35Model, clock: MixerClock, n: int, seed: int) -> dict[str, float]:
    """Prefill n random tokens into a fresh state: wall s, CPU s, attention and GDN wall s."""
    tokens = np.random.default_rng(seed).integers(0, model.hp.n_vocab, n)
    state = SequenceState.new(model.hp, n)
    clock.reset()
    c0, t0 = time.process_time(), time.perf_counter()
    prefill(model, tokens, state, threading.Event())
    wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return dict(wall=wall, cpu=cpu_s, attend=clock.seconds["attend"], gdn=clock.seconds["delta_rule"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a qwen35 GGUF (default: synth --preset minicpmv46 into a temp folder)")
    ap.add_argument("--lengths", default="2048,10240", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    path = args.model
    if path is None:
        path = Path(tempfile.mkdtemp()) / "minicpmv46.gguf"
        synth(path, "minicpmv46", quant="q4_0", seed=0)
    cpu.set_threads(args.threads)
    gguf = open_text(path)
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    clock = MixerClock(model)
    print(f"{path.name}: {gguf.hparams.n_layer} layers, isa {cpu.isa()}, {args.threads} threads, pieces of "
          f"{PREFILL_PIECE}; load average before {os.getloadavg()[0]:.2f}")
    run_once(model, clock, PREFILL_PIECE, seed=99)   # warm-up: page in the weights
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in lengths}
    for r in range(args.repeats):
        for n in lengths:
            runs[n].append(run_once(model, clock, n, seed=r))
    tok_s = {}
    for n in lengths:
        walls = [x["wall"] for x in runs[n]]
        wall = statistics.median(walls)
        tok_s[n] = n / wall
        med = {key: statistics.median(x[key] for x in runs[n]) for key in ("cpu", "attend", "gdn")}
        spread = f" (runs {min(walls):.1f}..{max(walls):.1f} s)" if len(walls) > 1 else ""
        print(f"{n:6d} tokens: {tok_s[n]:7.1f} tok/s, {wall:.1f} s wall{spread}, {med['cpu']:.1f} s CPU "
              f"({n / med['cpu']:.1f} tok per CPU s); attention {100 * med['attend'] / wall:.1f} %, "
              f"GDN {100 * med['gdn'] / wall:.1f} % of wall")
    lo, hi = lengths[0], lengths[-1]
    ratio = tok_s[hi] / tok_s[lo]
    print(f"tok/s at {hi} / at {lo}: {ratio:.3f} ({'meets' if ratio >= CLAIM else 'misses'} the {CLAIM:.0%} claim); "
          f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
