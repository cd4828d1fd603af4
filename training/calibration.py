"""Expert statistics of the demo model on its own training distribution, for ``python -m engine prune``.

    python training/calibration.py [--samples 256] [--model assets/models/deltadesk-demo.gguf] [-o STATS.json]

The conversations follow :func:`data.training_sample`: sample ``i`` is, 1 time in 12, a chat line without
an image, else a random question type about the scene of seed ``TRAIN_SEED_BASE + i`` with its reference
answer, so no held-out scene (``EVAL_SEED_BASE`` on) is ever seen. They run through the engine
(:func:`engine.reap.prune.calibrate`) and the statistics are written where ``prune`` looks for them by
default (``MODEL.expert-stats.json`` beside the model), so ``python -m engine prune
assets/models/deltadesk-demo.gguf --keep 6 -o OUT.gguf`` then needs no calibration of its own.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import data  # noqa: E402
from engine.reap import prune  # noqa: E402
from engine.api import Engine, EngineOptions  # noqa: E402

MODELS = ROOT / "assets" / "models"


def conversations(n: int, start: int = 0) -> list[list[dict]]:
    """``n`` training-distribution conversations (user turn + reference answer) from sample ``start`` on."""
    out = []
    for index in range(start, start + n):
        rng = random.Random(index * 31 + 5)
        if rng.random() < 1 / 12:
            q, a = rng.choice(data.chat_pairs())
            user: object = q
        else:
            sc = data.scene(data.TRAIN_SEED_BASE + index)
            qs = data.questions(sc)
            q, a = qs[rng.choice(list(qs))]
            user = [{"type": "image", "image": data.render(sc)}, {"type": "text", "text": q}]
        out.append([{"role": "user", "content": user}, {"role": "assistant", "content": a}])
    return out


def main() -> None:
    """Write the demo model's expert statistics for ``engine prune`` (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--model", type=Path, default=MODELS / "deltadesk-demo.gguf")
    ap.add_argument("--mmproj", type=Path, default=MODELS / "deltadesk-demo-mmproj.gguf")
    ap.add_argument("--output", "-o", type=Path, help="default: MODEL.expert-stats.json beside the model")
    args = ap.parse_args()
    engine = Engine.load(args.model, args.mmproj, EngineOptions(device="cpu", prefix_cache=False))
    convs = conversations(args.samples)

    def show(done: int, total: int, tokens: int) -> None:
        if done % 16 and done != total:
            return
        print(f"\r[calibrating] {done}/{total} samples, {tokens} tokens", end="\n" if done == total else "",
              file=sys.stderr, flush=True)

    stats = prune.calibrate(engine, convs, progress=show,
                            calibration={"source": f"training/calibration.py: training samples 0..{args.samples - 1}"})
    out = args.output or prune.default_stats_path(args.model)
    stats.save(out)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
