"""A/B of the native attention decode's per-level copies between builds (a script, not a test).

    python tests/bench/bench_attn_decode_ab.py OLD.so,NEW.so [--depth 10240] [--rounds 31] [--threads 1]

``dd_attn_decode`` runs only the best level's copy of the kernel, so this script calls each copy by its
symbol in the extension (``attn_decode_avx2``, ``attn_decode_avx512``; those this CPU runs) through
ctypes, with every build loaded from its own copy: one query at position depth - 1 of the minicpmv46 /
Qwen3.5-0.8B attention layer (8 q heads, 2 kv heads, head dim 256; standard normal q, gate, k, v), the
builds and copies interleaved round by round on the same inputs. It reports the median of the calling
thread's CPU time (``time.thread_time``) per build and copy, whether all of them gave the same output
bits, and the load average.
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

N_HEAD, N_KV, HD = 8, 2, 256
COPIES = {2: "attn_decode_avx2", 3: "attn_decode_avx512"}   # DD_ISA_* level -> symbol


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", help="comma-separated paths of _native_cpu.abi3.so copies")
    ap.add_argument("--depth", type=int, default=10240, help="cache rows (the query sits at the last)")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    q, gate = (rng.standard_normal((N_HEAD, HD)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((args.depth, N_KV, HD)).astype(np.float32) for _ in range(2))
    ptrs = [a.ctypes.data for a in (q, gate, k, v)]
    with tempfile.TemporaryDirectory() as folder:
        fns = {}
        for i, path in enumerate(args.builds.split(",")):
            copy = os.path.join(folder, f"build{i}.so")
            shutil.copy(path, copy)
            lib = ctypes.CDLL(copy)
            lib.dd_set_threads(args.threads)
            for level, name in COPIES.items():
                if lib.dd_isa_supported(level):
                    fn = getattr(lib, name)
                    fn.argtypes = [ctypes.c_size_t] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_void_p]
                    fns[(path, name)] = fn
        outs = {key: np.empty(N_HEAD * HD, np.float32) for key in fns}
        times: dict[tuple[str, str], list[float]] = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                t0 = time.thread_time()
                rc = fn(N_HEAD, N_KV, HD, *ptrs, args.depth, outs[key].ctypes.data)
                times[key].append(time.thread_time() - t0)
                if rc != 0:
                    raise SystemExit(f"{key[1]} returned {rc}")
    first = next(iter(outs.values()))
    same = all(np.array_equal(first.view(np.uint32), o.view(np.uint32)) for o in outs.values())
    print(f"depth {args.depth}, {args.threads} thread(s), {args.rounds} rounds, load {os.getloadavg()[0]:.2f}; "
          f"same bits: {same}")
    for (path, name), t in times.items():
        print(f"  {path} {name}: median {statistics.median(t) * 1e3:.2f} ms CPU")


if __name__ == "__main__":
    main()
