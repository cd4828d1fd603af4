"""Benchmark (not a test): CPU encode time of the vision tower at the real Qwen3.5/3.6 dimensions.

    python tests/bench_vision.py [--ftype F16|Q8_0|F32] [--threads N] [--mmproj PATH] [--repeat N]

Writes a random ``real`` mmproj (27 x 1152, 16 heads, ffn 4304, 48x48 grid, out 2048; ~0.9 GB F16) to
a temporary folder unless ``--mmproj`` names one, loads it (weights dequantized to float32, ~1.8 GB
RAM), and times ``VisionTower.encode`` on random 448x448 (196 tokens) and 1024x768 (768 tokens)
images, preprocessing excluded and reported apart. Prints seconds per image (best of ``--repeat``).
``--threads`` sets the BLAS thread count (OPENBLAS/OMP/MKL variables, before numpy loads).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ftype", default="F16", choices=["F32", "F16", "Q8_0"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mmproj", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import numpy as np
    from PIL import Image

    from engine.images import prepare_image
    from engine.mmproj import load_mmproj, synth_mmproj
    from engine.models.vision import VisionTower

    with tempfile.TemporaryDirectory() as tmp:
        path = args.mmproj
        if path is None:
            t0 = time.perf_counter()
            path = synth_mmproj(Path(tmp) / f"real-{args.ftype}.gguf", "real", seed=0, ftype=args.ftype)
            print(f"synth real mmproj {args.ftype}: {path.stat().st_size / 1e9:.2f} GB in "
                  f"{time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        mm = load_mmproj(path)
        tower = VisionTower(mm)
        print(f"load + dequantize: {time.perf_counter() - t0:.1f} s; {mm.hparams}")
        rng = np.random.default_rng(0)
        for h, w in [(448, 448), (768, 1024)]:
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            t0 = time.perf_counter()
            prep = prepare_image(img, patch=mm.hparams.patch_size, merge=mm.hparams.merge)
            t_prep = time.perf_counter() - t0
            best = float("inf")
            for _ in range(max(1, args.repeat)):
                t0 = time.perf_counter()
                out = tower.encode(prep.pixel_values, prep.grid)
                best = min(best, time.perf_counter() - t0)
            print(f"{w}x{h}: {out.shape[0]} tokens, {prep.pixel_values.shape[0]} patches; "
                  f"preprocess {t_prep:.3f} s, encode {best:.2f} s")


if __name__ == "__main__":
    main()
