"""Benchmark (not a test): CPU encode time of the MiniCPM-V 4.6 tower at its real dimensions, with the sgemm floor.

    python tests/bench/bench_minicpmv.py [--threads N] [--mmproj PATH] [--repeat N] [--sizes 448x448,1024x768]
                                   [--mode 16x|4x] [--baseline REV]

Writes a random ``real`` projector (27 x 1152, 16 heads, ffn 4304, 70x70 grid, out 1024; ~1.1 GB F16) to a
temporary folder unless ``--mmproj`` names one, loads it (weights dequantized to float32, ~2.2 GB RAM) and
times ``MiniCPMVTower.encode`` on every piece of random images (448x448 = 1 piece, 64 tokens; 1024x768 =
5 pieces, 315 tokens), preprocessing excluded and reported apart. Prints the best and median seconds of
``--repeat`` runs after ``--warmup`` untimed ones (default 1), the 1-minute load average before and after, and the
**sgemm floor**: the tower's GEMM FLOPs (projections, attention products, patch embedding, both mergers) divided by the
float32 GEMM rate measured on this machine just before (a 1024 x 1152 x 4304 ``numpy.matmul`` at the same thread count),
i.e. the time the tower would take if every GEMM ran at that rate and everything else were free; and the same FLOPs over
the native packed-weight GEMM's rate on that product (``engine.kernels.sgemm``, what the tower's projections and
attention run on when the CPU has AVX-512; the first line says which path the tower takes).

``--baseline REV`` also loads ``engine/arch/minicpmv/tower.py`` as it is at git revision REV (e.g. ``main`` or a
commit) and times it on the same weights, runs interleaved (baseline, current, baseline, ...) so that both see
the same machine load; it prints both, their process CPU time, and the largest relative difference of the
outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_vision import load_average


def tower_flops(grids: list[tuple[int, int]], hp, mode: str) -> float:
    """Multiply-add FLOPs (2 per MAC) of the GEMMs of one image's pieces (``engine.arch.minicpmv.tower``)."""
    d, f, o = hp.n_embd, hp.n_ff, hp.out_dim
    total = 0.0
    for gh, gw in grids:
        s = gh * gw
        total += 2 * s * hp.patch_dim * d
        for il in range(hp.n_layer):
            n = s if mode == "4x" or il <= hp.insert_layer else s // 4
            total += 2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d
            if mode == "16x" and il == hp.insert_layer:
                total += 2 * s * 4 * d * d + 2 * (s // 4) * (16 * d * f + 4 * f * d) + 4 * 4 * s * d
        tokens = s // (16 if mode == "16x" else 4)
        total += 2 * tokens * (16 * d * d + 4 * d * o)
    return total


def sgemm_rate(repeat: int = 5) -> float:
    """Best float32 GEMM rate of ``numpy.matmul`` on a (1024, 1152) x (1152, 4304) product, FLOP/s."""
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.random((1024, 1152), dtype=np.float32)
    b = rng.random((1152, 4304), dtype=np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024 * 1152 * 4304 / best


def native_gemm_rate(threads: int | None, repeat: int = 5) -> float | None:
    """Best rate of the native packed-weight GEMM (:mod:`engine.kernels.sgemm`, what the tower uses on AVX-512 CPUs)
    on the same (1024, 1152) x (1152, 4304) product at ``threads`` threads, FLOP/s; None when it is not available."""
    import numpy as np

    from engine.kernels import sgemm
    if not sgemm.available():
        return None
    rng = np.random.default_rng(0)
    a = rng.random((1024, 1152), dtype=np.float32)
    pw = sgemm.PackedWeight(rng.random((4304, 1152), dtype=np.float32))
    out = np.empty((1024, 4304), dtype=np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        pw(a, out=out, threads=threads or os.cpu_count() or 1)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024 * 1152 * 4304 / best


def baseline_tower_class(rev: str, folder: Path):
    """``MiniCPMVTower`` of ``engine/arch/minicpmv/tower.py`` at git revision ``rev``, loaded as a module of the
    ``engine.arch.minicpmv`` package (its relative imports resolve against the current package)."""
    root = Path(__file__).resolve().parents[2]
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:engine/arch/minicpmv/tower.py"], check=True,
                         capture_output=True, text=True).stdout
    path = folder / "baseline_tower.py"
    path.write_text(src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("engine.arch.minicpmv._baseline_tower", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MiniCPMVTower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mmproj", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="448x448,1024x768", help="comma-separated WIDTHxHEIGHT")
    ap.add_argument("--mode", default=None, choices=["16x", "4x"], help="default: the file's")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    ap.add_argument("--baseline", default=None, help="git revision whose tower is timed interleaved with this one")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    import numpy as np
    from PIL import Image
    from threadpoolctl import threadpool_limits

    from engine.arch.minicpmv.mmproj import load_mmproj
    from engine.testing.minicpmv import synth_mmproj
    from engine.arch.minicpmv.preprocess import prepare_pieces
    from engine.arch.minicpmv.tower import MiniCPMVTower

    with tempfile.TemporaryDirectory() as tmp:
        path = args.mmproj or synth_mmproj(Path(tmp) / "minicpmv46-mmproj.gguf", "real", ftype="F16")
        t0 = time.perf_counter()
        mm = load_mmproj(path)
        print(f"loaded {path} in {time.perf_counter() - t0:.1f} s")
        towers = {"current": MiniCPMVTower(mm, threads=args.threads, mode=args.mode)}
        if args.baseline:
            towers = {f"baseline {args.baseline}": baseline_tower_class(args.baseline, Path(tmp))(
                mm, threads=args.threads, mode=args.mode), **towers}
    tower = towers["current"]
    with threadpool_limits(limits=args.threads, user_api="blas"):
        rate = sgemm_rate()
    ours = native_gemm_rate(args.threads)
    print(f"mode {tower.mode}, threads {args.threads or 'BLAS default'}, sgemm {rate / 1e9:.1f} GFLOP/s, native GEMM "
          + (f"{ours / 1e9:.1f} GFLOP/s" if ours else "not available (numpy tiles)")
          + f"; tower projections on {'the native GEMM' if tower.native else 'numpy tiles'}")
    for size in args.sizes.split(","):
        w, h = (int(x) for x in size.lower().split("x"))
        img = Image.fromarray((np.random.default_rng(1).random((h, w, 3)) * 255).astype(np.uint8))
        t0 = time.perf_counter()
        prep = prepare_pieces(img, scale=mm.hparams.image_size, patch=mm.hparams.patch_size, mode=tower.mode)
        t_prep = time.perf_counter() - t0
        grids = prep.plan.piece_grids
        times: dict[str, list[float]] = {k: [] for k in towers}
        cpu: dict[str, list[float]] = {k: [] for k in towers}
        outs: dict[str, np.ndarray] = {}
        load0 = load_average()
        for i in range(args.warmup + args.repeat):
            for name, tw in towers.items():
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name] = np.concatenate(tw.encode(prep.pieces, grids))
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        flops = tower_flops(grids, mm.hparams, tower.mode)
        floor = flops / rate
        native_floor = f", native GEMM floor {flops / ours:.2f} s" if ours else ""
        for name in towers:
            t = times[name]
            print(f"{w}x{h} {name}: {len(grids)} pieces, {sum(prep.plan.token_counts)} tokens | encode best "
                  f"{min(t):.2f} s, median {statistics.median(t):.2f} s, max {max(t):.2f} s (n={len(t)}), process "
                  f"CPU median {statistics.median(cpu[name]):.2f} s | sgemm floor {floor:.2f} s{native_floor} | "
                  "preprocess "
                  f"{t_prep * 1000:.0f} ms | load {load0} -> {load_average()}")
        if len(outs) > 1:
            ref = outs["current"]
            diff = max(float(np.linalg.norm(o - ref) / np.linalg.norm(ref)) for o in outs.values())
            print(f"{w}x{h}: largest relative difference between the towers' outputs {diff:.2e}")


if __name__ == "__main__":
    main()
