"""Benchmark: where one CPU prefill's time goes, by hook, in the calling thread's CPU time (a script, not a test).

    python tests/bench/bench_prefill_hooks.py MODEL.gguf [--tokens 512] [--depths] [--threads N]

Runs with one kernel thread (the pool then runs on the caller), so ``time.thread_time`` counts all of the
kernels' work and a busy machine distorts it much less than wall time: use it for before/after comparisons
run in turn on a loaded machine, never as a speed claim. Default: one ``forward`` of ``--tokens`` random
tokens after a 4-token warm-up (what ``engine bench``'s prompt row runs), split into the hooks ``linear``
and ``linears`` (projections; ``linears``: those of one input in one call), ``norm`` (RMSNorm),
``delta_rule`` (Gated DeltaNet), ``attend``, ``moe``, ``ffn`` and the rest (RoPE, residuals, Python).
``--depths``: one 256-token piece at cache depths 0 and 9984 instead (random KV rows and recurrent states),
each twice, and the 10240 / 2048 tok/s ratio (long-context prefill) projected from them (attention's cost
grows linearly with depth; the app prefills pieces of 256). ``--threads N``
(N > 1): each hook's wall time and process CPU time (all threads, spinning workers included) instead,
and the process CPU time over wall time, i.e. how many of the N threads were busy on average; the
forward's wall time against 1-thread CPU time / N shows what the split loses.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.registry import open_text
from engine.kernels import cpu
from engine.turn.state import SequenceState

HOOKS = ("linear", "linears", "norm", "delta_rule", "attend", "moe", "ffn")


def hook_seconds(model: NativeQwen35Model, clock=time.thread_time) -> dict[str, float]:
    """Wrap the instance's hooks with timers of ``clock`` (seconds); returns the live totals."""
    secs = dict.fromkeys(HOOKS, 0.0)

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                secs[name] += clock() - t0
        return call
    for name in HOOKS:
        setattr(model, name, timed(name, getattr(model, name)))
    return secs


def by_hook(model: NativeQwen35Model, n: int) -> str:
    rng = np.random.default_rng(0)
    secs = hook_seconds(model)
    model.forward(rng.integers(0, model.hp.n_vocab, 4), SequenceState.new(model.hp, n + 8))
    secs.update(dict.fromkeys(HOOKS, 0.0))
    t0 = time.thread_time()
    model.forward(rng.integers(0, model.hp.n_vocab, n), SequenceState.new(model.hp, n + 8))
    total = time.thread_time() - t0
    parts = ", ".join(f"{k} {v:.2f}" for k, v in secs.items() if v)
    rest = total - sum(secs.values())
    return f"{n} tokens: {total:.2f} s CPU ({n / total:.1f} tok per CPU s); {parts}, rest {rest:.2f}"


def by_hook_threads(model: NativeQwen35Model, n: int, threads: int) -> str:
    """One n-token forward at ``threads`` kernel threads: per hook, wall seconds and process CPU seconds."""
    rng = np.random.default_rng(0)
    wall = hook_seconds(model, time.perf_counter)
    proc = hook_seconds(model, time.process_time)
    model.forward(rng.integers(0, model.hp.n_vocab, 4), SequenceState.new(model.hp, n + 8))
    for secs in (wall, proc):
        secs.update(dict.fromkeys(HOOKS, 0.0))
    w0, p0 = time.perf_counter(), time.process_time()
    model.forward(rng.integers(0, model.hp.n_vocab, n), SequenceState.new(model.hp, n + 8))
    w, p = time.perf_counter() - w0, time.process_time() - p0
    wall["rest"], proc["rest"] = w - sum(wall.values()), p - sum(proc.values())
    parts = ", ".join(f"{k} {wall[k]:.2f} / {proc[k]:.2f} ({proc[k] / wall[k]:.2f})" for k in wall if wall[k] > 0)
    return (f"{n} tokens: {w:.2f} s wall, {p:.2f} s CPU ({n / w:.1f} tok/s, {p / w:.2f} threads busy); "
            f"wall / CPU (busy) by hook: {parts}")


def by_depth(model: NativeQwen35Model, piece: int = 256, deep: int = 9984) -> str:
    rng = np.random.default_rng(0)
    state = SequenceState.new(model.hp, deep + piece)
    for arrays in (state.k, state.v, state.conv, state.ssm):
        for a in arrays.values():
            a[...] = rng.standard_normal(a.shape).astype(np.float32) * 0.1
    tokens = rng.integers(0, model.hp.n_vocab, piece)
    model.forward(tokens[:8], state)
    best = {}
    for depth in (0, deep, 0, deep):
        state.pos = depth
        t0 = time.thread_time()
        model.forward(tokens, state)
        best[depth] = min(best.get(depth, np.inf), time.thread_time() - t0)
    slope = (best[deep] - best[0]) / deep
    short, long = best[0] + slope * (2048 - piece) / 2, best[0] + slope * (10240 - piece) / 2   # mean piece depth
    return (f"{piece}-token piece: {best[0]:.2f} s CPU at depth 0, {best[deep]:.2f} at {deep}; projected "
            f"{piece / short:.1f} tok per CPU s at 2048, {piece / long:.1f} at 10240, ratio {short / long:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--depths", action="store_true", help="pieces at depth 0 and 9984 and the projected ratio")
    ap.add_argument("--weights", choices=("map", "ram"), default="map",
                    help="ram: read into memory, Q4_0 projections interleaved in place as the app does")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads; > 1: wall and process CPU by hook")
    args = ap.parse_args()
    cpu.set_threads(args.threads)
    gguf = open_text(args.model, args.weights)
    model = NativeQwen35Model(gguf.hparams, gguf.file, repack=args.weights == "ram")
    if args.threads > 1:
        line = by_hook_threads(model, args.tokens, args.threads)
    else:
        line = by_depth(model) if args.depths else by_hook(model, args.tokens)
    print(f"{os.path.basename(args.model)}, isa {cpu.isa()}, {args.threads} thread(s), {args.weights}: {line}; "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
