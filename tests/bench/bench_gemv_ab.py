"""A/B of the native GEMV (one-token matrix product) between builds (a script, not a test).

    python tests/bench/bench_gemv_ab.py OLD.so,NEW.so [--type q4_0] [--mib 1024] [--threads 1] [--rounds 7]
        [--isa 3] [--cols 1] [--k 2048] [--cpu] [--interleaved] [--repeat 1]

Each argument is a copy of ``engine/_native_cpu.abi3.so`` (copy a build aside before rebuilding). The script loads
every copy with ctypes and times ``dd_matmul`` with one activation row (decode's shape) on one random matrix of
--mib MiB of the given weight type, k = --k values a row (bench_kernels.random_blocks: random bytes, every f16
scale 0.01), far larger than the caches, so the weights come from DRAM as an LM head's do. The builds run
interleaved round by round on the same inputs. It prints each build's median wall-clock read rate in GB/s with the
spread, the same in the calling thread's CPU time (all the work at --threads 1, so a rate less disturbed by a busy
machine), each later build's speed against the first's round by round (the median and quartiles of the rounds'
ratios: a drift of the machine between rounds cancels), whether every build gave the same output bits, and the load
average before and after (figures from a loaded machine are not final). ``--cols 32`` times prefill's shape instead
(32 activation rows, an expert's share of a 512-token prompt) and reports GMAC/s; use a small --mib then, so the
product is bound by the kernel, not by DRAM, and ``--repeat`` calls per timed sample. ``--cpu`` times process CPU
time instead of wall time (less disturbed by a loaded machine; with --threads 1 it is the kernel's own time). Each
build's median milliseconds per call are printed beside its rate, and the calling thread's CPU time per block of
the type (a K-quant's super-block). ``--interleaved`` (Q4_0, MXFP4, Q4_K, Q2_K, Q3_K) adds, for each build, a
second row: ``dd_matmul`` of the row-grouped layout's kernel type (``DD_Q4_0_IL``, ``DD_MXFP4_IL``, ``DD_Q4_K_IL``,
``DD_Q2_K_RL``, ``DD_Q3_K_RL``) on a copy of the matrix repacked by ``dd_q4_0_interleave``
(``dd_mxfp4_interleave``, ``dd_q4_k_interleave``, ``dd_q2_k_rl_pack``, ``dd_q3_k_rl_pack``;
docs/design/q4-0-row-interleave.md, mxfp4-interleave.md, q4-k-row-interleave.md, quant-formats.md), timed in the
same rounds (with --cols > 1: the layout's prefill product, or the row-major one on unpacked rows).
docs/perf/log/cpu-notes.md, "Weight prefetches into L2", used it.
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
from gguf import GGMLQuantizationType

from bench_kernels import K, random_blocks
from engine.gguf import quant
from engine.kernels.cpu_twins import IL_TRAITS, RL_TRAITS
from engine.kernels.iq_twins import grids as iq_grids


def load(path: str, folder: str, index: int, threads: int) -> ctypes.CDLL:
    """A private copy of the build at ``path`` (so that two builds can be loaded side by side)."""
    copy = os.path.join(folder, f"build{index}.so")
    shutil.copy(path, copy)
    lib = ctypes.CDLL(copy)
    lib.dd_set_threads(threads)
    for qtype, grid in iq_grids().items():   # the IQ kernels' codebooks, as engine.kernels.cpu registers them
        lib.dd_set_iq_grid(quant.TYPES[qtype].cpu_kernel, ctypes.c_void_p(grid.ctypes.data), ctypes.c_size_t(grid.size))
    lib.dd_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


# stored type -> (the in-place repack's symbol, the kernel type of the repacked rows)
REPACKS = {**{t: (f"dd_{t.name.lower()}_interleave", traits.cpu_kernel) for t, traits in IL_TRAITS.items()},
           **{t: (f"dd_{t.name.lower()}_rl_pack", traits.cpu_kernel) for t, traits in RL_TRAITS.items()}}


def variants(libs: list[ctypes.CDLL], paths: list[str], args, isa: int, qtype: GGMLQuantizationType, w: np.ndarray,
             x: np.ndarray, rows: int, k: int) -> tuple[list[str], list]:
    """(labels, calls): each build's dd_matmul, and with --interleaved its dd_matmul of the repacked type (REPACKS)
    on a repacked copy."""
    labels, calls = [], []
    packed, kernel = None, quant.TYPES[qtype].cpu_kernel
    if args.interleaved:
        symbol, il_kernel = REPACKS[qtype]
        packed = w.copy()
        if getattr(libs[0], symbol)(ctypes.c_void_p(packed.ctypes.data), ctypes.c_size_t(rows),
                                    ctypes.c_size_t(w.shape[1])) != 0:
            raise SystemExit(f"{symbol} failed")
    for lib, path in zip(libs, paths):
        labels.append(path)
        calls.append(lambda out, lib=lib: lib.dd_matmul(isa, kernel, w.ctypes.data, rows, k, x.ctypes.data,
                                                        args.cols, out.ctypes.data))
        if packed is not None:
            labels.append(f"{path} interleaved")
            calls.append(lambda out, lib=lib: lib.dd_matmul(isa, il_kernel, packed.ctypes.data, rows, k,
                                                            x.ctypes.data, args.cols, out.ctypes.data))
    return labels, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", help="comma-separated paths of _native_cpu.abi3.so copies; the first is the base")
    ap.add_argument("--type", default="q4_0", help="weight type, a GGML name (q4_0, q8_0, q4_k, q5_k, q6_k, ...)")
    ap.add_argument("--mib", type=float, default=1024, help="matrix size in MiB (0.25: in a 1 MiB L2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", type=int, default=-1, help="DD_ISA_* level (default: the best this CPU runs)")
    ap.add_argument("--cols", type=int, default=1, help="activation rows (1: decode's GEMV; > 1: a prefill GEMM)")
    ap.add_argument("--k", type=int, default=K, help="values a row, a multiple of the type's block (512: expert down)")
    ap.add_argument("--cpu", action="store_true", help="time process CPU time instead of wall time")
    ap.add_argument("--repeat", type=int, default=1,
                    help="calls per timed sample (an in-cache --mib 1 call is ~0.1 ms: repeat it to time ~10 ms)")
    ap.add_argument("--interleaved", action="store_true",
                    help="also time the repacked product (Q4_0, MXFP4, Q4_K, Q2_K, Q3_K)")
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1 call per sample")
    if args.interleaved and args.type.upper() not in {t.name for t in REPACKS}:
        raise SystemExit("--interleaved: only for --type q4_0, mxfp4, q4_k, q2_k or q3_k")
    try:
        qtype = GGMLQuantizationType[args.type.upper()]
    except KeyError:
        raise SystemExit(f"--type {args.type}: not a GGML quant type name (q4_0, q4_k, q6_k, ...)") from None
    kernel = quant.traits(qtype, "bench_gemv_ab").cpu_kernel
    if kernel is None:
        raise SystemExit(f"{args.type}: no native kernel reads this type as stored")
    k = args.k
    rows = int(args.mib * 2**20) // quant.row_bytes(qtype, k)
    rng = np.random.default_rng(0)
    w = random_blocks(qtype, rows, k, rng)
    x = rng.standard_normal((args.cols, k)).astype(np.float32) + np.float32(0.1)
    paths = args.builds.split(",")
    load_before = os.getloadavg()[0]
    clock = time.process_time if args.cpu else time.perf_counter
    with tempfile.TemporaryDirectory() as folder:
        libs = [load(p, folder, i, args.threads) for i, p in enumerate(paths)]
        isa = libs[0].dd_isa_best() if args.isa < 0 else args.isa
        labels, calls = variants(libs, paths, args, isa, qtype, w, x, rows, k)
        outs = [np.empty((args.cols, rows), np.float32) for _ in calls]
        times: list[list[float]] = [[] for _ in calls]
        cpu_times: list[list[float]] = [[] for _ in calls]
        for _ in range(args.rounds):
            for call, out, t, c in zip(calls, outs, times, cpu_times):
                t0, c0 = clock(), time.thread_time()
                rcs = [call(out) for _ in range(args.repeat)]
                t.append((clock() - t0) / args.repeat)
                c.append((time.thread_time() - c0) / args.repeat)
                if any(rcs):
                    raise SystemExit(f"the product returned {max(rcs, key=abs)}")
    same = all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs[1:])
    print(f"{args.type} {w.nbytes / 2**20:.4g} MiB (k={k}), isa {isa}, {args.threads} thread(s), {args.rounds} "
          f"rounds, {args.cols} column(s), {'CPU' if args.cpu else 'wall'} time, load {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; same bits: {same}")
    blocks = rows * k / quant.TYPES[qtype].block_values
    per_s, unit = (w.nbytes / 1e9, "GB/s") if args.cols == 1 else (rows * k * args.cols / 1e9, "GMAC/s")
    per_build = len(calls) // len(paths)   # 2 with --interleaved: each build's row-major and repacked product
    for i, (path, t, c) in enumerate(zip(labels, times, cpu_times)):
        rates, cpu_rates = [per_s / s for s in t], [per_s / s for s in c]
        print(f"  {path}: median {statistics.median(rates):.1f} {unit} ({min(rates):.1f}-{max(rates):.1f}), "
              f"{statistics.median(t) * 1e3:.1f} ms; calling thread CPU {statistics.median(cpu_rates):.1f} "
              f"({min(cpu_rates):.1f}-{max(cpu_rates):.1f}), {statistics.median(c) * 1e9 / blocks:.2f} ns a block"
              + ("" if i < per_build else f"; speed / {labels[i % per_build]}, round by round "
                 f"{paired(times[i % per_build], t)}"))


def paired(base: list[float], other: list[float]) -> str:
    """Median (quartiles) of base[r] / other[r]: round r's speed ratio, both timed within the round, so a drift of
    the machine between rounds (a shared VM's memory read moves by tens of percent) cancels."""
    ratios = [b / o for b, o in zip(base, other)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})"


if __name__ == "__main__":
    main()
