"""Profile (not a test): where the MiniCPM-V 4.6 tower's thread CPU time goes, stage by stage, at one thread.

    python tests/bench/profile_minicpmv.py [--mmproj PATH] [--sizes 448x448,1024x768] [--repeat 3] [--mode 16x|4x]

Builds the real-size random projector (F16, ~1.1 GB, in a temporary folder) unless ``--mmproj`` names one, builds
``MiniCPMVTower(mm, threads=1)`` and encodes random images ``--repeat`` times after one untimed run, timing every
call of the tower's steps with ``time.thread_time`` (the machine may be shared: wall time would count the other
processes). Each step's time is exclusive (a step's nested steps are counted apart; ``other`` is what the
encode spends outside them: gathers, the position table, splits). Prints, per size, the median over the runs of
every step's CPU seconds and, for the projections, their GFLOP/s; plus the load average before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


class Profile:
    """Exclusive thread CPU time and FLOPs per label of nested wrapped calls (one thread)."""

    def __init__(self):
        self.time: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    def wrap(self, owner, attr: str, label) -> None:
        """Replace ``owner.attr`` by a timed call; ``label(*args, **kwargs)`` -> (label, flops)."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            name, flops = label(*args, **kwargs)
            frame = [name, time.thread_time(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.thread_time() - frame[1]
                self.time[name] += spent - frame[2]
                self.flops[name] += flops
                if self._stack:
                    self._stack[-1][2] += spent

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.time.clear()
        self.flops.clear()


def _linear_label(tower, x, name, *args, **kwargs):
    kind = name.split(".")[-1] if name.startswith("v.blk.") else name
    return f"gemm {kind}", 2.0 * x.shape[0] * x.shape[1] * tower._packed_or_weight_rows(name)


def instrument(prof: Profile, tower_mod, sgemm_mod) -> None:
    """Wrap the tower's steps (module doc) in ``prof``."""
    cls = tower_mod.MiniCPMVTower

    def rows(self, name):
        return self._packed[name].n if self._native else len(self._weight(name))

    cls._packed_or_weight_rows = rows
    prof.wrap(cls, "encode", lambda *a, **k: ("other", 0.0))
    prof.wrap(cls, "_vit_merger", lambda *a, **k: ("merger other", 0.0))
    prof.wrap(cls, "_block", lambda *a, **k: ("block other", 0.0))
    prof.wrap(cls, "_norm_into", lambda self, x, name, out: ("layernorm", 0.0))
    prof.wrap(cls, "_linear", _linear_label)
    prof.wrap(cls, "_qkv", lambda self, a, p, buf: (
        "gemm qkv" if p.startswith("v.blk.") else "gemm merger qkv", 2.0 * a.shape[0] * a.shape[1] * 3 * a.shape[1]))
    prof.wrap(sgemm_mod, "vit_attention", lambda qkv, starts, *a, **k: (
        "window attention" if len(starts) > 2 and starts[1] == 4 and starts[2] == 8 else "attention", 0.0))
    prof.wrap(tower_mod, "window_attention", lambda *a, **k: ("window attention", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mmproj", type=Path, default=None)
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", default=None, choices=["16x", "4x"])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                    help="the checkout whose engine (and built extension) to profile, e.g. an older revision's")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(args.root))

    import numpy as np
    from PIL import Image

    from bench_vision import load_average
    from engine.arch.minicpmv import tower as tower_mod
    print(f"engine from {Path(tower_mod.__file__).parents[2]}")
    from engine.arch.minicpmv.mmproj import load_mmproj
    from engine.testing.minicpmv import synth_mmproj
    from engine.arch.minicpmv.preprocess import prepare_pieces
    from engine.kernels import sgemm

    with tempfile.TemporaryDirectory() as tmp:
        path = args.mmproj or synth_mmproj(Path(tmp) / "minicpmv46-mmproj.gguf", "real", ftype="F16")
        mm = load_mmproj(path)
        tower = tower_mod.MiniCPMVTower(mm, threads=1, mode=args.mode)
    prof = Profile()
    instrument(prof, tower_mod, sgemm)
    print(f"tower on {'the native kernels' if tower.native else 'numpy tiles'}, mode {tower.mode}, 1 thread")
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.lower().split("x"))
        img = Image.fromarray((np.random.default_rng(1).random((h, w, 3)) * 255).astype(np.uint8))
        prep = prepare_pieces(img, scale=mm.hparams.image_size, patch=mm.hparams.patch_size, mode=tower.mode)
        grids = prep.plan.piece_grids
        runs: list[tuple[dict, dict]] = []
        load0 = load_average()
        for i in range(args.repeat + 1):
            prof.reset()
            tower.encode(prep.pieces, grids)
            if i:
                runs.append((dict(prof.time), dict(prof.flops)))
        print(f"\n{size}: {len(grids)} piece(s) {grids}, load {load0} -> {load_average()}, "
              f"median of {args.repeat} (thread CPU s)")
        labels = sorted(runs[0][0], key=lambda k: -runs[0][0][k])
        for k in labels:
            t = statistics.median(r[0][k] for r in runs)
            fl = runs[0][1].get(k, 0.0)
            rate = f"  {fl / t / 1e9:6.1f} GFLOP/s" if fl and t else ""
            print(f"  {k:22s} {t:7.3f} s{rate}")
        totals = [sum(r[0].values()) for r in runs]
        print(f"  {'total':22s} {statistics.median(totals):7.3f} s (runs: "
              + ", ".join(f"{t:.3f}" for t in totals) + ")")


if __name__ == "__main__":
    main()
