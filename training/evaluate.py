"""Evaluate the exported demo model through the engine (numpy/C), not torch.

    python training/evaluate.py accuracy [--scenes 500] [--scale 2] [--model FILE]  # held-out exact-answer accuracy
    python training/evaluate.py accuracy --generator second        # on the second generator's scenes
    python training/evaluate.py conformance runs/demo              # engine vs torch logits, 20 inputs
    python training/evaluate.py ask IMAGE "What do you see?"       # one greedy answer

Held-out scenes of the first generator (``data.scene`` / ``data.render``, the plain scenes) use seeds
from ``data.EVAL_SEED_BASE`` (training uses seeds below 10**10, the tokenizer corpus 2 * 10**10 on);
the second generator (``second_scenes``, never used in training) numbers its own scenes from 0. Answers are greedy
(temperature 0) and must equal the reference answer string exactly. Results are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import data  # noqa: E402
import second_scenes  # noqa: E402
from engine.api import Engine, EngineOptions, SamplingParams  # noqa: E402
from engine.events import TokenEvent  # noqa: E402
from engine.turn.state import SequenceState  # noqa: E402

MODELS = ROOT / "assets" / "models"
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
GENERATORS = {"first": (data.scene, data.render, data.EVAL_SEED_BASE),
              "second": (second_scenes.scene, second_scenes.render, 0)}
"""name -> (scene of a seed, its drawing, first held-out seed)."""


def load(models: Path = MODELS, text: Path | None = None) -> Engine:
    """The demo pair in folder ``models``; ``text`` replaces its text GGUF (e.g. a pruned copy)."""
    return Engine.load(text or models / "deltadesk-demo.gguf", models / "deltadesk-demo-mmproj.gguf",
                       EngineOptions(context=1024, prefix_cache=False))


def ask(engine: Engine, question: str, image=None) -> str:
    """The engine's greedy answer to ``question`` (about ``image`` when given), stripped."""
    content = question if image is None else [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return "".join(ev.text for ev in engine.chat([{"role": "user", "content": content}], GREEDY)
                   if isinstance(ev, TokenEvent)).strip()


def accuracy(engine: Engine, n_scenes: int, scale: float = 1.0, generator: str = "first", progress: int = 0) -> dict:
    """Exact-answer accuracy per question type over ``n_scenes`` held-out scenes of ``generator`` (a key of
    :data:`GENERATORS`), every applicable question type of each.

    ``scale`` resizes each rendered scene (bicubic) before it is asked about, as a user's larger or smaller
    picture of the same scene would be; the engine then applies its own area bounds. ``progress`` > 0
    prints the running right / asked counts per question type to stderr every ``progress`` scenes (one
    JSON line each), for runs of an hour on a busy machine."""
    right = {k: 0 for k in data.QUESTION_TYPES}
    total = {k: 0 for k in data.QUESTION_TYPES}
    wrong: list[dict] = []
    make, draw, seed_base = GENERATORS[generator]
    t0 = time.time()
    for i in range(n_scenes):
        sc = make(seed_base + i)
        image = draw(sc)
        if scale != 1.0:
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
        for kind, (q, a) in data.questions(sc).items():
            got = ask(engine, q, image)
            total[kind] += 1
            right[kind] += got == a
            if got != a and len(wrong) < 25:
                wrong.append({"seed": sc.seed, "q": q, "want": a, "got": got})
        if progress and (i + 1) % progress == 0:
            print(json.dumps({"scenes": i + 1, "seconds": round(time.time() - t0, 1), "right": right, "asked": total}),
                  file=sys.stderr, flush=True)
    return {"generator": generator, "scenes": n_scenes, "scale": scale, "seconds": round(time.time() - t0, 1),
            "accuracy": {k: round(right[k] / total[k], 4) for k in total if total[k]},
            "counts": total, "examples_wrong": wrong}


def engine_logits(engine: Engine, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """All prompt logits of the engine, (n, n_vocab), for the rendered ``messages``."""
    prompt = engine.prepare(messages)
    tokens = np.asarray(prompt.tokens, dtype=np.int64)
    rows = engine.model.embed(tokens).copy()
    for start, emb, _ in prompt.images:
        rows[start:start + len(emb)] = emb
    state = SequenceState.new(engine.text.hparams, len(tokens))
    return prompt.tokens, engine.model.forward(tokens, state, embeddings=rows, positions=prompt.positions,
                                               all_logits=True)


def conformance(engines: dict[str, Engine], run: Path, n: int = 20) -> dict:
    """Engine vs torch (the trained float16 weights in float32) logits on ``n`` prompts: 16 held-out
    scene questions with images and 4 text-only chat lines."""
    import torch
    from export import load_run
    from engine.arch.qwen3vl.preprocess import prepare_image

    torch.set_num_threads(2)
    model = load_run(run)
    pad = model.config.image_token_id
    chats = [q for q, _ in data.chat_pairs()][::9][: n - 16]
    inputs = []
    for i in range(16):
        sc = data.scene(data.EVAL_SEED_BASE + 900_000 + i)
        q, _ = list(data.questions(sc).values())[i % 3]
        inputs.append((q, data.render(sc)))
    inputs += [(q, None) for q in chats]
    report = {name: {"max_abs": 0.0, "max_rel": 0.0, "argmax_agree": 0, "positions": 0} for name in engines}
    for q, image in inputs:
        content = q if image is None else [{"type": "image", "image": image}, {"type": "text", "text": q}]
        messages = [{"role": "user", "content": content}]
        kw = {}
        if image is not None:
            prep = prepare_image(image)
            kw = {"pixel_values": torch.from_numpy(prep.pixel_values),
                  "image_grid_thw": torch.tensor([[1, *prep.grid]])}
        for name, eng in engines.items():
            tokens, got = engine_logits(eng, messages)
            ids = torch.tensor([tokens])
            with torch.no_grad():
                want = model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), **kw).logits[0].numpy()
            diff = np.abs(got - want)
            r = report[name]
            r["max_abs"] = max(r["max_abs"], float(diff.max()))
            r["max_rel"] = max(r["max_rel"], float(diff.max() / np.abs(want).max()))
            r["argmax_agree"] += int((got.argmax(-1) == want.argmax(-1)).sum())
            r["positions"] += len(tokens)
    return {"inputs": len(inputs), **report}


