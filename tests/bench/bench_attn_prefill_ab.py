"""A/B of the native attention prefill between builds (a script, not a test).

    python tests/bench/bench_attn_prefill_ab.py OLD.so,NEW.so [--depth 10240] [--rounds 9] [--isa 3] [--threads 1]

Each argument is a copy of ``engine/_native_cpu.abi3.so`` (copy a build aside before rebuilding). The
script loads every copy with ctypes and times ``dd_attn_prefill`` for one piece of 256 queries whose
last position is at depth - 1 (the minicpmv46 / Qwen3.5-0.8B attention layer: 8 q heads, 2 kv heads,
head dim 256; standard normal q, gate, k, v), the builds interleaved round by round on the same inputs.
It reports each build's median of the calling thread's CPU time (``time.thread_time``: at 1 thread the
whole call runs on it, so other processes on a shared machine disturb it less than wall time), the
ratio to the first build, whether every build gave the same output bits, and the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

N_HEAD, N_KV, HD, PIECE = 8, 2, 256, 256


def load(path: str, folder: str, index: int, threads: int) -> ctypes.CDLL:
    """A private copy of the build at ``path`` (so that two builds can be loaded side by side)."""
    copy = os.path.join(folder, f"build{index}.so")
    shutil.copy(path, copy)
    lib = ctypes.CDLL(copy)
    lib.dd_set_threads(threads)
    lib.dd_attn_prefill.argtypes = [ctypes.c_int] + [ctypes.c_size_t] * 4 + [ctypes.c_void_p] * 4 + [
        ctypes.c_size_t, ctypes.c_void_p]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", help="comma-separated paths of _native_cpu.abi3.so copies; the first is the base")
    ap.add_argument("--depth", type=int, default=10240, help="cache rows after the piece (>= 256)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--isa", type=int, default=-1, help="DD_ISA_* level (default: the best this CPU runs)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    paths = args.builds.split(",")
    rng = np.random.default_rng(1)
    q, gate = (rng.standard_normal((PIECE, N_HEAD, HD)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((args.depth, N_KV, HD)).astype(np.float32) for _ in range(2))
    outs = [np.empty((PIECE, N_HEAD, HD), np.float32) for _ in paths]
    times: list[list[float]] = [[] for _ in paths]
    with tempfile.TemporaryDirectory() as folder:
        libs = [load(p, folder, i, args.threads) for i, p in enumerate(paths)]
        isa = libs[0].dd_isa_best() if args.isa < 0 else args.isa
        ptrs = [a.ctypes.data for a in (q, gate, k, v)]
        for _ in range(args.rounds):
            for lib, out, t in zip(libs, outs, times):
                t0 = time.thread_time()
                rc = lib.dd_attn_prefill(isa, N_HEAD, N_KV, HD, PIECE, *ptrs, args.depth, out.ctypes.data)
                t.append(time.thread_time() - t0)
                if rc != 0:
                    raise SystemExit(f"dd_attn_prefill returned {rc}")
    same = all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs[1:])
    base = statistics.median(times[0])
    print(f"depth {args.depth}, isa {isa}, {args.threads} thread(s), {args.rounds} rounds, load "
          f"{os.getloadavg()[0]:.2f}; same bits: {same}")
    for path, t in zip(paths, times):
        med = statistics.median(t)
        print(f"  {path}: median {med * 1e3:.1f} ms CPU, ratio {med / base:.3f}  "
              f"({' '.join(f'{x * 1e3:.0f}' for x in t)})")


if __name__ == "__main__":
    main()
