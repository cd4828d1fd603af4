"""Micro-benchmark (a script, not a test): GEMV of Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS weights read as
stored (native/cpu/quant/bquants.h) against the old route, the same weights converted to Q8_0 at load
(engine.arch.qwen35.cpu.to_q8_0) and multiplied by the Q8_0 kernel.

For each ISA level and type: a (--rows, 2048) matrix of random blocks (every f16 scale a normal 0.01,
so no float assists), one-token products (m = 1) on --threads threads, the two variants timed in
turn (old, new, old, new, ...) for --rounds rounds of --calls calls each; prints ns per weight row
(median, min-max over rounds) of each, their ratio, and the GB/s each reads. One thread is timed in
the thread's CPU time (the kernels then run on the calling thread), more in wall time. The 1-minute
load average is printed before and after: figures taken on a busy machine are not final.
Usage: python tests/bench/bench_bquants.py [--rows 16384] [--rounds 7] [--calls 10] [--threads 1]
    [--isa avx2 avx512vnni]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.arch.qwen35.cpu import to_q8_0
from engine.kernels import cpu

Q = GGMLQuantizationType
TYPES = (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS)
K = 2048


def random_blocks(qtype: GGMLQuantizationType, rows: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes of K values) random blocks of qtype, its f16 d (and m) all 0.01."""
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, K)), dtype=np.uint8)
    b = raw.view(quant.BLOCK_DTYPES[qtype])
    for field in ("d", "m"):
        if field in b.dtype.names:
            b[field] = 0.01
    return raw


def timed(mat: cpu.Matrix, x: np.ndarray, calls: int, clock) -> float:
    """Seconds per call, over `calls` calls."""
    start = clock()
    for _ in range(calls):
        mat(x)
    return (clock() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", nargs="+", default=[i for i in ("avx2", "avx512vnni") if i in cpu.supported_isas()])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cpu.set_threads(args.threads)
    x = rng.standard_normal((1, K)).astype(np.float32)
    # one thread: the kernels run on the caller, so its CPU time is the kernel's, whatever else the machine runs
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"load {os.getloadavg()[0]:.2f}, rows {args.rows} x k {K}, {args.threads} thread(s), m = 1, "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time")
    print(f"{'isa':<11} {'type':<7} {'old Q8_0 ns/row':>22} {'new ns/row':>22} {'new/old':>8} "
          f"{'GB/s old':>9} {'new':>6}")
    for level in args.isa:
        cpu.set_isa(level)
        for qtype in TYPES:
            raw = random_blocks(qtype, args.rows, rng)
            new = cpu.Matrix(raw, K, qtype)
            old = cpu.Matrix(to_q8_0(raw, qtype, K), K, Q.Q8_0)
            new(x), old(x)                                      # warm-up: pages touched, pool awake
            t_old, t_new = [], []
            for _ in range(args.rounds):
                t_old.append(timed(old, x, args.calls, clock))
                t_new.append(timed(new, x, args.calls, clock))
            o, n = np.array(t_old) / args.rows * 1e9, np.array(t_new) / args.rows * 1e9

            def fmt(v):
                return f"{np.median(v):.2f} ({v.min():.2f}-{v.max():.2f})"
            print(f"{level:<11} {qtype.name:<7} {fmt(o):>22} {fmt(n):>22} {np.median(n / o):>8.2f} "
                  f"{old.raw.nbytes / np.median(o) / args.rows:>9.1f} "
                  f"{new.raw.nbytes / np.median(n) / args.rows:>6.1f}")
    print(f"load {os.getloadavg()[0]:.2f}")
    cpu.set_isa(None)


if __name__ == "__main__":
    main()
