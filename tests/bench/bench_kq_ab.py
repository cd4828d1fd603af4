"""A/B of the K-quant GEMV tiles between builds, in cache (a script, not a test).

    python tests/bench/bench_kq_ab.py OLD.so,NEW.so [--types q4_k q6_k] [--kib 1024] [--rounds 9] [--isa 3]

Loads each build of the native library (``engine/_native_cpu.abi3.so``, or one built with gcc from
native/cpu) from its own copy and calls ``dd_matmul(isa, type, ...)`` with one column (a decode GEMV)
on a --kib matrix of random blocks (k = 2048, every f16 scale a normal 0.01, as bench_kernels.py's
--hot) that stays in the core's L2 cache, at 1 thread. Per round, each build runs --calls calls in
turn, timed in the calling thread's CPU time (``time.thread_time``), so load from other processes
moves both builds alike. Prints per type and build the median over rounds of ns per row and GB/s of
weights, the median of the per-round ratios old / new, whether every build gave the same output bits,
and the load average.
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

K = 2048
TYPES = {"q4_k": (2, 144, (0, 2)), "q5_k": (3, 176, (0, 2)), "q6_k": (4, 210, (208,))}
"""name -> (DD_* weight type, super-block bytes, byte offsets of its f16 scales)"""


def blocks(name: str, kib: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Random rows of k = K values of type name, about kib KiB; (raw bytes, rows)."""
    _, size, offsets = TYPES[name]
    rows = max(4, (kib << 10) // (K // 256 * size))
    raw = rng.integers(0, 256, size=(rows, K // 256, size), dtype=np.uint8)
    for off in offsets:
        raw[..., off:off + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(rows, -1)), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", help="comma-separated paths of native library builds")
    ap.add_argument("--types", nargs="+", default=["q4_k", "q6_k"], choices=sorted(TYPES))
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--isa", type=int, default=3, help="DD_ISA_* level (3: AVX-512 VNNI)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(K).astype(np.float32)
    paths = args.builds.split(",")
    with tempfile.TemporaryDirectory() as folder:
        libs = []
        for i, path in enumerate(paths):
            copy = os.path.join(folder, f"build{i}.so")
            shutil.copy(path, copy)
            lib = ctypes.CDLL(copy)
            lib.dd_set_threads(1)
            lib.dd_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libs.append(lib)
        print(f"load before: {os.getloadavg()[0]:.2f}; {args.kib} KiB matrices, k={K}, {args.calls} calls a "
              f"sample, {args.rounds} rounds, isa {args.isa}, 1 thread, thread CPU time")
        for name in args.types:
            raw, rows = blocks(name, args.kib, rng)
            ys = [np.empty(rows, np.float32) for _ in libs]
            times: list[list[float]] = [[] for _ in libs]
            for _ in range(args.rounds):
                for lib, y, t in zip(libs, ys, times):
                    t0 = time.thread_time()
                    for _ in range(args.calls):
                        rc = lib.dd_matmul(args.isa, TYPES[name][0], raw.ctypes.data, rows, K, x.ctypes.data, 1,
                                           y.ctypes.data)
                    t.append((time.thread_time() - t0) / args.calls / rows * 1e9)
                    assert rc == 0
            same = all(np.array_equal(ys[0].view(np.uint32), y.view(np.uint32)) for y in ys[1:])
            cells = [f"{statistics.median(t):7.2f} ns/row ({raw.nbytes / rows / statistics.median(t):5.2f} GB/s)"
                     for t in times]
            ratios = [statistics.median([a / b for a, b in zip(times[0], t)]) for t in times[1:]]
            print(f"{name}: " + " | ".join(cells) + "  first/other per round: "
                  + ", ".join(f"{r:.3f}" for r in ratios) + f"  same bits: {same}")
        print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