def main() -> None:
    """Run the evaluation subcommand the arguments name (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--scenes", type=int, default=500)
    a.add_argument("--scale", type=float, default=1.0, help="resize each scene by this factor first")
    a.add_argument("--models", type=Path, default=MODELS, help="folder holding the two GGUF files")
    a.add_argument("--generator", choices=sorted(GENERATORS), default="first",
                   help="first: data.scene / data.render; second: second_scenes (held out from training)")
    a.add_argument("--model", type=Path, help="text GGUF to evaluate instead of the bundled one (same vision tower)")
    a.add_argument("--progress", type=int, default=0, metavar="N", help="print running counts to stderr every N scenes")
    c = sub.add_parser("conformance")
    c.add_argument("run", type=Path)
    c.add_argument("--f32", type=Path, help="folder with an f32 export of the same run, compared too")
    k = sub.add_parser("ask")
    k.add_argument("image", type=Path)
    k.add_argument("question")
    args = ap.parse_args()
    if args.cmd == "accuracy":
        result = accuracy(load(args.models, text=args.model), args.scenes, scale=args.scale,
                          generator=args.generator, progress=args.progress)
        print(json.dumps(result, indent=1))
    elif args.cmd == "conformance":
        engines = {"q8_0": load()}
        if args.f32:
            engines["f32"] = load(args.f32)
        print(json.dumps(conformance(engines, args.run), indent=1))
    else:
        print(json.dumps({"image": str(args.image), "question": args.question,
                          "answer": ask(load(), args.question, str(args.image))}))


if __name__ == "__main__":
    main()
