"""Benchmark (not a test): the MiniCPM-V 4.6 tower with 64-byte aligned arrays against the same code with numpy's
usual placement (16 bytes past a cache line), interleaved in one process.

    python tests/bench/bench_minicpmv_align.py [--mmproj PATH] [--size 448x448] [--rounds 10] [--threads 1]

``engine.kernels.sgemm.empty_aligned`` places the packed weight panels, the tower's block buffers and the arrays
the sgemm module allocates on a 64-byte line. This script builds two towers on the same projector: one as the engine
does, one with ``empty_aligned`` swapped for a function that returns its arrays 16 bytes past a line (where numpy's
``np.empty`` put them before), and encodes the same random image with each in turn (A B, B A, ...), checking that
both give the same bits. It prints the median and best time of each and the median of the paired ratios
aligned / old with its quartiles. One thread: thread CPU time of ``encode`` (the machine may be shared); more: wall
time. Writes a random ``real`` F16 projector to a temporary folder unless ``--mmproj`` names one; needs ~5 GB RAM
(two towers' packed weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_vision import load_average

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.arch.minicpmv import tower as tower_mod  # noqa: E402
from engine.arch.minicpmv.mmproj import load_mmproj  # noqa: E402
from engine.testing.minicpmv import synth_mmproj  # noqa: E402
from engine.arch.minicpmv.preprocess import prepare_pieces  # noqa: E402
from engine.kernels import sgemm  # noqa: E402

ALIGNED = sgemm.empty_aligned
OLD = {"on": False}


def _placed(shape):
    """``empty_aligned``'s array, or with OLD["on"] the same shape 16 bytes past a line (numpy's usual)."""
    if not OLD["on"]:
        return ALIGNED(shape)
    count = int(np.prod(shape))
    return ALIGNED(count + 4)[4:].reshape(shape)


def _time(tower, pieces, grids, clock):
    t = clock()
    out = tower.encode(pieces, grids)
    return clock() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mmproj", type=Path, default=None)
    ap.add_argument("--size", default="448x448", help="WIDTHxHEIGHT")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    sgemm.empty_aligned = _placed
    with tempfile.TemporaryDirectory() as tmp:
        mm = load_mmproj(args.mmproj or synth_mmproj(Path(tmp) / "minicpmv46-mmproj.gguf", "real", ftype="F16"))
        towers = {}
        for name in ("old", "aligned"):
            OLD["on"] = name == "old"
            towers[name] = tower_mod.MiniCPMVTower(mm, threads=args.threads)
    from PIL import Image
    w, h = (int(v) for v in args.size.lower().split("x"))
    img = Image.fromarray((np.random.default_rng(1).random((h, w, 3)) * 255).astype(np.uint8))
    prep = prepare_pieces(img, scale=mm.hparams.image_size, patch=mm.hparams.patch_size, mode=towers["old"].mode)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"old": [], "aligned": []}
    load0 = load_average()
    for r in range(args.rounds + 1):   # round 0 warms both up
        outs = {}
        for name in (("old", "aligned") if r % 2 else ("aligned", "old")):
            OLD["on"] = name == "old"
            dt, outs[name] = _time(towers[name], prep.pieces, prep.plan.piece_grids, clock)
            if r:
                times[name].append(dt)
        assert all(np.array_equal(a, b) for a, b in zip(outs["old"], outs["aligned"], strict=True)), "bits differ"
    ratio = np.array(times["aligned"]) / np.array(times["old"])
    what = "thread CPU" if args.threads == 1 else "wall"
    print(f"{args.size}, {args.threads} thread(s), {what} s per encode, {args.rounds} rounds, "
          f"load {load0} -> {load_average()}")
    for name, t in times.items():
        print(f"  {name:8s} median {statistics.median(t):.3f}  best {min(t):.3f}")
    print(f"  aligned / old, paired: median {np.median(ratio):.3f} "
          f"(quartiles {np.percentile(ratio, 25):.3f} .. {np.percentile(ratio, 75):.3f}); outputs bit-identical")


if __name__ == "__main__":
    main()
