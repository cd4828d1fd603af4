"""A/B of the native Gated DeltaNet decode step between builds (a script, not a test).

    python tests/bench/bench_gdn_ab.py OLD.so,NEW.so [--threads 2] [--layers 120] [--calls 15] [--rounds 12]

Each argument is a copy of ``engine/_native_cpu.abi3.so`` (copy a build aside before rebuilding), loaded side
by side with ctypes. A round calls ``dd_gdn_decode`` once on each of --layers layer states of the 35B-A3B shape
(16 k-heads, 32 v-heads, 128 x 128 delta-rule state: 2 MiB a layer, so 120 layers stream from DRAM as a decode
token's 30 GDN layers of four streams do), --calls times over, for every build in turn (the order alternating by
round). Each build keeps its own states, updated in place, from the same start and inputs. Prints each build's
median milliseconds per layer call with the spread, the state bytes read and written per second, the median of
the per-round ratio to the first build, whether every build ended with the same state bits, and the load average
before and after. The conv weights are passed tap-major (``GDNLayer.conv_taps``): a build older than that layout
reads them as (conv_dim, K), times the same work and ends with other state bits. docs/perf/log/gdn-2026-12-06.md
used it.
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

N_K, N_V, DK, DV, K = 16, 32, 128, 128, 4
C = 2 * N_K * DK + N_V * DV


class GDNLayer(ctypes.Structure):
    """deltadesk_cpu.h's dd_gdn_layer."""
    _fields_ = [("n_k", ctypes.c_size_t), ("n_v", ctypes.c_size_t), ("dk", ctypes.c_size_t), ("dv", ctypes.c_size_t),
                ("conv_kernel", ctypes.c_size_t), ("conv_w", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("ssm_a", ctypes.c_void_p), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_double)]


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", help="comma-separated copies of _native_cpu.abi3.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=120)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    taps = (rng.standard_normal((K, C)) * 0.3).astype(np.float32)   # tap-major, as GDNLayer.conv_taps
    dt_bias, ssm_a = rng.standard_normal(N_V).astype(np.float32), -np.exp(rng.standard_normal(N_V)).astype(np.float32)
    norm_w = np.ones(DV, np.float32)
    layer = GDNLayer(N_K, N_V, DK, DV, K, ptr(taps), ptr(dt_bias), ptr(ssm_a), ptr(norm_w), 1e-6)
    inputs = [rng.standard_normal(n).astype(np.float32) for n in (C, N_V * DV, N_V, N_V)]   # mixed, z, b, a
    start = (rng.standard_normal((N_V, DK, DV)) * 0.01).astype(np.float32)
    paths = args.builds.split(",")
    with tempfile.TemporaryDirectory() as folder:
        libs = []
        for i, path in enumerate(paths):
            shutil.copy(path, os.path.join(folder, f"build{i}.so"))
            lib = ctypes.CDLL(os.path.join(folder, f"build{i}.so"))
            lib.dd_set_threads(args.threads)
            lib.dd_gdn_decode.argtypes = [ctypes.POINTER(GDNLayer)] + [ctypes.c_void_p] * 7
            states = [(np.zeros((K - 1, C), np.float32), start.copy()) for _ in range(args.layers)]
            libs.append((lib, states, np.empty(N_V * DV, np.float32)))
        times: list[list[float]] = [[] for _ in paths]
        load0 = os.getloadavg()[0]
        for r in range(args.rounds):
            for i in (range(len(paths)) if r % 2 == 0 else reversed(range(len(paths)))):
                lib, states, y = libs[i]
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    for conv, ssm in states:
                        if lib.dd_gdn_decode(ctypes.byref(layer), *map(ptr, inputs), ptr(conv), ptr(ssm), ptr(y)):
                            raise SystemExit(f"{paths[i]}: dd_gdn_decode failed")
                times[i].append((time.perf_counter() - t0) * 1e3 / (args.calls * args.layers))
        same = all(all(np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0]) for a, b in zip(libs[0][1], lib[1]))
                   for lib in libs[1:])
        print(f"{args.rounds} rounds x {args.calls} calls x {args.layers} layers, {args.threads} threads, "
              f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; same state bits: {same}")
        for path, t in zip(paths, times):
            med = statistics.median(t)
            ratio = statistics.median(a / b for a, b in zip(t, times[0]))
            print(f"{path}: {med:.3f} ms a layer ({min(t):.3f}-{max(t):.3f}), "
                  f"{2 * start.nbytes / med / 1e6:.1f} GB/s state r+w, {ratio:.2f}x the first build's time")


if __name__ == "__main__":
    main()
