"""Micro-benchmark of the CPU decode kernels (a script, not a test).

Prints, per thread count and ISA level, the Q4_0 GEMV weight-read rate in GB/s next to this
machine's measured streaming-read bandwidth (all threads reading one buffer larger than the
last-level cache), in two shapes:
  * "big": one (rows, 2048) matrix of --mib MiB, one call (the kernel's own streaming rate);
  * "expert": the same bytes as 512 x 2048 matrices (one MoE expert's gate), one call each, as
    decode issues them (includes per-call overhead: Python, activation quantization, thread wake-up).
Usage: python tests/bench_kernels.py [--mib 1024] [--repeats 5] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.backends import cpu

K = 2048
EXPERT_ROWS = 512


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def q4_0_weights(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 rows of K values (nibbles random, scales a normal f16 so no float assists)."""
    row_bytes = K // cpu.QK * cpu.Q4_0_BYTES
    rows = nbytes // row_bytes // EXPERT_ROWS * EXPERT_ROWS
    raw = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, cpu.Q4_0_BYTES)
    blocks[..., :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return raw


def stream_read_gbps(buf: np.ndarray, repeats: int) -> float:
    lib, ffi = cpu._native_cpu.lib, cpu._native_cpu.ffi
    ptr = ffi.cast("uint8_t *", ffi.from_buffer(buf))
    return buf.nbytes / best_seconds(lambda: lib.dd_stream_read(ptr, buf.nbytes), repeats) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="weight bytes streamed per measurement (> last-level cache)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, cpu.physical_cores()}))
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("native kernels not built: nothing to measure")

    rng = np.random.default_rng(0)
    raw = q4_0_weights(args.mib << 20, rng)
    x = rng.standard_normal(K).astype(np.float32)
    experts = [raw[i:i + EXPERT_ROWS] for i in range(0, raw.shape[0], EXPERT_ROWS)]
    print(f"weights: {raw.nbytes / 2**20:.0f} MiB Q4_0, k={K}; {len(experts)} expert-sized matrices; "
          f"ISAs: {', '.join(cpu.supported_isas())}; physical cores: {cpu.physical_cores()}")
    print(f"{'threads':>7} {'stream read':>12} {'isa':>11} {'big GB/s':>9} {'% stream':>8} "
          f"{'expert GB/s':>11} {'% stream':>8}")
    for n in args.threads:
        cpu.set_threads(n)
        bw = stream_read_gbps(raw, args.repeats)
        for level in cpu.supported_isas():
            cpu.set_isa(level)
            big = raw.nbytes / best_seconds(lambda: cpu.matmul_q4_0(raw, x), args.repeats) / 1e9
            each = raw.nbytes / best_seconds(lambda: [cpu.matmul_q4_0(w, x) for w in experts], args.repeats) / 1e9
            print(f"{n:>7} {bw:>9.1f} GB/s {level:>11} {big:>9.1f} {100 * big / bw:>7.0f}% "
                  f"{each:>11.1f} {100 * each / bw:>7.0f}%")
    cpu.set_isa(None)
    cpu.set_threads()


if __name__ == "__main__":
    main()
