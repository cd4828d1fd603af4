"""Micro-benchmark of the CPU decode kernels (a script, not a test).

Prints, per thread count and ISA level, the Q4_0 GEMV weight-read rate in GB/s next to this
machine's measured streaming-read bandwidth (cpu.read_bandwidth: all threads reading a buffer of
the same size, larger than the last-level cache), in two shapes:
  * "big": one (rows, 2048) matrix of --mib MiB, one call (the kernel's own streaming rate; an LM head
    alone), Q4_0 or, with --big-type q6_k, Q6_K (the LM head of a Q4_K_M file);
  * "expert": the same bytes as 512 x 2048 matrices (one MoE expert's gate), one call each, as
    decode issues them (includes per-call overhead: Python, activation quantization, thread wake-up);
  * "moe": the fused one-token MoE FFN (cpu_moe.moe_ffn) over --moe-layers layers shaped like the
    35B-A3B slice llama.cpp was measured on in docs/perf/log/cpu-notes.md (d 2048, 64 experts of FFN
    512, top-8, a shared expert, Q4_0), one random token per layer in turn; GB/s counts the bytes a
    token touches (f32 router, 8 + 1 experts' gate/up/down);
  * "hot" (--hot): one thread, a --hot-kib matrix of each weight type that stays in the core's
    L2 cache, called over and over and timed in thread CPU time: the kernel's compute rate,
    which the machine's other work (memory traffic, a busy core) barely moves. A kernel streams
    at the DRAM bandwidth only if this rate is well above it.
Usage: python tests/bench/bench_kernels.py [--mib 1024] [--repeats 5] [--threads 1 2] [--moe-layers 8] [--hot]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe

Q4_0 = GGMLQuantizationType.Q4_0
Q4_0_BYTES = quant.type_size(Q4_0)
K = 2048
EXPERT_ROWS = 512
N_EXPERT, N_USED = 64, 8


def q4_0_weights_shaped(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 rows of k values (nibbles random, scales a normal f16 so no float assists)."""
    raw = rng.integers(0, 256, size=(rows, k // cpu.QK * Q4_0_BYTES), dtype=np.uint8)
    raw.reshape(rows, -1, Q4_0_BYTES)[..., :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return raw


def q4_0_weights(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """About nbytes of Q4_0 rows of K values, a whole number of expert-sized matrices."""
    rows = nbytes // (K // cpu.QK * Q4_0_BYTES) // EXPERT_ROWS * EXPERT_ROWS
    return q4_0_weights_shaped(rows, K, rng)


HOT_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
             GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
SCALE_OFFSETS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                 GGMLQuantizationType.Q6_K: (208,), GGMLQuantizationType.Q2_K: (80, 82),
                 GGMLQuantizationType.Q3_K: (108,)}
"""Byte offsets of a block's f16 scales (ggml-common.h); every other type has one at 0."""


def random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random (rows, row bytes) blocks of qtype, every f16 scale a normal 0.01 (no float assists)."""
    bsize = quant.type_size(qtype)
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, k)), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, bsize)
    for off in SCALE_OFFSETS.get(qtype, (0,)):
        blocks[..., off:off + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return raw


def hot_rates(kib: int, calls: int, rng: np.random.Generator) -> None:
    """Print the in-cache GEMV rate of each weight type at each ISA level, one thread."""
    x = rng.standard_normal(K).astype(np.float32)
    cpu.set_threads(1)
    print(f"hot: {kib} KiB matrices (k={K}), {calls} calls a measurement, best of 5, thread CPU time, 1 thread")
    print(f"{'type':>5} " + " ".join(f"{level:>12}" for level in cpu.supported_isas()) + "   (GB/s, ns per row)")
    for qtype in HOT_TYPES:
        raw = random_blocks(qtype, max(4, (kib << 10) // quant.row_bytes(qtype, K)), K, rng)
        cells = []
        for level in cpu.supported_isas():
            cpu.set_isa(level)
            best = float("inf")
            for _ in range(5):
                t0 = time.thread_time()
                for _ in range(calls):
                    cpu.matmul(raw, x, qtype)
                best = min(best, (time.thread_time() - t0) / calls)
            cells.append(f"{raw.nbytes / best / 1e9:5.1f} {best * 1e9 / raw.shape[0]:5.0f}ns")
        print(f"{qtype.name:>5} " + " ".join(f"{c:>12}" for c in cells))
    cpu.set_isa(None)
    cpu.set_threads()


def moe_layers(n: int, rng: np.random.Generator) -> list[cpu_moe.MoEWeights]:
    def q4(rows: int, k: int) -> np.ndarray:
        return q4_0_weights_shaped(rows, k, rng)
    return [cpu_moe.MoEWeights(router=rng.standard_normal((N_EXPERT, K)).astype(np.float32) * 0.05,
                           gate=q4(N_EXPERT * EXPERT_ROWS, K), up=q4(N_EXPERT * EXPERT_ROWS, K),
                           down=q4(N_EXPERT * K, EXPERT_ROWS), n_used=N_USED, qtypes=Q4_0,
                           sh_gate=q4(EXPERT_ROWS, K), sh_up=q4(EXPERT_ROWS, K), sh_down=q4(K, EXPERT_ROWS),
                           sh_gate_inp=rng.standard_normal(K).astype(np.float32) * 0.05) for _ in range(n)]


def moe_token_seconds(layers: list[cpu_moe.MoEWeights], tokens: np.ndarray) -> float:
    """Mean seconds per layer-token, cycling through the layers so weights come from memory."""
    start = time.perf_counter()
    for t, x in enumerate(tokens):
        cpu_moe.moe_ffn(x, layers[t % len(layers)])
    return (time.perf_counter() - start) / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="weight bytes streamed per measurement (> last-level cache)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, cpu.physical_cores()}))
    ap.add_argument("--moe-layers", type=int, default=8, help="0 skips the fused MoE measurement")
    ap.add_argument("--hot", action="store_true", help="only the in-cache rate of each weight type")
    ap.add_argument("--hot-kib", type=int, default=1024, help="matrix size for --hot (fits the L2 cache)")
    ap.add_argument("--hot-calls", type=int, default=200)
    ap.add_argument("--big-type", choices=("q4_0", "q6_k"), default="q4_0",
                    help="weight type of the 'big' matrix (q6_k: the LM head of a Q4_K_M file)")
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("native kernels not built: nothing to measure")

    rng = np.random.default_rng(0)
    if args.hot:
        hot_rates(args.hot_kib, args.hot_calls, rng)
        return
    raw = q4_0_weights(args.mib << 20, rng)
    big_type = GGMLQuantizationType[args.big_type.upper()]
    big_raw = raw if big_type == Q4_0 else random_blocks(big_type, raw.nbytes // quant.row_bytes(big_type, K), K, rng)
    x = rng.standard_normal(K).astype(np.float32)
    experts = [raw[i:i + EXPERT_ROWS] for i in range(0, raw.shape[0], EXPERT_ROWS)]
    print(f"weights: {raw.nbytes / 2**20:.0f} MiB Q4_0 "
          f"('big': {big_raw.nbytes / 2**20:.0f} MiB {big_type.name}), k={K}; "
          f"{len(experts)} expert-sized matrices; "
          f"ISAs: {', '.join(cpu.supported_isas())}; physical cores: {cpu.physical_cores()}")
    layers = moe_layers(args.moe_layers, rng)
    tokens = rng.standard_normal((max(64, 8 * args.moe_layers), K)).astype(np.float32)
    row = K // cpu.QK * Q4_0_BYTES
    moe_bytes = N_EXPERT * K * 4 + (N_USED + 1) * 3 * EXPERT_ROWS * row
    if layers:
        total = sum(a.nbytes for w in layers for a in w if isinstance(a, np.ndarray))
        print(f"moe: {args.moe_layers} layers, {total / 2**20:.0f} MiB; "
              f"{moe_bytes / 2**20:.1f} MiB touched per layer-token")
    print(f"{'threads':>7} {'stream read':>12} {'isa':>11} {'big GB/s':>9} {'% stream':>8} "
          f"{'expert GB/s':>11} {'% stream':>8} {'moe us/layer':>12} {'GB/s':>6} {'% stream':>8}")
    for n in args.threads:
        cpu.set_threads(n)
        bw = cpu.read_bandwidth(raw.nbytes, args.repeats)
        for level in cpu.supported_isas():
            cpu.set_isa(level)
            big = big_raw.nbytes / cpu.best_seconds(lambda: cpu.matmul(big_raw, x, big_type), args.repeats) / 1e9
            each = raw.nbytes / cpu.best_seconds(lambda: [cpu.matmul_q4_0(w, x) for w in experts], args.repeats) / 1e9
            line = (f"{n:>7} {bw:>9.1f} GB/s {level:>11} {big:>9.1f} {100 * big / bw:>7.0f}% "
                    f"{each:>11.1f} {100 * each / bw:>7.0f}%")
            if layers:
                moe = min(moe_token_seconds(layers, tokens) for _ in range(args.repeats))
                line += f" {moe * 1e6:>12.0f} {moe_bytes / moe / 1e9:>6.1f} {100 * moe_bytes / moe / 1e9 / bw:>7.0f}%"
            print(line)
    cpu.set_isa(None)
    cpu.set_threads()


if __name__ == "__main__":
    main()
