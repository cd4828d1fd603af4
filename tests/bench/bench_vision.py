"""Benchmark (not a test): encode time of the vision tower at the real Qwen3.5/3.6 dimensions, CPU or GPU.

    python tests/bench/bench_vision.py [--device cpu|cuda] [--ftype F16|Q8_0|F32] [--threads N] [--mmproj PATH]
                                 [--repeat N] [--sizes 448x448,1024x768] [--profile]

Writes a random ``real`` mmproj (27 x 1152, 16 heads, ffn 4304, 48x48 grid, out 2048; ~0.9 GB F16) to
a temporary folder unless ``--mmproj`` names one, loads it (weights dequantized to float32, ~1.8 GB
RAM), and times ``VisionTower.encode`` on random images (default 448x448 = 196 tokens and 1024x768 =
768 tokens), preprocessing excluded and reported apart. Prints the best and the median seconds of
``--repeat`` runs after one warm-up run, with the 1-minute load average before and after (on a shared
machine other processes' load changes the wall time several-fold; compare runs made side by side).

``--threads N`` sets the tower's worker threads and the BLAS thread count (OPENBLAS/OMP/MKL variables,
before numpy loads); default: the engine's CPU thread count. ``--profile`` adds the time per stage,
summed over the 27 blocks, from the stage callback: ``attn_out`` = LN1 + qkv + RoPE + attention + output
projection, ``layer_out`` = LN2 + FFN, ``post_ln`` / ``merger_out`` = the merger (CPU only).

``--device cuda`` times ``CudaVisionTower.encode`` instead (engine.arch.qwen3vl.cuda): each timed call
includes the host -> device copy of the patches and tables and the copy of the result back; the first call
(warm-up) also sizes the device buffers. The weight upload (file re-read, padding, copies; the kernel build
excluded) is reported on its own line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def load_average() -> str:
    """The 1-minute load average, or "?" where /proc is absent."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ftype", default="F16", choices=["F32", "F16", "Q8_0"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mmproj", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="448x448,1024x768", help="comma-separated WIDTHxHEIGHT")
    ap.add_argument("--profile", action="store_true", help="CPU: time per stage")
    ap.add_argument("--check", action="store_true", help="cuda: also print the max error against the CPU tower")
    args = ap.parse_args()
    if args.threads:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    import numpy as np
    from PIL import Image

    from engine.arch.qwen3vl.preprocess import prepare_image
    from engine.arch.qwen3vl.mmproj import load_mmproj
    from engine.testing.qwen3vl import synth_mmproj
    from engine.arch.qwen3vl.tower import VisionTower

    with tempfile.TemporaryDirectory() as tmp:
        path = args.mmproj
        if path is None:
            t0 = time.perf_counter()
            path = synth_mmproj(Path(tmp) / f"real-{args.ftype}.gguf", "real", seed=0, ftype=args.ftype)
            print(f"synth real mmproj {args.ftype}: {path.stat().st_size / 1e9:.2f} GB in "
                  f"{time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        mm = load_mmproj(path)
        print(f"load + dequantize: {time.perf_counter() - t0:.1f} s; {mm.hparams}")
        if args.device == "cuda":
            from engine.arch.qwen3vl.cuda import CudaVisionTower

            t0 = time.perf_counter()
            tower = CudaVisionTower(mm)
            print(f"GPU tower: {time.perf_counter() - t0:.2f} s to build, of which weight upload "
                  f"{tower.upload_seconds:.2f} s ({tower.weight_bytes / 2**30:.2f} GiB)")
        else:
            tower = VisionTower(mm, threads=args.threads)
            print(f"CPU tower: {tower.threads} threads")
        rng = np.random.default_rng(0)
        for size in args.sizes.split(","):
            w, h = (int(x) for x in size.split("x"))
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            t0 = time.perf_counter()
            prep = prepare_image(img, patch=mm.hparams.patch_size, merge=mm.hparams.merge)
            t_prep = time.perf_counter() - t0
            stages: dict[str, float] = defaultdict(float)
            mark = [0.0]

            def cb(stage: str, il: int, x) -> None:
                now = time.perf_counter()
                stages[stage] += now - mark[0]
                mark[0] = now

            load_before = load_average()
            times = []
            for _ in range(1 + max(1, args.repeat)):
                stages.clear()
                t0 = mark[0] = time.perf_counter()
                if args.device == "cuda":
                    out = tower.encode(prep.pixel_values, prep.grid)
                else:
                    out = tower.encode(prep.pixel_values, prep.grid, cb=cb if args.profile else None)
                times.append(time.perf_counter() - t0)
            times = times[1:]
            print(f"{w}x{h} ({args.device}): {out.shape[0]} tokens, {prep.pixel_values.shape[0]} patches; "
                  f"preprocess {t_prep:.3f} s, encode best {min(times):.3f} s, median {statistics.median(times):.3f} s "
                  f"of {len(times)} (load average {load_before} -> {load_average()})")
            if args.check and args.device == "cuda":
                want = VisionTower(mm, threads=args.threads).encode(prep.pixel_values, prep.grid)
                err = float(np.abs(out - want).max() / np.abs(want).max())
                print(f"  max |gpu - cpu| / max |cpu| = {err:.2e}")
            if args.profile and args.device == "cpu":
                print("  last run by stage (s): " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))


if __name__ == "__main__":
    main()
